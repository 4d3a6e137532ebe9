"""Where the grouped GEMM's group-aligned layout spends its time on the GPU (issue 22): the
Hopper kernel alone beat `ragged_dot_mgpu` (1.08-1.35x) while the same kernel with the layout's
row scatter in and gather out around it ran at 0.42-0.47x (session 30).  Times each piece and
the ways of moving rows in: XLA's scatter of rows (session 30's), the same told its indices are
unique, and what `moe` now does (`moe._layout_sources`: an int32 scatter of the entries'
indices, then a gather of rows).

    PYTHONPATH=$PWD python3 benchmarks/moe_layout.py [--out DIR] [--quick]

Every variant's padded rows are checked equal to the scatter's before it is timed."""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from pallas_kernels import moe

CASES = [("small prefill T2048 (GEMM)", 8192, 768, 32), ("k3 rank prefill (GEMM)", 16384, 1024, 24)]
FFN_CASES = [("small prefill T8192 (FFN)", 8192, 768, 32, 4)]
QUICK = ([("quick", 300, 64, 4)], [("quick", 64, 64, 4, 2)])  # the CPU smoke test's shapes


def _sorted_variants(m, k, g, block_m):
    n_tiles = moe._n_tiles(m, g, block_m)
    p = n_tiles * block_m

    def layout(sizes):
        return moe._padded_layout(sizes, m, block_m, n_tiles)

    def scatter(x, sizes, unique=False):
        dest, _ = layout(sizes)
        return jnp.zeros((p, k), x.dtype).at[jnp.where(dest >= 0, dest, p)].set(x, mode="drop",
                                                                                 unique_indices=unique)

    def source(sizes):  # what `moe.through_padded_layout` gathers through
        return moe._layout_sources(layout(sizes)[0], p)

    def gather(x, sizes):
        return jnp.take(x, source(sizes), axis=0, mode="fill", fill_value=0)

    def gather_out(y_pad, sizes):
        dest, _ = layout(sizes)
        return jnp.where((dest >= 0)[:, None], y_pad[jnp.maximum(dest, 0)], 0)

    return dict(layout=lambda x, s: layout(s)[0], source_map=lambda x, s: source(s),
                scatter_in=scatter, scatter_in_unique=lambda x, s: scatter(x, s, True),
                gather_in=gather), gather_out, p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="toy shapes (a smoke test of the script)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases, ffn_cases = QUICK if args.quick else (CASES, FFN_CASES)
    iters = 2 if args.quick else 50
    rows = []
    for name, m, k, g in cases:
        sizes = jnp.asarray(rng.multinomial(m, np.ones(g) / g).astype(np.int32))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        variants, gather_out, p = _sorted_variants(m, k, g, 128)
        want = np.asarray(jax.jit(variants["scatter_in"])(x, sizes))
        row = dict(case=f"{name}: M{m} K{k} G{g} block_m 128", bytes_moved_mb=2 * m * k * 2 / 1e6)
        for key, fn in variants.items():
            fn = jax.jit(fn)
            if key.endswith("_in"):
                assert np.array_equal(np.asarray(fn(x, sizes)), want), key
            row[f"{key}_us"] = 1e3 * common.pipelined_ms(fn, x, sizes, iters=iters)
        y_pad = jnp.asarray(rng.standard_normal((p, k)), jnp.bfloat16)
        row["gather_out_us"] = 1e3 * common.pipelined_ms(jax.jit(gather_out), y_pad, sizes, iters=iters)
        rows.append(row)
        print(row, flush=True)
        common.write_results(args.out, "moe_layout", rows)
    for name, t, l, e, top_k in ffn_cases:
        ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :top_k], jnp.int32)
        x = jnp.asarray(rng.standard_normal((t, l)), jnp.bfloat16)
        block_m = 128

        def lay(ids):
            return moe.assignment_layout(ids.reshape(-1), e, block_m)

        def scatter(x, ids):
            dest, _, n_tiles = lay(ids)
            return jnp.zeros((n_tiles * block_m, l), x.dtype).at[dest].set(
                x[jnp.repeat(jnp.arange(t, dtype=jnp.int32), top_k)], mode="drop")

        def gather(x, ids):  # what `moe.grouped_ffn` does
            dest, _, n_tiles = lay(ids)
            src = moe._layout_sources(dest, n_tiles * block_m)
            return jnp.take(x, src // top_k, axis=0, mode="fill", fill_value=0)

        want = np.asarray(jax.jit(scatter)(x, ids))
        row = dict(case=f"{name}: T{t} L{l} E{e} top{top_k}")
        for key, fn in dict(layout=lambda x, i: lay(i)[0], scatter_in=scatter, gather_in=gather).items():
            fn = jax.jit(fn)
            if key.endswith("_in"):
                assert np.array_equal(np.asarray(fn(x, ids)), want), key
            row[f"{key}_us"] = 1e3 * common.pipelined_ms(fn, x, ids, iters=iters)
        rows.append(row)
        print(row, flush=True)
        common.write_results(args.out, "moe_layout", rows)


if __name__ == "__main__":
    main()
