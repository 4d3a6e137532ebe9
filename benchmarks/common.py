"""Timing and reporting shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import statistics
import time


def time_jax(fn, *args, iters=20, warmup=3):
    """Median wall-clock ms of fn(*args), synchronized with block_until_ready."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def copy_gbs() -> float:
    """XLA device copy bandwidth (read + write) of a 1 GiB array, GB/s."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 28,), jnp.float32)
    return 2 * x.nbytes / (time_jax(jax.jit(lambda a: a * 1.0 + 0.0), x) * 1e-3) / 1e9


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown_tables(rows: list[dict]) -> str:
    """One markdown table per distinct row["section"] (or a single table without sections)."""
    lines = []
    for section in dict.fromkeys(r.get("section") for r in rows):
        sec = [r for r in rows if r.get("section") == section]
        keys = [k for k in dict.fromkeys(k for r in sec for k in r) if k != "section"]
        if section is not None:
            lines.append(f"\n### {section}\n")
        lines += ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
        lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in sec]
    return "\n".join(lines)


def write_results(out_dir: str, name: str, rows: list[dict]) -> str:
    """Print the tables and write <name>.md and <name>.json under out_dir; returns the markdown."""
    table = markdown_tables(rows)
    print(table)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return table


def profile_kernels(fn, *args, calls: int = 5, top: int | None = 20, top_host: int = 8,
                    log_dir: str | None = None) -> list[dict]:
    """Trace `calls` calls of fn(*args) with jax.profiler; rows (ms per call) of the device's
    busiest ops by (device line, op name), each line's "<busy>" total and "<ops>" count, then the
    host's busiest `top_host` events (Python dispatch, transfers): where a step's wall time
    exceeds its device busy time, the host rows say where it went.  top=None: every device op."""
    import collections
    import glob
    import gzip
    import tempfile

    import jax

    jax.block_until_ready(fn(*args))  # compiled outside the trace
    log_dir = log_dir or tempfile.mkdtemp(prefix="kimik3-trace-")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    path = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in procs.items() if "device" in name.lower()}
    busy_us, count, host_us = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        line = f"{procs.get(e['pid'], e['pid'])} {threads.get((e['pid'], e.get('tid')), e.get('tid'))}"
        if e.get("pid") in device:
            busy_us[(line, e["name"])] += e.get("dur", 0.0)
            busy_us[(line, "<busy>")] += e.get("dur", 0.0)
            count[line] += 1
        elif not e["name"].startswith(("$profiler", "$contextlib")):  # the trace's own stop
            host_us[(line, e["name"])] += e.get("dur", 0.0)
    row = lambda kind, line, op, ms: dict(section="profile", where=kind, line=line, op=op[:90], ms_per_call=ms)
    rows = [row("device", line, "<ops>", n / calls) for line, n in count.items()]
    top = top if top is not None else len(busy_us)
    rows += [row("device", line, name, us / calls / 1e3) for (line, name), us in busy_us.most_common(top)]
    rows += [row("host", line, name, us / calls / 1e3) for (line, name), us in host_us.most_common(top_host)]
    return rows


# Ops of an optimized GPU HLO module that launch nothing (views, tuples, constants, parameters).
_NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
              "replica-id", "opt-barrier", "add-dependency"}


def hlo_census(text: str) -> dict:
    """What a compiled XLA GPU program launches per call, from `jitted.lower(...).compile().as_text()`:
    {"launches": launching ops of the entry computation (kernels, custom calls, copies, loops),
    "while": loops among them, "ops": {opcode or custom-call target: count}}.

    XLA forms CUDA graphs (command buffers) *after* HLO optimization, from the thunk sequence, so
    they do not show here: see them with `TF_CPP_VMODULE=command_buffer_thunk=3` or the
    `*.thunk_sequence_after_thunk_passes.txt` of `--xla_dump_to`."""
    import collections
    import re

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

    ops = collections.Counter(op for op in map(opcode, entry) if op not in _NO_LAUNCH)
    return {"launches": sum(ops.values()), "while": ops.get("while", 0), "ops": dict(ops.most_common())}


def hlo_sources(text: str, frames: int = 2) -> dict[str, str]:
    """{instruction name: "file:line function < caller ..."} of a compiled HLO module's entry
    computation: each instruction's stack frame (a fusion carries its root op's), innermost
    `frames` of them, from the module's FileNames / FunctionNames / FileLocations / StackFrames
    tables.  Joins a trace's op names to the Python lines that made them."""
    import re

    tables, section, entry, inside = {}, None, [], False
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line, {})
        elif section is not None and re.match(r"^\d+ ", line):
            k, v = line.split(" ", 1)
            section[int(k)] = v
        elif line.startswith("ENTRY "):
            section, inside = None, True
        elif inside and line.startswith("}"):
            break
        elif inside and "=" in line:
            entry.append(line.strip())
        elif not line.strip():
            section = None
    files = {k: os.path.relpath(v.strip('"')) for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}

    def field(v, name):
        m = re.search(rf"{name}=(\d+)", v)
        return int(m.group(1)) if m else None

    def where(loc_id):
        v = tables.get("FileLocations", {}).get(loc_id, "")
        return f"{files.get(field(v, 'file_name_id'), '?')}:{field(v, 'line')} {funcs.get(field(v, 'function_name_id'), '?')}"

    def stack(frame_id):
        out, seen = [], set()
        while frame_id and frame_id not in seen and len(out) < frames:
            seen.add(frame_id)
            v = tables.get("StackFrames", {}).get(frame_id, "")
            out.append(where(field(v, "file_location_id")))
            frame_id = (field(v, "parent_frame_id") or 1) - 1  # printed one above the parent's id; 0: none
        return " < ".join(out) or "?"

    out = {}
    for inst in entry:
        name = inst.split("=", 1)[0].removeprefix("ROOT ").strip().lstrip("%")
        op = re.search(r'op_name="([^"]+)"', inst)
        # the module path without the layer index: one row per kind of op, summed over layers
        path = re.sub(r"layer_\d+", "layer_N", op.group(1)).split("/", 1)[-1] if op else "?"
        what = f"{path} @ {stack(field(inst, 'stack_frame_id'))}"
        dedup = re.search(r'deduplicated_name="([^"]+)"', inst)
        # a trace names a kernel by its fusion's deduplicated name ('.' -> '_'), a Pallas call by
        # its kernel name (op_name's last part); every instance of one kernel shares the trace row
        for key in {name, dedup.group(1) if dedup else name} | ({path.rsplit("/", 1)[-1]} if "custom-call" in inst else set()):
            out.setdefault(key.replace(".", "_").replace("-", "_"), what)
    return out


