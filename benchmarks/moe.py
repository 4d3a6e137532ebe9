"""Routed-expert grouped GEMM and FFN on the GPU: our Hopper kernel (`pallas_kernels.moe_hopper`)
and our Triton kernel (`pallas_kernels.moe`) vs JAX's Mosaic GPU `ragged_dot_mgpu` and
`lax.ragged_dot` (issue 22).

    PYTHONPATH=$PWD python3 benchmarks/moe.py [--out DIR] [--sections gemm,ffn] [--quick]

Timing rule (issue 22, `common.time_pipelined`): every side is a jitted function, called
`iters` times back to back, then one sync.  Ceilings of the same run (`common.ceilings`):
decode rows report the active experts' weight bytes over the time against the D2D copy rate;
prefill rows FLOP/s against the best bf16 matmul of XLA and torch.

Sections:
* "grouped GEMM": rows sorted by expert in, [M, N] out (`lax.ragged_dot`'s contract).  The peer
  `ragged_dot_mgpu` takes sorted rows as they are and is given its best of a small sweep of its
  tilings; so does ours, "hopper" (`moe_hopper.gmm_ragged`: the must-show's comparison).
  "hopper_padded" runs through the group-aligned layout (the scatter in and the gather out
  included), "hopper_kernel" is that kernel alone on a prebuilt layout (what `grouped_ffn` pays
  per GEMM, the layout being built once for both).  Each of our Hopper tilings is checked
  against `lax.ragged_dot` before it is timed; the best is reported with its tiling.
* "grouped FFN": a MoE layer's experts (top-4 routing of T tokens, gate ++ up with SiTU-GLU,
  then down): `moe.grouped_ffn` on the Triton and on the Hopper kernels against the same work
  on the peer (sort by expert, `ragged_dot_mgpu` for gate/up, the activation in XLA,
  `ragged_dot_mgpu` for down, unsort).
--quick: tiny shapes in interpret mode on the CPU (a smoke test of the script; no peers).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from kimik3.layers.moe import _SituGLU
from pallas_kernels import moe, moe_hopper

try:  # JAX's own Hopper ragged dot (wgmma + TMA), the peer
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
except Exception:  # noqa: BLE001 - the peer column stays empty
    ragged_dot_mgpu = None

ACT = _SituGLU((8.0, 8.0))
# (name, M rows, K, N, G): `small`'s expert projections (top-4 of 32, K = N = 768) at decode
# (M = 4 x batch) and prefill (M = 4 x tokens); one full-scale EP rank (G 24, K 1024, N 2048)
GEMMS = [("small decode B8", 32, 768, 768, 32), ("small decode B32", 128, 768, 768, 32),
         ("small decode B128", 512, 768, 768, 32), ("small prefill T2048", 8192, 768, 768, 32),
         ("small prefill T8192", 32768, 768, 768, 32), ("k3 rank decode B64", 512, 1024, 2048, 24),
         ("k3 rank prefill", 16384, 1024, 2048, 24)]
QUICK_GEMMS = [("quick", 300, 128, 256, 4)]
# (name, tokens, L, F, E, top_k)
FFNS = [("small prefill T2048", 2048, 768, 768, 32, 4), ("small prefill T8192", 8192, 768, 768, 32, 4),
        ("k3 rank prefill", 4096, 1024, 1024, 24, 4)]
QUICK_FFNS = [("quick", 64, 128, 128, 4, 2)]


def _case(rng, m, k, n, g):
    """Random rows routed to experts (multinomial over G), bf16."""
    sizes = rng.multinomial(m, np.ones(g) / g).astype(np.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / k ** 0.5, jnp.bfloat16)
    return lhs, rhs, jnp.asarray(sizes), int((sizes > 0).sum())


# Our Hopper tilings the bench sweeps (and tests/gpu checks): (tile_m, tile_n, steps, grid_width,
# m_minor); the first is `moe_hopper.default_tiling`'s where N allows.  Kept short: each is a compile.
HOPPER_SWEEP = [(128, 128, 4, 8, True), (128, 128, 4, 8, False), (128, 64, 4, 8, True), (64, 128, 4, 8, True),
                (128, 128, 3, 4, True), (64, 64, 4, 8, True)]


def hopper_tilings(m: int, n: int, act: bool, quick: bool) -> list[moe_hopper.HopperTiling]:
    """Our Hopper tilings to try for M rows and N output columns (F with act); a decode step's
    few rows (M <= 512, which stay on the Triton kernels) get the default only."""
    if quick:
        return [moe_hopper.HopperTiling(tile_m=64, tile_n=64, steps=2, grid_width=2)]
    out = [moe_hopper.HopperTiling(tile_m=tm, tile_n=tn, steps=st, grid_width=w, m_minor=mm)
           for tm, tn, st, w, mm in HOPPER_SWEEP if not (act and tn > 64) and n % (2 * tn) == 0]
    return out[:1] if m <= 512 else out


def mgpu_configs(m: int, n: int):
    """The peer's tilings to try (its own sweep's ranges, cut to a few): (block_m, block_n,
    block_k, max_concurrent_steps, grid_block_n)."""
    return [c for c in itertools.product((64, 128), (128, 256), (64,), (4,), (1, 4))
            if n % (c[1] * c[4]) == 0 and not (m <= 512 and c[0] == 128)]


def _mgpu(cfg):
    bm, bn, bk, steps, gbn = cfg
    return jax.jit(lambda a, b, s: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, block_m=bm, block_n=bn,
                                                              block_k=bk, max_concurrent_steps=steps,
                                                              grid_block_n=gbn))


_ITERS = [20]  # calls per timing; --quick: 2 (interpret mode's numbers mean nothing)


def _time(fn, *args) -> float:
    return common.pipelined_ms(fn, *args, iters=_ITERS[0], warmup=min(3, _ITERS[0]))


def _best(candidates, args, ref, tol):
    """(ms, name) of the fastest candidate (name, fn) whose output matches ref within tol, the
    failures as {name: reason}, and every candidate's time as {name: ms}."""
    best, failed, times = None, {}, {}
    for name, fn in candidates:
        try:
            err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - ref)))
            if not err <= tol:
                failed[name] = f"max |err| {err:.3g} > {tol:.3g}"
                continue
            ms = _time(fn, *args)
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is reported, not fatal
            failed[name] = repr(e)[:160]
            continue
        times[name] = ms
        if best is None or ms < best[0]:
            best = (ms, name)
    return best, failed, times


