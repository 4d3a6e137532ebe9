"""Quick decode comparison of `mla_decode` configs, Triton and Hopper (one short GPU call).

    PYTHONPATH=$PWD python3 benchmarks/mla_h96_probe.py [--configs hopperx64x2x1,...]

For each config: the largest error against `mla_decode_ref` (fp32 math on the
same bf16 inputs) on a ragged case (B2, lengths 1000 and 333, Sq 2, H96, random
non-contiguous pages), then loop-timed rows of `benchmarks/mla.py` at the
compute-heavy shapes: H96 B16 ctx8k Sq1 (96 rows: padded to 128), H96 B16 ctx8k
Sq2 (192 rows, no padding) and H128 B64 ctx8k Sq1 (FlashMLA's headline shape,
DeepSeek's 128 heads).  One row per config, so they can be compared.
"""

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.mla import decode_fn, decode_rows, matmul_tflops, parse_decode_config
from pallas_kernels import mla


def max_error(cfg, h=96, r=512, p=64, page=128):
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(3), 4)
    lens = jnp.array([1000, 333], jnp.int32)
    pages = jax.random.normal(k1, (24, page, r + p), jnp.bfloat16)
    table = jax.random.permutation(k2, 24)[:16].reshape(2, 8).astype(jnp.int32)
    ql = jax.random.normal(k3, (2, 2, h, r), jnp.bfloat16)
    qp = jax.random.normal(k4, (2, 2, h, p), jnp.bfloat16)
    o, lse = decode_fn(cfg)(ql, qp, pages, table, lens, scale=0.05)
    f32 = lambda x: x.astype(jnp.float32)
    o_ref, lse_ref = mla.mla_decode_ref(f32(ql), f32(qp), f32(pages), table, lens, scale=0.05)
    return float(jnp.max(jnp.abs(f32(o) - o_ref))), float(jnp.max(jnp.abs(lse - lse_ref)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64x8x512x32,hopperx32x2,hopperx64x2,hopperx32x2x1,hopperx64x2x1")
    ap.add_argument("--budget-s", type=float, default=200)
    args = ap.parse_args()
    bw, tf = common.copy_gbs(), matmul_tflops()
    print(f"copy {bw:.0f} GB/s, matmul {tf:.0f} TFLOP/s", flush=True)
    deadline = time.monotonic() + args.budget_s
    for cfg in map(parse_decode_config, args.configs.split(",")):
        try:
            err_o, err_lse = max_error(cfg)
        except Exception as e:  # noqa: BLE001 - report the config and go on
            print(cfg, f"failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        print(cfg, f"max |o - ref| {err_o:.3g}, max |lse - ref| {err_lse:.3g}", flush=True)
        for b, h, sq in ((16, 96, 1), (16, 96, 2), (64, 128, 1)):
            for row in decode_rows(bw, tf, [b], [8192], [h], sq=sq, configs=(cfg,), deadline=deadline):
                print(cfg, row["case"], f"{row['ours_ms']:.3f} ms  {row['tflops']:.0f} TFLOP/s  "
                      f"{100 * row['of_matmul']:.0f}% of matmul  {100 * row['of_copy']:.0f}% of copy", flush=True)
