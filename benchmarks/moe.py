"""Routed-expert grouped GEMM on the GPU: ours vs `lax.ragged_dot` vs JAX's Mosaic GPU kernel.

    PYTHONPATH=$PWD python3 benchmarks/moe.py [--out DIR]

Shapes: the `small` config's expert projections (G 32 experts, K = N = 768,
top-4 routing) at decode (M = 4 x batch rows) and prefill (M = 4 x 2048 rows)
and one full-scale expert-parallel rank's shape.  Decode reports the weight
bytes of the experts that got rows over the time (vs the XLA copy rate of the
same run); prefill reports FLOP/s (vs the bf16 matmul rate of the same run).
Each row checks ours against `lax.ragged_dot` first.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.mla import matmul_tflops
from pallas_kernels import moe

try:  # JAX's own Hopper ragged dot (wgmma + TMA), the peer
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
except Exception:  # noqa: BLE001 - the peer column stays empty
    ragged_dot_mgpu = None


def _case(rng, m, k, n, g):
    """Random rows routed to experts (multinomial over G), bf16."""
    sizes = rng.multinomial(m, np.ones(g) / g).astype(np.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / k ** 0.5, jnp.bfloat16)
    return lhs, rhs, jnp.asarray(sizes), int((sizes > 0).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    bw, tflops = common.copy_gbs(), matmul_tflops()
    rows = [dict(section="roofline", case=jax.devices()[0].device_kind, copy_gbs=bw, matmul_tflops=tflops)]
    shapes = [("decode B8", 32, 768, 768, 32), ("decode B32", 128, 768, 768, 32), ("decode B128", 512, 768, 768, 32),
              ("prefill T2048", 8192, 768, 768, 32), ("prefill T8192", 32768, 768, 768, 32),
              ("k3 rank decode B64", 512, 1024, 2048, 24), ("k3 rank prefill", 16384, 1024, 2048, 24)]
    for name, m, k, n, g in shapes:
        lhs, rhs, sizes, active = _case(rng, m, k, n, g)
        ours = jax.jit(moe.grouped_matmul)
        ref = jax.jit(moe.grouped_matmul_ref)
        err = float(jnp.max(jnp.abs(ours(lhs, rhs, sizes).astype(jnp.float32) - ref(lhs, rhs, sizes).astype(jnp.float32))))
        ms = {"ours": common.time_jax(ours, lhs, rhs, sizes), "lax_ragged_dot": common.time_jax(ref, lhs, rhs, sizes)}
        if ragged_dot_mgpu is not None:
            peer = jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, block_m=64 if m <= 512 else 128,
                                             block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1))
            try:
                ms["mgpu"] = common.time_jax(lambda a, b, s: peer(a, b, group_sizes=s), lhs, rhs, sizes)
            except Exception as e:  # noqa: BLE001
                print(f"{name}: mgpu peer failed: {e!r:.200}", flush=True)
        weight_bytes = active * k * n * 2
        flops = 2 * m * k * n
        row = dict(section="grouped GEMM", case=f"{name}: M{m} K{k} N{n} G{g}", max_abs_err_vs_ragged_dot=err,
                   **{f"{key}_ms": v for key, v in ms.items()})
        for key, v in ms.items():
            if name.startswith(("decode", "k3 rank decode")):
                row[f"{key}_of_copy"] = weight_bytes / (v * 1e-3) / 1e9 / bw
            else:
                row[f"{key}_of_matmul"] = flops / (v * 1e-3) / 1e12 / tflops
        rows.append(row)
        print(row, flush=True)
    common.write_results(args.out, "moe_bench", rows)


if __name__ == "__main__":
    main()
