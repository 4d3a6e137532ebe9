"""What every benchmark shares: the timing rule, the run's ceilings, the correctness check, and
the facts a result file records about its run (device, versions, commit).

Timing rule (`pipelined_ms`, `carried_ms`, `torch_pipelined_ms`): a warm-up, then `iters` calls
issued back to back and one sync; the figure is the mean per call.  Ours and the peer are timed
by the same rule, so neither pays a sync per call that the other does not.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- timing


def pipelined_ms(fn, *args, iters: int = 20, warmup: int = 3) -> float:
    """ms per call of fn(*args): `warmup` synchronized calls, then `iters` calls back to back and
    one `block_until_ready` on the last output."""
    import jax

    for _ in range(max(warmup, 1)):
        jax.block_until_ready(fn(*args))
    out = None
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def carried_ms(step, carry, *, iters: int = 20, warmup: int = 3) -> float:
    """ms per call of step(carry) -> (out, carry) with the carry fed forward (a donated state pool
    updated in place, as a serving step does): calls back to back, one sync at the end."""
    import jax

    out = None
    for _ in range(max(warmup, 1)):
        out, carry = step(carry)
    jax.block_until_ready((out, carry))
    t0 = time.perf_counter()
    for _ in range(iters):
        out, carry = step(carry)
    jax.block_until_ready((out, carry))
    return (time.perf_counter() - t0) / iters * 1e3


def host_ms(fn, *, iters: int = 3, warmup: int = 1) -> float:
    """ms per call of a host-side fn() (median of `iters` after `warmup`): for work that ends on the
    host (a host-tier copy), where there is no device queue to keep full."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def torch_pipelined_ms(fn, *, iters: int = 20, warmup: int = 3) -> float:
    """ms per call of a torch callable by `pipelined_ms`'s rule: CUDA events around `iters` calls
    issued back to back."""
    import torch

    for _ in range(max(warmup, 1)):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


# --------------------------------------------------------------------------- ceilings


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_copy_gbs(nbytes: int = 1 << 30) -> float | None:
    """Device-to-device `copy_` rate of torch over `nbytes` (read + write), GB/s; None without
    torch or a CUDA device."""
    torch = _torch_cuda()
    if torch is None:
        return None
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = torch_pipelined_ms(lambda d=dst, s=src: d.copy_(s), iters=20)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192) -> dict:
    """bf16 [n, n] @ [n, n] rates of XLA and of torch (None where it does not run), TFLOP/s."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    xla = 2 * n**3 / (pipelined_ms(jax.jit(lambda x: x @ x), a) * 1e-3) / 1e12
    del a
    torch, tflops = _torch_cuda(), None
    if torch is not None:
        t = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        tflops = 2 * n**3 / (torch_pipelined_ms(lambda: t @ t) * 1e-3) / 1e12
        del t
        torch.cuda.empty_cache()
    return {"xla_matmul_tflops": xla, "torch_matmul_tflops": tflops}


def measure_ceilings() -> dict:
    """The run's ceilings, measured once in the benchmarks' own process.  memory_gbs: torch
    `copy_` of 1 GiB (read + write); compute_tflops: the best bf16 matmul of XLA and torch.  Both
    None on the CPU or without torch (the fractions of ceiling are then left out); the measured
    parts are kept beside them."""
    import jax

    out = {
        "memory_gbs": None,
        "compute_tflops": None,
        "torch_copy_gbs": None,
        "xla_matmul_tflops": None,
        "torch_matmul_tflops": None,
    }
    if jax.default_backend() != "gpu":
        return out
    out["torch_copy_gbs"] = torch_copy_gbs()
    out.update(matmul_tflops())
    if out["torch_copy_gbs"] is not None:
        out["memory_gbs"] = out["torch_copy_gbs"]
        out["compute_tflops"] = max(out["xla_matmul_tflops"], out["torch_matmul_tflops"] or 0.0)
    return out


# --------------------------------------------------------------------------- checks


def check(got, want, tol: float, *, relative: bool = True, l2: bool = False) -> dict:
    """{max_err, tol, ok}: the largest |got - want| (over max |want| with `relative`), or with `l2`
    the relative L2 error |got - want| / |want|; in fp64."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return {"max_err": float("inf"), "tol": tol, "ok": False}
    if l2:
        err = float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
    else:
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        if relative:
            err /= max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-30)
    return {"max_err": err, "tol": tol, "ok": bool(np.isfinite(err) and err <= tol)}


def merge_checks(*checks: dict) -> dict:
    """The worst of several checks' errors (each over its own tolerance), as one check."""
    over = lambda c: c["max_err"] / c["tol"] if c["tol"] else (float("inf") if c["max_err"] else 0.0)
    worst = max(checks, key=over)
    return {"max_err": worst["max_err"], "tol": worst["tol"], "ok": all(c["ok"] for c in checks)}


# --------------------------------------------------------------------------- the run's facts


def device_name() -> str:
    """The first device's name as jax reports it ("NVIDIA H100 80GB HBM3", "cpu")."""
    import jax

    return jax.devices()[0].device_kind


def device_slug(name: str) -> str:
    """A short file-name form of a device name: "h100", "h200", "cpu", else its letters."""
    low = name.lower()
    for gpu in ("h200", "h100", "h20", "b200", "a100", "l40s", "l4"):
        if gpu in low:
            return gpu
    if low in ("cpu", "host") or "cpu" in low:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", low).strip("_") or "device"


def host_cpu() -> str:
    """The host's processor model and core count."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def versions() -> dict:
    """Versions of the packages a figure depends on (None where absent)."""
    out = {}
    for key, dists in (
        ("jax", ("jax",)),
        ("jaxlib", ("jaxlib",)),
        ("torch", ("torch",)),
        ("triton", ("triton",)),
        ("fla", ("fla-core", "flash-linear-attention")),
    ):
        out[key] = None
        for dist in dists:
            try:
                out[key] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def commit(root: str = ROOT) -> dict:
    """{sha, dirty} of the tree at root (git rev-parse HEAD; dirty: tracked files changed)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)
    sha = git("rev-parse", "HEAD")
    if sha.returncode:
        return {"sha": None, "dirty": None}
    return {"sha": sha.stdout.strip(), "dirty": bool(git("status", "--porcelain", "--untracked-files=no").stdout)}


def hlo_census(text: str) -> dict:
    """What a compiled XLA program launches per call, from `jitted.lower(...).compile().as_text()`:
    {"launches": launching ops of the entry computation, "ops": {opcode or custom-call target: n}}."""
    import collections

    no_launch = {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "add-dependency",
    }
    entry, inside = [], False
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside and "=" in line:
            entry.append(line.strip())

    def opcode(inst):
        m = re.search(r"=\s*(?:\([^=]*?\)|[\w\[\]{},:\s/*#.]+?)\s+([\w\-]+)\(", inst)
        op = m.group(1) if m else "?"
        if op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', inst)
            op = f"custom-call:{t.group(1) if t else '?'}"
        return op

    ops = collections.Counter(op for op in map(opcode, entry) if op not in no_launch)
    return {"launches": sum(ops.values()), "ops": dict(ops.most_common())}


# --------------------------------------------------------------------------- tables


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `columns` (missing values as "-")."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