def by_source(profile_rows: list[dict], sources: dict[str, str], top: int = 60) -> list[dict]:
    """Device ms per call of `profile_kernels` rows (taken with top=None) summed by the Python line
    that made each op (`hlo_sources`), busiest first, with the op count per line."""
    import collections

    ms, n = collections.Counter(), collections.Counter()
    for r in profile_rows:
        if r["where"] != "device" or r["op"].startswith("<"):
            continue
        key = sources.get(r["op"].replace(".", "_").replace("-", "_"), f"? {r['op'][:40]}")
        ms[key] += r["ms_per_call"]
        n[key] += 1
    return [dict(section="by source", source=k, ms_per_call=v, ops=n[k]) for k, v in ms.most_common(top)]


def torch_copy_gbs(nbytes: int = 1 << 30) -> float | None:
    """Device-to-device copy rate (read + write) of torch's `copy_` over `nbytes`, GB/s: the
    memory ceiling (XLA's elementwise copy reads lower and would flatter a kernel measured
    against it).  None where torch or a CUDA device is missing."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 20
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    stop.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(stop) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds / 1e9


def time_pipelined(fn, *args, iters=20, warmup=3):
    """(ms per call with `iters` calls back to back and one sync, host ms to dispatch one call):
    the rate a serving loop that never waits between steps sees, and the host's share of it."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    out, host = None, 0.0
    t0 = time.perf_counter()
    for _ in range(iters):
        h0 = time.perf_counter()
        out = fn(*args)
        host += time.perf_counter() - h0
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3, host / iters * 1e3


def pipelined_ms(fn, *args, iters=20, warmup=3) -> float:
    """`time_pipelined`'s ms per call alone: the rule every side of a comparison is timed by."""
    return time_pipelined(fn, *args, iters=iters, warmup=warmup)[0]


def time_torch_pipelined(fn, iters=20, warmup=3) -> float:
    """ms per call of a torch callable with `iters` calls back to back and one sync (CUDA events
    around the whole batch): `time_pipelined`'s rule for a torch peer, so neither side is timed
    per call while the other is not (issue 22)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def pallas_copy_gbs(nbytes: int = 1 << 30) -> float | None:
    """Copy rate (read + write) of a Pallas (Triton) tiled copy kernel over `nbytes`, GB/s: a
    kernel of our own toolchain at the memory ceiling.  None off the GPU."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    if jax.default_backend() != "gpu":
        return None
    cols, rows_per_block = 4096, 8
    x = jnp.ones((nbytes // 4 // cols, cols), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    spec = pl.BlockSpec((rows_per_block, cols), lambda i: (i, 0))
    copy = jax.jit(lambda a: pl.pallas_call(kernel, grid=(a.shape[0] // rows_per_block,), in_specs=[spec],
                                            out_specs=spec, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
                                            compiler_params=pltriton.CompilerParams(num_warps=8))(a))
    return 2 * nbytes / (time_pipelined(copy, x)[0] * 1e-3) / 1e9


def matmul_tflops(n: int = 8192) -> dict:
    """bf16 [n, n] @ [n, n] rates, TFLOP/s: XLA's, torch's where it runs, and the best (the
    compute ceiling; it moves 620-790 between runs, so it is measured in each)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    out = {"xla_matmul_tflops": 2 * n ** 3 / (time_pipelined(jax.jit(lambda x: x @ x), a)[0] * 1e-3) / 1e12,
           "torch_matmul_tflops": None}
    try:
        import torch

        if torch.cuda.is_available():
            t = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
            out["torch_matmul_tflops"] = 2 * n ** 3 / (time_torch_pipelined(lambda: t @ t) * 1e-3) / 1e12
    except ImportError:
        pass
    out["matmul_tflops"] = max(v for v in out.values() if v is not None)
    return out


def ceilings() -> dict:
    """The honest ceilings of one run (issue 22): memory = the best device-to-device copy of torch
    `copy_` and a Pallas copy kernel (XLA's elementwise copy, kept for reference, reads lower and
    flatters a memory-bound kernel ~1.5x); compute = the best bf16 matmul of XLA and torch."""
    out = {"torch_copy_gbs": torch_copy_gbs(), "pallas_copy_gbs": pallas_copy_gbs(), "xla_copy_gbs": copy_gbs()}
    measured = [v for k, v in out.items() if k != "xla_copy_gbs" and v is not None]
    out["copy_gbs"] = max(measured) if measured else out["xla_copy_gbs"]
    out["copy_source"] = "best of torch copy_ and Pallas copy" if measured else "XLA elementwise copy (no GPU peer)"
    return {**out, **matmul_tflops()}
