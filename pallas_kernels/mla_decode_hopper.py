"""The absorbed MLA decode as a Hopper (sm_90a) kernel in Mosaic GPU (`mla_decode_hopper`).

Absorbed decode at many heads is compute-bound (H96: ~180 FLOP per latent byte), so it needs
wgmma at 64 rows.  A 64 x 512 fp32 accumulator is 256 registers a thread for one warpgroup,
too many; as in FlashMLA, two compute warpgroups share the same 64 rows and each owns half
of the 512 value columns.  Warpgroup 0 computes the scores Q K^T (all 576 latent columns),
the online softmax, and hands P and the rescale factors to warpgroup 1 through shared memory
(two P slots where they fit, else one); both then multiply P by their half of the same key
tile (the value is the first 512 columns of the latent).  A third warpgroup streams key tiles
from the pages by TMA.  A block of rows stops at the last key its last query sees, so a
prefill chunk (Sq = the chunk) skips the causal upper triangle a tile at a time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.hopper_ring import SMEM_BYTES as _SMEM_BYTES
from pallas_kernels.hopper_ring import fresh as _fresh
from pallas_kernels.hopper_ring import mma_into as _mma_into
from pallas_kernels.hopper_ring import set_registers as _set_registers
from pallas_kernels.hopper_ring import stream as _stream
from pallas_kernels.hopper_ring import wait_last_releases as _wait_last_releases
from pallas_kernels.mla import _LOG2E, check_decode_inputs, fold_rows, merge_splits, visible_keys


@dataclasses.dataclass(frozen=True)
class DecodeCta:
    """What a decode CTA derives from its grid position (traced scalars): sequence b, KV split
    `split`, row tile rb (64 folded rows), its split's first key tile kb0 and tile count
    n_steps; the three column parts (value half 0, value half 1, rope) as (start, width) of a
    latent row and as (array, first column) of the queries."""

    b: jax.Array
    split: jax.Array
    rb: jax.Array
    seq_len: jax.Array
    kb0: jax.Array
    n_steps: jax.Array
    block_m: int
    block_kv: int
    cols_of: tuple
    q_of: tuple

    @classmethod
    def at(
        cls, len_ref, q_lat_ref, q_pe_ref, pages_ref, *, block_m, block_kv, n_heads, n_queries, n_splits, rank, cluster
    ):
        b, split, rb = lax.axis_index("b"), lax.axis_index("split"), lax.axis_index("rows")
        if cluster > 1:
            rb = rb * cluster + lax.axis_index("cluster")
        half = rank // 2
        seq_len = len_ref[b]
        n_blocks = pl.cdiv(visible_keys(seq_len, n_queries, n_heads, rb * block_m + block_m - 1), jnp.int32(block_kv))
        per_split = pl.cdiv(n_blocks, jnp.int32(n_splits))
        kb0 = split * per_split
        n_steps = jnp.maximum(jnp.minimum(n_blocks, kb0 + per_split) - kb0, 0)
        return cls(
            b,
            split,
            rb,
            seq_len,
            kb0,
            n_steps,
            block_m,
            block_kv,
            cols_of=((0, half), (half, half), (rank, pages_ref.shape[-1] - rank)),
            q_of=((q_lat_ref, 0), (q_lat_ref, half), (q_pe_ref, 0)),
        )

    def load_queries(self, q_parts, q_bars):
        """The row tile's queries into their three parts ([1, 64, width] each), each by its own
        TMA (never concatenated in HBM)."""
        for i, ((q_ref, c0), (_, width)) in enumerate(zip(self.q_of, self.cols_of)):
            plgpu.copy_gmem_to_smem(
                q_ref.at[self.b, pl.ds(self.rb * self.block_m, self.block_m), pl.ds(c0, width)],
                q_parts[i].at[0],
                q_bars.at[i],
            )

    def load_keys(self, bt_ref, pages_ref, k_parts, k_bars, tile, slot, *, steps, cluster):
        """Key tile `tile` of the split (pages by the block table) into ring slot `slot`, its
        three parts each by its own TMA (multicast to the cluster's CTAs where cluster > 1)."""
        page = pages_ref.shape[1]
        pos = (self.kb0 + tile) * self.block_kv
        pg = bt_ref[self.b, lax.div(pos, jnp.int32(page))]
        keys = pl.ds(lax.rem(pos, jnp.int32(page)), self.block_kv)
        for part, (c0, width) in enumerate(self.cols_of):
            plgpu.copy_gmem_to_smem(
                pages_ref.at[pg, keys, pl.ds(c0, width)],
                k_parts[part].at[slot],
                k_bars.at[part * steps + slot],
                collective_axes="cluster" if cluster > 1 else None,
            )

    def mask(self, s, i, n_heads, n_queries):
        """s [64, block_kv] (the scores of the split's tile i) with every key its row cannot
        see at -inf: a score at column c is visible where c + (kb0 + i) * block_kv < its row's
        query position + 1.  Only a tile that reaches past its first row's limit runs the
        compares (the row tile's last; in a chunk, every tile between its first and last rows'
        query ends): a row's limit grows with the row (query-major folding), so the first
        row's decides, and the loop keeps no [64, block_kv] index array live beside the
        accumulators (the registers the score and output tiles need)."""
        start = (self.kb0 + i) * self.block_kv
        first_row = self.rb * self.block_m
        base = self.seq_len - n_queries + 1 - start
        partial = self.block_kv > base + lax.div(first_row, jnp.int32(n_heads))

        def masked(s):
            rows = first_row + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            return jnp.where(cols < base + lax.div(rows, jnp.int32(n_heads)), s, -jnp.inf)

        return lax.cond(partial, masked, lambda s: s, s)


def softmax_step(s, m_prev, scale_log2: float):
    """One key tile of the online softmax, in log2 units: s [64, block_kv] raw (unscaled) scores,
    -inf where masked; m_prev [64] the rows' running max of the scaled scores -> (P = 2^(s *
    scale_log2 - m) [64, block_kv] fp32, the rescale factors 2^(m_prev - m) [64], m).  The scale
    is applied inside P's exponent, one FMA a score (the max of the raw scores scaled is the max
    of the scaled ones: scale_log2 > 0), not as a multiply of its own on the softmax's critical
    path.  A row with no visible key yet keeps m = -inf and P = 0."""
    m_new = jnp.maximum(m_prev, s.max(axis=1) * scale_log2)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    return p, alpha, m_new


def _decode_kernel(
    bt_ref,
    len_ref,
    q_lat_ref,
    q_pe_ref,
    pages_ref,
    o_ref,
    lse_ref,
    smem,
    bars,
    *,
    n_heads,
    n_queries,
    block_kv,
    steps,
    p_slots,
    n_splits,
    rank,
    scale_log2,
    interpret,
    stall_ns=0,
    cluster=1,
):
    """One CTA: sequence `b`, KV split `split`, 64 folded rows (heads x queries) `rows`.

    cluster 2: the CTAs of two neighbouring row tiles (the same query's heads, so the same keys)
    form a cluster and each key tile comes once, multicast by TMA into both (`k_used` then
    counts both CTAs' warpgroups before a slot is loaded again).

    Queries and key tiles sit in shared memory as three column parts, value half 0, value half
    1 and rope, each brought by its own TMA (gmem slices, so no swizzled shared-memory ref is
    ever sliced; the queries' parts from their two arrays, never concatenated in HBM); the
    scores are the sum of three wgmmas."""
    q_parts, k_parts, p_smem, vec_smem = smem
    # fp32 row vectors in one buffer (one shared-memory allocation, not three): the P buffers'
    # rescale factors, then the rows' softmax sums l, then their LSE
    alpha_smem, stat_smem, lse_smem = vec_smem.at[pl.ds(0, p_slots)], vec_smem.at[p_slots], vec_smem.at[p_slots + 1]
    q_bars, k_bars, k_used, p_ready, p_free, stats_ready = bars
    wg = lax.axis_index("wg")
    block_m = q_parts[0].shape[1]
    half = rank // 2
    dtype = q_lat_ref.dtype
    cta = DecodeCta.at(
        len_ref,
        q_lat_ref,
        q_pe_ref,
        pages_ref,
        block_m=block_m,
        block_kv=block_kv,
        n_heads=n_heads,
        n_queries=n_queries,
        n_splits=n_splits,
        rank=rank,
        cluster=cluster,
    )
    b, split, rb, n_steps = cta.b, cta.split, cta.rb, cta.n_steps
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def value_half(acc, step, slot, w):
        """acc [64, half] += P (from shared memory) @ value half w of the key tile."""

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem.at[lax.rem(step, p_slots)], k_parts[w].at[slot])

        return _mma_into(acc, pv, interpret)

    def store_half(w, acc, l_i):
        """Value half w of the rows' output, normalized, out through query part w (no score
        reads the queries any more by then)."""
        has = l_i > 0
        inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)  # a split with no keys: zeros
        q_parts[w].at[0][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            q_parts[w].at[0], o_ref.at[b, split, pl.ds(rb * block_m, block_m), pl.ds(w * half, half)]
        )

    @pl.when(wg == 0)
    def _scores_and_first_half():
        _set_registers(232, interpret)
        cta.load_queries(q_parts, q_bars)
        for i in range(3):
            plgpu.barrier_wait(q_bars.at[i])

        def issue_scores(acc_ref, i):
            """Q K^T of step i's key tile into acc_ref (wgmma issued; reading acc_ref waits).  Each
            column part's wgmma issues as soon as that part has landed (FlashMLA's fine-grained
            TMA, at the parts' granularity): the first part's product runs while the later
            parts are still arriving."""
            slot = lax.rem(i, jnp.int32(steps))
            # the queries' descriptors computed here, not hoisted before the loop (`hopper_ring.fresh`)
            here = _fresh(jnp.int32(0))
            for part in range(3):
                plgpu.barrier_wait(k_bars.at[part * steps + slot])
                plgpu.wgmma(acc_ref, q_parts[part].at[here], k_parts[part].at[slot].transpose((1, 0)))

        def softmax_and_hand_over(s, i, m_i, l_i):
            """Online softmax of step i's raw scores; P and the rescale factors go to warpgroup 1
            (warpgroup 0 reads its factors back from there: `handed_over_alpha`) -> (m, l)."""
            pslot = lax.rem(i, p_slots)
            p, alpha, m_new = softmax_step(cta.mask(s, i, n_heads, n_queries), m_i, scale_log2)
            l_i = l_i * alpha + p.sum(axis=1)

            @pl.when(i >= p_slots)
            def _():
                plgpu.barrier_wait(p_free.at[pslot])  # warpgroup 1 is done with this buffer

            p_smem.at[pslot][...] = p.astype(dtype)
            alpha_smem.at[pslot][...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready.at[pslot])
            return m_new, l_i

        def handed_over_alpha(i):
            """Step i's rescale factors read back from the buffer they were handed over in: O's
            128 multiplies then depend on a load after the hand-over's barrier, so ptxas cannot
            schedule them before P's release to warpgroup 1 (with a register copy it does, and
            warpgroup 1 waits those ~130 cycles at every step; RESULTS.md)."""
            return plgpu.load(alpha_smem.at[lax.rem(i, p_slots)], layout=row_layout, optimized=False)

        def first_half(acc, alpha, i):
            acc = value_half(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), i, lax.rem(i, jnp.int32(steps)), 0)
            plgpu.barrier_arrive(k_used.at[lax.rem(i, jnp.int32(steps))])
            return acc

        def step(i, carry):
            acc, m_i, l_i = carry

            def scores(acc_ref):
                issue_scores(acc_ref, i)
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((block_m, block_kv), jnp.float32))
            m_i, l_i = softmax_and_hand_over(s, i, m_i, l_i)
            return first_half(acc, handed_over_alpha(i), i), m_i, l_i

        init = (
            plgpu.layout_cast(jnp.full((block_m, half), 0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((block_m,), -jnp.inf, jnp.float32), row_layout),
            plgpu.layout_cast(jnp.full((block_m,), 0, jnp.float32), row_layout),
        )
        acc, m_i, l_i = lax.fori_loop(0, n_steps, step, init)

        @pl.loop(jnp.maximum(n_steps - p_slots, 0), n_steps)  # the P buffers' last releases
        def _(i):
            plgpu.barrier_wait(p_free.at[lax.rem(i, p_slots)])

        stat_smem[...] = l_i
        has = l_i > 0
        lse_smem[...] = jnp.where(has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) / _LOG2E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.barrier_arrive(stats_ready)
        store_half(0, acc, l_i)
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split, pl.ds(rb * block_m, block_m)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _second_half():
        _set_registers(232, interpret)

        def step(i, acc):
            slot = lax.rem(i, jnp.int32(steps))
            pslot = lax.rem(i, p_slots)
            plgpu.barrier_wait(p_ready.at[pslot])
            plgpu.barrier_wait(k_bars.at[steps + slot])  # value half 1 of the tile
            alpha = plgpu.load(alpha_smem.at[pslot], layout=row_layout, optimized=False)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if stall_ns:  # tests/gpu: warpgroup 1 late to read P, so only the barriers keep the slot
                pl.delay(stall_ns)
            acc = value_half(acc, i, slot, 1)
            plgpu.barrier_arrive(p_free.at[pslot])
            plgpu.barrier_arrive(k_used.at[slot])
            return acc

        acc = lax.fori_loop(
            0, n_steps, step, plgpu.layout_cast(jnp.full((block_m, half), 0, jnp.float32), plgpu.Layout.WGMMA)
        )
        plgpu.barrier_wait(stats_ready)  # also: warpgroup 0's last score has read the queries
        store_half(1, acc, plgpu.load(stat_smem, layout=row_layout, optimized=False))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        _set_registers(40, interpret)

        def load(i, slot):
            cta.load_keys(bt_ref, pages_ref, k_parts, k_bars, i, slot, steps=steps, cluster=cluster)

        _stream(n_steps, steps, load, (k_used,))
        _wait_last_releases(n_steps, steps, (k_used,))


@functools.partial(
    jax.jit,
    static_argnames=(
        "n_heads",
        "n_queries",
        "rank",
        "block_kv",
        "steps",
        "p_slots",
        "n_splits",
        "scale_log2",
        "interpret",
        "stall_ns",
        "cluster",
    ),
)
def _decode_core(
    block_tables,
    seq_lens,
    q_lat_rows,
    q_pe_rows,
    latent_pages,
    *,
    n_heads,
    n_queries,
    rank,
    block_kv,
    steps,
    p_slots,
    n_splits,
    scale_log2,
    interpret,
    stall_ns=0,
    cluster=1,
):
    """q_lat_rows [B, rows_pad, kv_lora = rank], q_pe_rows [B, rows_pad, rope] (heads x queries
    folded, padded to 64) -> o [B, splits, rows_pad, rank] (q's dtype), lse [B, splits,
    rows_pad] fp32 (natural log; -inf for a split with no keys).  cluster 2 (heads a multiple
    of 128): row tiles in pairs share each key tile, multicast."""
    b, rows_pad, _ = q_lat_rows.shape
    if cluster not in (1, 2) or (cluster == 2 and (n_heads % 128 or (rows_pad // 64) % 2)):
        raise ValueError(
            f"cluster 2 pairs row tiles of the same query (heads a multiple of 128); got "
            f"cluster={cluster}, {n_heads} heads"
        )
    block_m, half, rope = 64, rank // 2, q_pe_rows.shape[-1]
    dtype = q_lat_rows.dtype
    # wgmma wants one swizzle for both operands, and P's contraction (block_kv) must span the
    # swizzle: every 16-bit buffer takes min(64, block_kv) columns per tile.
    minor = min(64, block_kv)
    tiled = lambda shape: plgpu.SMEM(
        shape, dtype, transforms=(plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(2 * minor))
    )
    # the queries' leading dim of 1: an index `fresh` can make opaque (`hopper_ring.fresh`)
    smem = (
        (tiled((1, block_m, half)), tiled((1, block_m, half)), tiled((1, block_m, rope))),
        (tiled((steps, block_kv, half)), tiled((steps, block_kv, half)), tiled((steps, block_kv, rope))),
        tiled((p_slots, block_m, block_kv)),
        plgpu.SMEM((p_slots + 2, block_m), jnp.float32),
    )

    def entry(bt_ref, len_ref, q_lat_ref, q_pe_ref, pages_ref, o_ref, lse_ref):
        pl.run_scoped(
            lambda smem, bars: _decode_kernel(
                bt_ref,
                len_ref,
                q_lat_ref,
                q_pe_ref,
                pages_ref,
                o_ref,
                lse_ref,
                smem,
                bars,
                n_heads=n_heads,
                n_queries=n_queries,
                block_kv=block_kv,
                steps=steps,
                p_slots=p_slots,
                n_splits=n_splits,
                rank=rank,
                scale_log2=scale_log2,
                interpret=interpret,
                stall_ns=stall_ns,
                cluster=cluster,
            ),
            smem,
            (
                plgpu.Barrier(num_barriers=3),
                plgpu.Barrier(num_barriers=3 * steps),
                plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=2, num_barriers=steps)
                if cluster > 1
                else plgpu.Barrier(num_arrivals=2, num_barriers=steps),
                plgpu.Barrier(num_barriers=p_slots),
                plgpu.Barrier(num_barriers=p_slots),
                plgpu.Barrier(),
            ),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((b, n_splits, rows_pad, rank), dtype),
            jax.ShapeDtypeStruct((b, n_splits, rows_pad), jnp.float32),
        ),
        grid=(b, n_splits, rows_pad // block_m // cluster),
        grid_names=("b", "split", "rows"),
        **(dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}),
        num_threads=3,
        thread_name="wg",
        # The row reductions are within a warp in the wgmma layout: no cross-warp scratch (Mosaic
        # reserves 2 KiB by default; block_kv 64 fits only without it).
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(block_tables, seq_lens, q_lat_rows, q_pe_rows, latent_pages)


def decode_smem_bytes(width: int, block_kv: int, steps: int, p_slots: int = 2, itemsize: int = 2) -> int:
    """Shared memory `mla_decode_hopper` asks for, counted as Mosaic GPU counts it (checked by
    lowering: 238720 bytes for block_kv 64, 2 steps, 2 P slots at width 576): the queries, the
    key ring and the P slots (16-bit tiles), the fp32 row vectors (one buffer, 1 KiB aligned)
    and 8 bytes per barrier."""
    n_vectors, p_barriers = p_slots + 2, 2 * p_slots
    tiles = (64 * width + steps * block_kv * width + p_slots * 64 * block_kv) * itemsize
    vectors = -(-n_vectors * 64 * 4 // 1024) * 1024
    barriers = 3 + 3 * steps + steps + p_barriers + 1
    return tiles + vectors + 8 * barriers


def decode_splits(row_tiles: int, max_keys: int, block_kv: int, sms: int = 132) -> int:
    """KV splits per (sequence, 64-row tile) so that the CTAs fill the SMs in whole waves:
    the fewest splits whose waves are >= 90% full (48 tiles: 5 splits, 240 CTAs in two
    waves of 132), else the fullest.  Each split keeps >= 4 key tiles, and the partial
    outputs written for the merge stay under a quarter of the cache bytes read."""
    cap = max(1, min(-(-max_keys // (4 * block_kv)), max_keys * 576 // (4 * 64 * 512)))
    fill = lambda s: row_tiles * s / (sms * -(-row_tiles * s // sms))
    for s in range(1, cap + 1):
        if fill(s) >= 0.9:
            return s
    return max(range(1, cap + 1), key=fill)


def mla_decode_hopper(
    q_latent,
    q_pe,
    latent_pages,
    block_tables,
    seq_lens,
    *,
    scale,
    n_splits=None,
    block_kv=None,
    steps=2,
    p_slots=None,
    interpret=None,
    stall_ns=0,
    cluster=1,
):
    """`mla_decode` (same arguments and results) as a Hopper kernel: 64 folded rows (heads x
    query tokens) per CTA on wgmma, FlashMLA's split of the value columns over two warpgroups.

    bf16 / fp16; kv_lora a multiple of 128, rope a multiple of 64, block_kv 32 or 64 dividing
    the page (default 64 where it does).  Shared memory at kv_lora 512 + rope 64: queries
    72 KiB (the output halves leave through them), the key ring 72 KiB per slot at block_kv
    64 (36 at 32) and P 8 KiB per slot: block_kv 64 fits the H200's 227 KiB with 2 ring
    slots and one P slot, block_kv 32 with 2-3 ring slots and two P slots
    (`decode_smem_bytes`; a ring that does not fit is refused before any launch).

    At 96 heads and one query the rows pad 96 -> 128, so a quarter of the tile's work is
    padding (its rates: RESULTS.md, MLA kernels).  `kimik3.ops.mla_decode_impl` picks it on
    compute capability 9.x when heads x queries fill a 64-row tile.

    cluster 2 (heads a multiple of 128): the two row tiles of a query form a CTA cluster that
    reads each key tile once, multicast into both (measured within run-to-run scatter of one
    CTA per tile: RESULTS.md, MLA kernels).

    stall_ns > 0 (a test's knob, never the service's) makes warpgroup 1 sleep that long between
    a P buffer's arrival and its read at every step: a release of the buffer that does not wait
    for the read then shows as a wrong answer on every run, not by chance (tests/gpu)."""
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    if not float(scale) > 0:
        raise ValueError(f"scale must be positive (`softmax_step` takes the max of unscaled scores); got {scale}")
    if stall_ns and interpret:
        raise ValueError("stall_ns is a compiled kernel's timing knob; the interpreter has no warpgroup timing")
    r, p, page = check_decode_inputs(q_latent, q_pe, latent_pages, block_tables, seq_lens)
    block_kv = block_kv or (64 if page % 64 == 0 else 32)
    if q_latent.dtype not in (jnp.bfloat16, jnp.float16) or latent_pages.dtype != q_latent.dtype:
        raise ValueError(
            f"q_latent and latent_pages must share a 16-bit float dtype; got {q_latent.dtype}, {latent_pages.dtype}"
        )
    if r % 128 or p % 64 or block_kv not in (32, 64) or page % block_kv or steps < 2:
        raise ValueError(
            f"need kv_lora % 128 == 0 (got {r}), rope % 64 == 0 (got {p}), block_kv 32 or 64 "
            f"dividing the page {page} (got {block_kv}) and steps >= 2 (got {steps})"
        )
    # Two P slots let warpgroup 0 write the next P before warpgroup 1 is done with the last;
    # one is taken when two do not fit (block_kv 64 at kv_lora 512).
    itemsize = jnp.dtype(q_latent.dtype).itemsize
    smem_bytes = {n: decode_smem_bytes(r + p, block_kv, steps, n, itemsize) for n in (1, 2)}
    if smem_bytes[1] > _SMEM_BYTES:
        raise ValueError(
            f"block_kv {block_kv} x {steps} steps needs {smem_bytes[1]} bytes of shared memory at "
            f"kv_lora + rope = {r + p}; a Hopper CTA has {_SMEM_BYTES}"
        )
    p_slots = p_slots or (2 if smem_bytes[2] <= _SMEM_BYTES else 1)
    b, sq, h, _ = q_latent.shape
    rows_pad = -(-sq * h // 64) * 64
    if n_splits is None:
        device = jax.devices()[0]
        sms = (getattr(device, "core_count", None) if device.platform == "gpu" else None) or 132
        n_splits = decode_splits(b * (rows_pad // 64), block_tables.shape[1] * page, block_kv, sms)
    o_part, lse_part = _decode_core(
        jnp.asarray(block_tables, jnp.int32),
        jnp.asarray(seq_lens, jnp.int32),
        fold_rows(q_latent, rows_pad),
        fold_rows(q_pe.astype(q_latent.dtype), rows_pad),
        latent_pages,
        n_heads=h,
        n_queries=sq,
        rank=r,
        block_kv=block_kv,
        steps=steps,
        p_slots=p_slots,
        n_splits=int(n_splits),
        scale_log2=float(scale) * _LOG2E,
        interpret=interpret,
        stall_ns=int(stall_ns),
        cluster=int(cluster),
    )
    if int(n_splits) == 1:  # one split's rows are the answer: normalized, zero with no keys (`merge_splits`' values)
        return (o_part[:, 0, : sq * h].reshape(b, sq, h, r), lse_part[:, 0, : sq * h].reshape(b, sq, h))
    return merge_splits(o_part, lse_part, q_latent.shape, q_latent.dtype)
