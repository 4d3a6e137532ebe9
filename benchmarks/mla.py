"""MLA kernels on the GPU, with the peers measured in the same run.

    PYTHONPATH=$PWD python3 benchmarks/mla.py [--out DIR] [--tiny]

Decode (`mla_decode`, absorbed, paged, bf16 latent 512 + 64, page 128): B in
{1, 16, 64, 128} x context in {1k, 8k, 32k} x heads {16, 96}; reports achieved
bytes/s (latent cache + queries read, outputs written) against the XLA copy
bandwidth, and FLOP/s against a bf16 matmul measured in this run, plus the
time of the XLA reference on gathered pages.
Prefill (`mla_prefill`, naive form, qk 192 / v 128): against
`jax.nn.dot_product_attention(implementation="cudnn")` on the same FLOPs
(cuDNN's head dim padded to 192 for q/k and v).
`--tiny` runs every code path at toy sizes in interpret mode (CPU smoke test).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.common import time_jax
from pallas_kernels import mla


def matmul_tflops(n=8192):
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    return 2 * n ** 3 / (time_jax(jax.jit(lambda x: x @ x), a) * 1e-3) / 1e12


def decode_rows(bw, tflops, batches, contexts, heads, r=512, p=64, page=128, sq=1, interpret=False):
    rows = []
    for h in heads:
        for b in batches:
            for ctx in contexts:
                n_pages_seq = ctx // page
                key = jax.random.PRNGKey(b * 7 + ctx)
                pages = jax.random.normal(key, (b * n_pages_seq + 8, page, r + p), jnp.bfloat16)
                table = jax.random.permutation(key, b * n_pages_seq + 8)[:b * n_pages_seq].reshape(b, n_pages_seq)
                table = table.astype(jnp.int32)
                lens = jnp.full((b,), ctx, jnp.int32)
                ql = jax.random.normal(key, (b, sq, h, r), jnp.bfloat16)
                qp = jax.random.normal(key, (b, sq, h, p), jnp.bfloat16)
                f = jax.jit(lambda a, c, pg, t, n: mla.mla_decode(a, c, pg, t, n, scale=0.1, interpret=interpret))
                ms = time_jax(f, ql, qp, pages, table, lens, iters=5 if interpret else 20)
                ref = jax.jit(lambda a, c, pg, t, n: mla.mla_decode_ref(a, c, pg, t, n, scale=0.1))
                ms_ref = time_jax(ref, ql, qp, pages, table, lens, iters=5 if interpret else 20)
                bytes_moved = b * ctx * (r + p) * 2 + ql.nbytes + qp.nbytes + b * sq * h * r * 2
                flops = 2 * b * sq * h * ctx * (r + p + r)
                gbs = bytes_moved / (ms * 1e-3) / 1e9
                tfs = flops / (ms * 1e-3) / 1e12
                rows.append(dict(section="decode", case=f"H{h} B{b} ctx{ctx} Sq{sq}", ours_ms=ms, xla_ref_ms=ms_ref,
                                 gbs=gbs, of_copy=gbs / bw, tflops=tfs, of_matmul=tfs / tflops,
                                 bound="memory" if flops / bytes_moved < tflops * 1e3 / bw else "compute"))
    return rows


def prefill_rows(shapes, interpret=False):
    rows = []
    for b, t, h in shapes:
        key = jax.random.PRNGKey(t)
        q = jax.random.normal(key, (b * t, h, 192), jnp.bfloat16)
        k = jax.random.normal(jax.random.PRNGKey(1), (b * t, h, 192), jnp.bfloat16)
        v = jax.random.normal(jax.random.PRNGKey(2), (b * t, h, 128), jnp.bfloat16)
        cu = [i * t for i in range(b + 1)]
        ours = jax.jit(lambda q, k, v: mla.mla_prefill(q, k, v, cu_seqlens=cu, scale=192 ** -0.5, rope_dim=64,
                                                       interpret=interpret)[0])
        ms = time_jax(ours, q, k, v, iters=5 if interpret else 20)
        ms_cudnn = None
        if not interpret:
            qb, kb = q.reshape(b, t, h, 192), k.reshape(b, t, h, 192)
            vb = jnp.pad(v.reshape(b, t, h, 128), ((0, 0), (0, 0), (0, 0), (0, 64)))
            cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=192 ** -0.5,
                                                                          implementation="cudnn"))
            try:
                ms_cudnn = time_jax(cudnn, qb, kb, vb)
            except Exception as e:  # noqa: BLE001 - report, keep going
                print(f"cudnn failed: {e!r}")
        flops = b * h * t * t * (192 + 128)  # causal: half of 2 * t^2 * (dqk + dv)
        rows.append(dict(section="prefill", case=f"B{b} T{t} H{h} qk192 v128 causal", ours_ms=ms, cudnn_ms=ms_cudnn,
                         ours_tflops=flops / (ms * 1e-3) / 1e12,
                         vs_cudnn=(ms_cudnn / ms) if ms_cudnn else None))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="toy sizes in interpret mode (CPU smoke test)")
    args = ap.parse_args()
    rows = []
    bw, tf = common.copy_gbs(), (1.0 if args.tiny else matmul_tflops())
    rows.append(dict(section="roofline", case="XLA copy (GB/s) and bf16 matmul (TFLOP/s)", copy_gbs=bw, matmul_tflops=tf))
    if args.tiny:
        rows += decode_rows(bw, tf, [2], [256], [2], r=32, p=16, page=64, interpret=True)
        rows += decode_rows(bw, tf, [1], [256], [2], r=32, p=16, page=64, sq=2, interpret=True)
        rows += prefill_rows([(1, 64, 1)], interpret=True)
    else:
        rows += decode_rows(bw, tf, [1, 16, 64, 128], [1024, 8192, 32768], [16, 96])
        rows += decode_rows(bw, tf, [64], [8192], [16, 96], sq=4)  # speculative verify: 4 query tokens
        rows += prefill_rows([(1, 4096, 16), (1, 16384, 16), (4, 4096, 96)])
    common.write_results(args.out, "mla_bench", rows)

if __name__ == "__main__":
    main()
