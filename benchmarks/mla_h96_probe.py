"""Quick decode comparison of `mla_decode` configs, Triton and Hopper (one short GPU call).

    PYTHONPATH=$PWD python3 benchmarks/mla_h96_probe.py [--configs 64x8x512x32,hopperx64x2,...]

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
from kimik3 import ops
from pallas_kernels import mla


def ragged_cache(key, width, page=128):
    """Two sequences of 1000 and 333 cached tokens on random non-contiguous pages (8 each of
    24): (pages [24, page, width] bf16, block_tables [2, 8], seq_lens [2])."""
    k1, k2 = jax.random.split(key)
    pages = jax.random.normal(k1, (24, page, width), jnp.bfloat16)
    table = jax.random.permutation(k2, 24)[:16].reshape(2, 8).astype(jnp.int32)
    return pages, table, jnp.array([1000, 333], jnp.int32)


def max_error(cfg, h=96, r=512, p=64, page=128):
    k1, k3, k4 = jax.random.split(jax.random.PRNGKey(3), 3)
    pages, table, lens = ragged_cache(k1, r + p, page)
    ql = jax.random.normal(k3, (2, 2, h, r), jnp.bfloat16)
    qp = jax.random.normal(k4, (2, 2, h, p), jnp.bfloat16)
    o, lse = decode_fn(cfg)(ql, qp, pages, table, lens, scale=0.05)
    f32 = lambda x: x.astype(jnp.float32)
    o_ref, lse_ref = mla.mla_decode_ref(f32(ql), f32(qp), f32(pages), table, lens, scale=0.05)
    return float(jnp.max(jnp.abs(f32(o) - o_ref))), float(jnp.max(jnp.abs(lse - lse_ref)))


def model_path_error(h, sq, r=512, rope=64, nope=128, v=128, page=128):
    """`kimik3.ops.mla_attention`'s absorbed paged path, Pallas (the kernel `mla_decode_impl`
    picks) vs reference, on the same bf16 inputs: (kernel, max |diff| / max |reference|)."""
    ks = jax.random.split(jax.random.PRNGKey(h * 10 + sq), 4)
    pages, table, lens = ragged_cache(ks[0], r + rope, page)
    q = jax.random.normal(ks[1], (2, sq, h, nope + rope), jnp.bfloat16)
    w_kb = (jax.random.normal(ks[2], (r, h, nope)) * r ** -0.5).astype(jnp.bfloat16)
    w_vb = (jax.random.normal(ks[3], (r, h, v)) * r ** -0.5).astype(jnp.bfloat16)
    latent = mla.gather_pages(pages, table)
    kw = dict(kv_lora=r, scale=(nope + rope) ** -0.5, q_pos_bt=lens[:, None] - sq + jnp.arange(sq)[None],
              k_pos_bs=jnp.broadcast_to(jnp.arange(latent.shape[1])[None], latent.shape[:2]), absorbed=True,
              contiguous_cache=True, paged=(pages, table))
    o_p = ops.mla_attention(q, latent, w_kb, w_vb, kernels="pallas", **kw).astype(jnp.float32)
    o_r = ops.mla_attention(q, latent, w_kb, w_vb, kernels="reference", **kw).astype(jnp.float32)
    impl = ops.mla_decode_impl(q.dtype, r, rope, page, sq * h, table.shape[1] * page, ops._compute_capability())
    return impl, float(jnp.max(jnp.abs(o_p - o_r)) / jnp.max(jnp.abs(o_r)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64x8x512x32,hopperx32x2,hopperx64x2")
    ap.add_argument("--budget-s", type=float, default=200)
    args = ap.parse_args()
    bw, tf = common.copy_gbs(), matmul_tflops()
    print(f"copy {bw:.0f} GB/s, matmul {tf:.0f} TFLOP/s", flush=True)
    deadline = time.monotonic() + args.budget_s
    for h, sq in ((96, 1), (96, 2), (16, 1), (16, 4)):
        impl, err = model_path_error(h, sq)
        print(f"ops.mla_attention H{h} Sq{sq}: {impl}, max |pallas - reference| / max |reference| {err:.3g}",
              flush=True)
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