def _chosen(cases, pick: str | None):
    """The cases whose name contains one of pick's comma-separated parts (all without pick)."""
    return [c for c in cases if not pick or any(p in c[0] for p in pick.split(","))]


def gemm_rows(rng, quick: bool, ceil: dict, pick: str | None = None):
    rows = []
    for name, m, k, n, g in _chosen(QUICK_GEMMS if quick else GEMMS, pick):
        lhs, rhs, sizes, active = _case(rng, m, k, n, g)
        ref = jax.jit(moe.grouped_matmul_ref)(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
        tol = 2.0 ** -6 * float(jnp.max(jnp.abs(ref))) + 1e-3  # bf16 output rounding, with margin
        row = dict(section="grouped GEMM", case=f"{name}: M{m} K{k} N{n} G{g}")
        timed = {}
        tri = jax.jit(functools.partial(moe.grouped_matmul, interpret=quick))
        timed["triton"] = _best([("default", tri)], (lhs, rhs, sizes), ref, tol)
        block_m = 64 if quick else 128
        hop = lambda layout: [(t.label, jax.jit(functools.partial(
            moe_hopper.grouped_matmul, layout=layout, block_m=t.tile_m if not quick else block_m, tiling=t,
            interpret=quick))) for t in hopper_tilings(m, n, False, quick)]
        timed["hopper"] = _best(hop("ragged"), (lhs, rhs, sizes), ref, tol)
        timed["hopper_padded"] = _best(hop("padded"), (lhs, rhs, sizes), ref, tol)
        if timed["hopper_padded"][0] is not None:
            t = next(t for t in hopper_tilings(m, n, False, quick) if t.label == timed["hopper_padded"][0][1])
            bm = block_m if quick else t.tile_m
            n_tiles = moe._n_tiles(m, g, bm)
            dest, tile_group = moe._padded_layout(sizes, m, bm, n_tiles)
            x_pad = jnp.take(lhs, moe._layout_sources(dest, n_tiles * bm), axis=0, mode="fill", fill_value=0)
            kern = jax.jit(functools.partial(moe_hopper.gmm_padded, block_m=bm, tiling=t, interpret=quick))
            timed["hopper_kernel"] = (_time(kern, tile_group, x_pad, rhs), t.label), {}, {}
        if not quick:
            timed["lax_ragged_dot"] = _best([("", jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s)))],
                                            (lhs, rhs, sizes), ref, tol)
            if ragged_dot_mgpu is not None:
                timed["mgpu"] = _best([(str(c), _mgpu(c)) for c in mgpu_configs(m, n)], (lhs, rhs, sizes), ref, tol)
        weight_bytes, flops = active * k * n * 2, 2 * m * k * n
        for key, (best, failed, times) in timed.items():
            if failed:
                row[f"{key}_failed"] = failed
            if len(times) > 1:  # what a default tiling is chosen from
                row[f"{key}_ms_by_tiling"] = times
            if best is None:
                continue
            row[f"{key}_ms"], row[f"{key}_tiling"] = best
            if "decode" in name:
                row[f"{key}_of_copy"] = weight_bytes / (best[0] * 1e-3) / 1e9 / ceil["copy_gbs"]
            else:
                row[f"{key}_of_matmul"] = flops / (best[0] * 1e-3) / 1e12 / ceil["matmul_tflops"]
        if "mgpu_ms" in row:
            for key in ("hopper", "hopper_padded", "hopper_kernel", "triton"):
                if f"{key}_ms" in row:
                    row[f"{key}_vs_mgpu"] = row["mgpu_ms"] / row[f"{key}_ms"]  # > 1: faster than the peer
        rows.append(row)
        print(row, flush=True)
    return rows


