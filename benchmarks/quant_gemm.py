"""Quantized GEMMs on the GPU (issue 20): projection GEMMs bf16 vs FP8 vs MXFP8, and the routed
experts' grouped GEMM bf16 vs MXFP4, at decode and prefill sizes, against ceilings measured in
the same run.

    PYTHONPATH=$PWD python3 benchmarks/quant_gemm.py --out DIR [--quick]

* Projections: `small`'s fused KDA input [1536, 4876], fused MLA input [1536, 3392] and KDA
  output [1536, 1536]; the full-scale model's (`kimi_k3`, a rank holding the whole attention as
  the DP decode mesh does): fused KDA input [7168, 24896], MLA q up [1536, 18432], MLA output
  [12288, 7168].  bf16 is XLA's `x @ w` (cuBLAS); fp8 / mxfp8 is `kimik3.ops.linear` on a
  `QTensor` (the activations' per-row quantization, then the Pallas block-scaled kernel), the
  whole projection either way.  M: decode 1-64 rows, prefill 2048-16384.
* Experts: `moe.grouped_matmul` on bf16 vs MXFP4 weights (`mxfp4.PackedMXFP4`, decoded in the kernel) over
  the group-aligned layout of `rows` (token, expert) assignments spread uniformly: `small`'s
  32 experts gate ++ up [768, 1536] and down [768, 768]; a full-scale EP16 rank's 56 experts
  gate ++ up [4096, 8192] (`--mx-tilings` times more MXFP4 tilings).  And `moe.grouped_ffn`, the
  decode step's routed experts (gate/up + activation, then down), bf16 vs MXFP4, top-8 routing.
* Timing (the same for both sides): `common.time_pipelined`, calls back to back then one sync.
  Ceilings: torch `copy_` (memory), the best bf16 matmul of XLA and torch (compute).  Each row
  has the bytes the GEMM must read (weights at their storage width, activations in and out) and
  the time they take at the copy rate.

Rows go to `quant_gemm.json` under --out as they are measured.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from kimik3 import ops
from kimik3.quant import formats
from pallas_kernels import moe, moe_mxfp4, mxfp4

PROJECTIONS = {
    "small KDA in (fused)": (1536, 4876),
    "small MLA in (fused)": (1536, 3392),
    "small KDA out": (1536, 1536),
    "full KDA in (fused)": (7168, 24896),
    "full MLA q up": (1536, 18432),
    "full MLA out": (12288, 7168),
}
EXPERTS = {
    "small gate+up": (32, 768, 1536),
    "small down": (32, 768, 768),
    "full EP16 rank gate+up": (56, 4096, 8192),
}


def bf16_matmul_tflops() -> float:
    """The best bf16 matmul rate of XLA and torch on 8192^3, TFLOP/s (`common.matmul_tflops`)."""
    return common.matmul_tflops()["matmul_tflops"]


def random_qtensor(rng, fmt: str, k: int, n: int) -> formats.QTensor:
    """A well-formed fp8 / mxfp8 [K, N] weight with random e4m3 values and scales (no
    quantization pass: the full-scale weights would take minutes to quantize)."""
    values = jnp.asarray(rng.standard_normal((k, n), np.float32) * 64).clip(-448, 448).astype(jnp.float8_e4m3fn)
    if fmt == "fp8":
        scales = jnp.asarray(rng.uniform(1e-4, 1e-3, (-(-k // 128), -(-n // 128))), jnp.float32)
    else:
        scales = jnp.asarray(np.ldexp(1.0, rng.integers(-14, -8, (k // 32, n))), jnp.float32).astype(
            jnp.float8_e8m0fnu)
    return formats.check(formats.QTensor(values, scales, fmt, (k, n)))


def random_mxfp4(rng, g: int, k: int, n: int) -> formats.QTensor:
    values = jnp.asarray(rng.integers(0, 256, (g, k, n // 2), dtype=np.uint8))
    scales = jnp.asarray(np.ldexp(1.0, rng.integers(-10, -4, (g, k // 32, n))), jnp.float32).astype(jnp.float8_e8m0fnu)
    return formats.QTensor(values, scales, "mxfp4", (g, k, n))


def projection_rows(rng, copy_gbs: float, tflops: float, ms_list, write, quick: bool):
    for name, (k, n) in PROJECTIONS.items():
        if quick and name.startswith("full"):
            continue
        w16 = jnp.asarray(rng.standard_normal((k, n), np.float32) * k ** -0.5, jnp.bfloat16)
        qs = {fmt: random_qtensor(rng, fmt, k, n) for fmt in ("fp8", "mxfp8")}
        for m in ms_list:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
            row = dict(section="projection", case=name, m=m, k=k, n=n)
            times = {"bf16": common.time_pipelined(jax.jit(lambda x, w: x @ w), x, w16)[0]}
            for fmt, q in qs.items():
                times[fmt] = common.time_pipelined(jax.jit(lambda x, q: ops.linear(x, q, kernels="pallas")), x, q)[0]
            for fmt, ms in times.items():
                weight_bytes = k * n * (2 if fmt == "bf16" else 1)
                moved = weight_bytes + 2 * m * (k + n)
                row[f"{fmt}_ms"] = ms
                row[f"{fmt}_of_copy"] = moved / (copy_gbs * 1e9) * 1e3 / ms
                row[f"{fmt}_tflops"] = 2 * m * k * n / (ms * 1e-3) / 1e12
            row["fp8_speedup"], row["mxfp8_speedup"] = times["bf16"] / times["fp8"], times["bf16"] / times["mxfp8"]
            row["of_matmul_ceiling_bf16"] = row["bf16_tflops"] / tflops
            print(row, flush=True)
            write(row)


def _uniform_sizes(rng, rows: int, g: int):
    return jnp.asarray(np.bincount(np.sort(rng.integers(0, g, rows)), minlength=g), jnp.int32)


def expert_rows(rng, copy_gbs: float, rows_list, write, quick: bool, tilings=()):
    """tilings: extra `moe.Tiling`s to time the MXFP4 kernel at (each row keeps every time)."""
    for name, (g, k, n) in EXPERTS.items():
        if quick and name.startswith("full"):
            continue
        q = random_mxfp4(rng, g, k, n)
        packed = mxfp4.PackedMXFP4(q.values, q.scales)
        w16 = mxfp4.dequantize(q.values, q.scales).astype(jnp.bfloat16)
        for rows in rows_list:
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            sizes = _uniform_sizes(rng, rows, g)
            used = int(np.count_nonzero(np.asarray(sizes)))
            bf16_ms = common.time_pipelined(jax.jit(moe.grouped_matmul), x, w16, sizes)[0]
            by_tiling = {}
            for t in (None, *tilings):
                if t is not None and (n % t[0] or k % t[1]):
                    continue
                fn = jax.jit(functools.partial(moe.grouped_matmul, tiling=t))
                by_tiling[str(t or moe.mx_tiling(rows, moe.layout_block_m(rows), False, k, n))] = common.time_pipelined(
                    fn, x, packed, sizes)[0]
            mx_ms = min(by_tiling.values())
            bytes16 = used * k * n * 2 + 2 * rows * (k + n)
            bytes4 = used * k * n * (4.25 / 8) + 2 * rows * (k + n)
            row = dict(section="experts", case=name, rows=rows, experts_read=used, bf16_ms=bf16_ms, mxfp4_ms=mx_ms,
                       mxfp4_default_ms=next(iter(by_tiling.values())), mxfp4_ms_by_tiling=by_tiling,
                       speedup=bf16_ms / mx_ms, bf16_of_copy=bytes16 / (copy_gbs * 1e9) * 1e3 / bf16_ms,
                       mxfp4_of_copy=bytes4 / (copy_gbs * 1e9) * 1e3 / mx_ms,
                       memory_bound=bool(2 * rows * k * n / bytes4 < 300))  # FLOP per byte under Hopper's ridge
            print(row, flush=True)
            write(row)


FFNS = {  # experts, latent L, expert width F: gate ++ up [E, L, 2F], down [E, F, L]
    "small": (32, 768, 768),
    "full EP16 rank": (56, 4096, 4096),
}


def ffn_rows(rng, copy_gbs: float, tokens_list, write, quick: bool, top_k: int = 8):
    """`moe.grouped_ffn` (gate/up with the activation in its epilogue, then down: the decode
    step's routed experts) on bf16 vs MXFP4 experts, tokens each routed to top_k experts."""
    act = lambda gate, up: jax.nn.silu(gate) * up
    for name, (e, l, f) in FFNS.items():
        if quick and name.startswith("full"):
            continue
        q_gu, q_out = random_mxfp4(rng, e, l, 2 * f), random_mxfp4(rng, e, f, l)
        packed = [mxfp4.PackedMXFP4(q.values, q.scales) for q in (q_gu, q_out)]
        dense = [mxfp4.dequantize(q.values, q.scales).astype(jnp.bfloat16) for q in (q_gu, q_out)]
        fn = jax.jit(functools.partial(moe.grouped_ffn, act=act))
        for tokens in tokens_list:
            x = jnp.asarray(rng.standard_normal((tokens, l), np.float32), jnp.bfloat16)
            ids = jnp.asarray(np.stack([rng.permutation(e)[:top_k] for _ in range(tokens)]), jnp.int32)
            used = len(np.unique(np.asarray(ids)))
            bf16_ms = common.time_pipelined(fn, x, ids, *dense)[0]
            mx_ms = common.time_pipelined(fn, x, ids, *packed)[0]
            weights = used * 3 * l * f
            row = dict(section="grouped_ffn", case=name, tokens=tokens, top_k=top_k, experts_read=used,
                       bf16_ms=bf16_ms, mxfp4_ms=mx_ms, speedup=bf16_ms / mx_ms,
                       bf16_of_copy=weights * 2 / (copy_gbs * 1e9) * 1e3 / bf16_ms,
                       mxfp4_of_copy=weights * 4.25 / 8 / (copy_gbs * 1e9) * 1e3 / mx_ms)
            print(row, flush=True)
            write(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true", help="small's shapes and a few sizes only")
    ap.add_argument("--sections", default="projection,experts,grouped_ffn")
    ap.add_argument("--mx-tilings", default="", help="extra MXFP4 tilings to time, 'bn,bk,warps,stages;...'")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    copy_torch = common.torch_copy_gbs()
    copy_gbs = copy_torch or common.copy_gbs()
    tflops = bf16_matmul_tflops()
    rows = [dict(section="ceilings", device=jax.devices()[0].device_kind, copy_gbs=copy_gbs,
                 torch_copy_gbs=copy_torch, bf16_matmul_tflops=tflops)]
    print(rows[0], flush=True)

    def write(row):
        rows.append(row)
        common.write_results(args.out, "quant_gemm", rows)

    write(rows.pop())
    sections = args.sections.split(",")
    if "projection" in sections:
        ms_list = (1, 64, 2048) if args.quick else (1, 8, 32, 64, 2048, 8192, 16384)
        projection_rows(rng, copy_gbs, tflops, ms_list, write, args.quick)
    if "experts" in sections:
        rows_list = (8, 128) if args.quick else (4, 32, 128, 256, 1024)
        tilings = tuple(tuple(int(v) for v in t.split(",")) for t in args.mx_tilings.split(";") if t)
        expert_rows(rng, copy_gbs, rows_list, write, args.quick, tilings)
    if "grouped_ffn" in sections:
        ffn_rows(rng, copy_gbs, (1, 4, 32) if args.quick else (1, 4, 16, 32, 64), write, args.quick)
    print(common.markdown_tables([r for r in rows if r["section"] != "ceilings"]) if rows else "", flush=True)


if __name__ == "__main__":
    main()