def _peer_ffn(x, ids, w_gu, w_out, cfg_gu, cfg_down):
    """The same experts on the peer: rows sorted by expert, `ragged_dot_mgpu` twice, the
    activation in XLA between them, outputs unsorted -> [N, k, L]."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w_gu.shape[0]).astype(jnp.int32)
    rows = x[order // k]
    h = ragged_dot_mgpu.ragged_dot(rows, w_gu, group_sizes=sizes, block_m=cfg_gu[0], block_n=cfg_gu[1],
                                   block_k=cfg_gu[2], max_concurrent_steps=cfg_gu[3], grid_block_n=cfg_gu[4])
    f = w_gu.shape[2] // 2
    a = ACT(h[:, :f].astype(jnp.float32), h[:, f:].astype(jnp.float32)).astype(x.dtype)
    y = ragged_dot_mgpu.ragged_dot(a, w_out, group_sizes=sizes, block_m=cfg_down[0], block_n=cfg_down[1],
                                   block_k=cfg_down[2], max_concurrent_steps=cfg_down[3], grid_block_n=cfg_down[4])
    return jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)


def ffn_rows(rng, quick: bool, ceil: dict, pick: str | None = None):
    rows = []
    for name, t, l, f, e, top_k in _chosen(QUICK_FFNS if quick else FFNS, pick):
        x = jnp.asarray(rng.standard_normal((t, l)), jnp.bfloat16)
        w_gu = jnp.asarray(rng.standard_normal((e, l, 2 * f)) / l ** 0.5, jnp.bfloat16)
        w_out = jnp.asarray(rng.standard_normal((e, f, l)) / f ** 0.5, jnp.bfloat16)
        ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :top_k], jnp.int32)
        ffn = lambda impl: jax.jit(functools.partial(moe.grouped_ffn, act=ACT, impl=impl, interpret=quick))
        ref = ffn("triton")(x, ids, w_gu, w_out).astype(jnp.float32)
        tol = 2.0 ** -5 * float(jnp.max(jnp.abs(ref))) + 1e-3
        row = dict(section="grouped FFN", case=f"{name}: T{t} L{l} F{f} E{e} top{top_k}")
        timed = {"triton": _best([("default", ffn("triton"))], (x, ids, w_gu, w_out), ref, tol),
                 "hopper": _best([("default", ffn("hopper"))], (x, ids, w_gu, w_out), ref, tol)}
        if not quick and ragged_dot_mgpu is not None:
            m = t * top_k
            cands = [(f"{a}/{b}", jax.jit(functools.partial(_peer_ffn, cfg_gu=a, cfg_down=b)))
                     for a in mgpu_configs(m, 2 * f)[:4] for b in mgpu_configs(m, l)[:2]]
            timed["mgpu"] = _best(cands, (x, ids, w_gu, w_out), ref, tol)
        flops = 2 * t * top_k * l * f * 3
        for key, (best, failed, times) in timed.items():
            if failed:
                row[f"{key}_failed"] = failed
            if best is not None:
                row[f"{key}_ms"], row[f"{key}_tiling"] = best
                row[f"{key}_of_matmul"] = flops / (best[0] * 1e-3) / 1e12 / ceil["matmul_tflops"]
        if "mgpu_ms" in row:
            for key in ("hopper", "triton"):
                if f"{key}_ms" in row:
                    row[f"{key}_vs_mgpu"] = row["mgpu_ms"] / row[f"{key}_ms"]
        rows.append(row)
        print(row, flush=True)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Each implementation's time per case relative to the peer (`ragged_dot_mgpu`, or the
    Triton kernel where the peer did not run), one panel per section: bars above 1 are faster
    than the peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = [sec for sec in ("grouped GEMM", "grouped FFN") if any(r["section"] == sec for r in rows)]
    fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 3.8), squeeze=False)
    for ax, sec in zip(axes[0], sections):
        cases = [r for r in rows if r["section"] == sec]
        keys = [k[:-3] for k in cases[0] if k.endswith("_ms")]
        base = "mgpu" if all("mgpu_ms" in r for r in cases) else "triton"
        width = 0.8 / max(len(keys), 1)
        for j, key in enumerate(keys):
            ys = [r[f"{base}_ms"] / r[f"{key}_ms"] if f"{key}_ms" in r else 0.0 for r in cases]
            ax.bar(np.arange(len(cases)) + j * width, ys, width, label=key)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
        ax.set_xticklabels([r["case"].split(":")[0] for r in cases], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(f"speed vs {base} (x)")
        ax.set_title(sec)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default="gemm,ffn")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (the CPU smoke test)")
    ap.add_argument("--cases", default=None, help="only the cases whose name contains one of these (comma-separated)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    _ITERS[0] = 2 if args.quick else 20
    ceil = ({"copy_gbs": common.copy_gbs(), "matmul_tflops": 1.0} if args.quick else common.ceilings())
    rows = [dict(section="ceilings", case=jax.devices()[0].device_kind, **ceil)]
    common.write_results(args.out, "moe_bench", rows)
    sections = args.sections.split(",")
    if "gemm" in sections:
        rows += gemm_rows(rng, args.quick, ceil, args.cases)
        common.write_results(args.out, "moe_bench", rows)
    if "ffn" in sections:
        rows += ffn_rows(rng, args.quick, ceil, args.cases)
        common.write_results(args.out, "moe_bench", rows)
    plot(rows, os.path.join(args.out, "moe_bench.png"))


if __name__ == "__main__":
    main()
