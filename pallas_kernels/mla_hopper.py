"""MLA as Hopper (sm_90a) kernels in Mosaic GPU: wgmma, TMA, warp specialization.

`mla_prefill_hopper` and `mla_prefill_chunk_hopper`; the decode is `mla_decode_hopper`'s module.

The prefill has the same contract as `pallas_kernels.mla.mla_prefill` (naive form: causal attention of new
tokens over a cached prefix and themselves, qk head dim nope + rope, value head dim v),
built the FlashAttention-3 way: per CTA, two compute warpgroups of `block_q` query rows
each and one memory warpgroup that streams key / value blocks into a ring of
`steps` shared-memory slots by TMA.  The compute warpgroups take turns on the tensor
cores (a schedule barrier), so one's softmax overlaps the other's matmuls.  Scores stay
in base 2 (scale * log2 e folded in) and the LSE comes back in natural log.

Prefix handling without per-key masks: a sequence's keys are [lp + lq] = its prefix
(padded to `lp`) then its new tokens; the kernel visits only the prefix's whole blocks
(so prefix lengths must be multiples of `block_kv`, which page-granular cache hits are;
`supports` says when this kernel applies) and then the new-token blocks up to the
diagonal, masking only blocks that reach it.

Each compute warpgroup's query and output tiles share one shared-memory buffer (a `RefUnion`
per warpgroup: the output is written after the queries' last read), which is what lets 128-key
blocks with two ring slots fit 227 KiB at the model's qk 192 / v 128.

Interpret mode (CPU tests) runs the same kernel body, except that the P @ V matmul takes
P from shared memory instead of registers (the interpreter's wgmma reads shared memory
only) and accumulates into a fresh accumulator (`_mma_into`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.hopper_ring import SMEM_BYTES as _SMEM_BYTES
from pallas_kernels.hopper_ring import mma_into as _mma_into
from pallas_kernels.hopper_ring import set_registers as _set_registers
from pallas_kernels.hopper_ring import stream as _stream
from pallas_kernels.hopper_ring import wait_last_releases as _wait_last_releases
from pallas_kernels.moe_hopper import num_sms
from pallas_kernels.mla import _LOG2E, ChunkLayout, LatentPrefix, PrefillLayout

_COMPUTE_WGS = 2


def supports(dqk: int, dv: int, prefix_lens=None, *, block_kv: int = 64) -> bool:
    """Whether `mla_prefill_hopper` takes these head dims and prefix lengths."""
    whole = prefix_lens is None or all(int(n) % block_kv == 0 for n in np.asarray(prefix_lens).reshape(-1))
    return dqk % 64 == 0 and dv % 64 == 0 and whole


# What barriers and the lse tiles take beside a prefill CTA's data tiles (of `_SMEM_BYTES`).
_PREFILL_SMEM_RESERVE = 4096


def prefill_block_kv(dqk: int, dv: int, *, block_q: int = 64, steps: int = 2, itemsize: int = 2) -> int:
    """The key block `mla_prefill_hopper` runs best with, for a fresh prefill (no prefix): 128
    where its tiles fit shared memory (each compute warpgroup's query / output union, `steps`
    slots of keys and values), else 64.  At qk 192 / v 128, 128-key blocks took 2.39 ms
    against 2.70 at 64 (B1 T16384 H16, RESULTS.md, MLA kernels)."""
    tiles = _COMPUTE_WGS * block_q * max(dqk, dv) * itemsize + steps * 128 * (dqk + dv) * itemsize
    return 128 if tiles + _PREFILL_SMEM_RESERVE <= _SMEM_BYTES else 64


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    plen_ref,
    o_ref,
    lse_ref,
    smem,
    bars,
    used,
    schedule,
    *,
    block_q,
    block_kv,
    steps,
    prefix_blocks,
    lp_blocks,
    scale_log2,
    interpret,
    n_ctas,
    q_tiles_first=False,
):
    """One CTA: with n_ctas 0 (a CTA per tile) the tile (sequence `seq`, head `heads`, new-token
    rows [q_tile * 2 block_q, + 2 block_q)) of its grid index; else (persistent, n_ctas CTAs)
    every n_ctas-th tile of the list `tile_of` orders, its K / V ring running on from one tile
    to the next, so a tile's loads overlap the one before's last steps and epilogue.

    Prefix lengths come as static whole-block counts (`prefix_blocks`, page-granular cache
    hits) or, when `prefix_blocks` is None, from `plen_ref` (int32 [N] in GMEM, any length,
    traced): then a partly filled last prefix block is one more step, masked by length."""
    qo_unions, k_smem, v_smem, lse_smem2, p_smem2 = smem
    k_bars, v_bars, q_bars = bars
    k_used, v_used = used
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype
    dv = v_smem.shape[-1]
    n_seq, lq, n_heads = o_ref.shape[:3]
    n_qt = lq // (_COMPUTE_WGS * block_q)

    class Tile:
        """A work item: (seq, head, q_tile) and its step counts; base: the ring's global steps
        before its first (0 for a CTA per tile)."""

        def __init__(self, seq, head, q_tile, base):
            self.seq, self.head, self.q_tile, self.base = seq, head, q_tile, base
            if prefix_blocks is None:  # traced lengths: whole blocks, then the partly filled one if any
                self.plen = plen_ref[seq]
                self.n_full = lax.div(self.plen, jnp.int32(block_kv))
                self.n_prefix = pl.cdiv(self.plen, jnp.int32(block_kv))
            else:  # whole prefix blocks of this sequence: the static per-sequence counts, selected by index
                self.n_prefix = jnp.int32(0)
                for i, nb in enumerate(prefix_blocks):
                    self.n_prefix = jnp.where(seq == i, jnp.int32(nb), self.n_prefix)
            self.cta_steps = self.n_prefix + pl.cdiv((q_tile + 1) * (_COMPUTE_WGS * block_q), jnp.int32(block_kv))

        def key_block(self, step):  # the key block (of the [lp + lq] key rows) a pipeline step loads
            return jnp.where(step < self.n_prefix, step, lp_blocks + step - self.n_prefix)

        def slot(self, step):
            if isinstance(self.base, int) and isinstance(step, int):
                return (self.base + step) % steps
            return lax.rem(self.base + step, jnp.int32(steps))

    def tile_of(item, base):
        """Work item `item` of the persistent list: the longest causal rows first (q tiles from
        the last), then heads, then sequences: a CTA's tiles shrink as it goes, so the last ones
        to finish are short (the longest-processing-time-first order).  q_tiles_first: a (seq,
        head)'s q tiles (longest first) are adjacent instead, so the CTAs working at one time
        share K / V blocks (`tile_order`)."""
        if q_tiles_first:
            rest = lax.div(item, jnp.int32(n_qt))
            return Tile(
                lax.div(rest, jnp.int32(n_heads)),
                lax.rem(rest, jnp.int32(n_heads)),
                n_qt - 1 - lax.rem(item, jnp.int32(n_qt)),
                base,
            )
        per_tile_row = n_heads * n_seq
        rest = lax.rem(item, jnp.int32(per_tile_row))
        return Tile(
            lax.div(rest, jnp.int32(n_heads)),
            lax.rem(rest, jnp.int32(n_heads)),
            n_qt - 1 - lax.div(item, jnp.int32(per_tile_row)),
            base,
        )

    def for_each_tile(body):
        """body(tile) -> its steps, for this CTA's tiles; the steps of all of them."""
        if not n_ctas:
            # the longest causal rows first (FlashAttention's order): CTAs launch in grid order, so
            # the last wave holds the shortest tiles rather than the longest
            # base a Python 0: a constant array closed over by `run_state` does not lower
            return body(Tile(lax.axis_index("seq"), lax.axis_index("heads"), n_qt - 1 - lax.axis_index("q_tile"), 0))
        return pl.loop(lax.axis_index("sm"), n_seq * n_heads * n_qt, step=n_ctas, init_carry=jnp.int32(0))(
            lambda item, base: base + body(tile_of(item, base))
        )

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def _compute(wg: int):
        """Compute warpgroup `wg` (static: its query and output tiles are its own union's members)."""
        _set_registers(232, interpret)
        for_each_tile(functools.partial(_compute_tile, wg))

    def _compute_tile(wg: int, tile: Tile):
        """Compute warpgroup `wg`'s rows of one tile; returns the tile's steps."""
        seq, head, q_tile, n_prefix = tile.seq, tile.head, tile.q_tile, tile.n_prefix
        q_smem, o_smem = qo_unions[wg]  # one buffer: the output is written after the queries' last read
        lse_smem = lse_smem2.at[wg]
        row0 = q_tile * (_COMPUTE_WGS * block_q) + wg * block_q  # first new-token row of this warpgroup
        my_steps = n_prefix + pl.cdiv(row0 + block_q, jnp.int32(block_kv))
        clear_steps = n_prefix + lax.div(row0, jnp.int32(block_kv))  # blocks wholly before row0: no mask
        plgpu.copy_gmem_to_smem(q_ref.at[seq, pl.ds(row0, block_q), head], q_smem, q_bars.at[wg])
        plgpu.barrier_wait(q_bars.at[wg])
        m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((block_q, dv), 0, jnp.float32), plgpu.Layout.WGMMA)
        plgpu.barrier_wait(k_bars.at[tile.slot(0)])  # my_steps >= 1: the diagonal block always exists
        if wg == 1:
            schedule_barrier()

        def step(kv_step, carry, masked):
            acc, m_i, l_i = carry
            slot = tile.slot(kv_step)

            def qk_scoped(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                schedule_barrier()
                return acc_ref[...]

            s = pl.run_scoped(qk_scoped, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_used.at[slot])
            s = s * scale_log2
            cols = lambda: plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
            if masked == "prefix":  # only the partly filled prefix block (if any): keys before the prefix's end
                s = lax.cond(
                    (kv_step == tile.n_full) & (tile.n_full < n_prefix),
                    lambda s: jnp.where(cols() + kv_step * block_kv < tile.plen, s, -jnp.inf),
                    lambda s: s,
                    s,
                )
            elif masked:  # new-token block reaching the diagonal: key index <= query index
                rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                s = jnp.where(rows + row0 >= cols() + (kv_step - n_prefix) * block_kv, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(v_bars.at[slot])
            plgpu.barrier_wait(schedule)

            def wait_next_keys():
                nxt = kv_step + 1

                @pl.when(nxt < my_steps)
                def _():
                    plgpu.barrier_wait(k_bars.at[tile.slot(nxt)])

            p_operand = p16
            if interpret:  # the interpreter's wgmma reads A from shared memory only
                p_operand = p_smem2.at[wg]
                p_operand[...] = p16
                plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_operand, v_smem.at[slot])
                wait_next_keys()

            acc = _mma_into(acc, pv, interpret)
            plgpu.barrier_arrive(v_used.at[slot])
            return acc, m_new, l_i

        def drain(kv_step, _):
            # Steps the other warpgroup still needs: release their slots, keep the turn order.
            # Their arrivals are waited for too (already due), so every waiter sees every phase.
            slot = tile.slot(kv_step)
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_wait(v_bars.at[slot])
            plgpu.barrier_arrive(k_used.at[slot])
            plgpu.barrier_arrive(v_used.at[slot])
            schedule_barrier()
            schedule_barrier()

        # The blocks before the diagonal in one loop: with traced prefix lengths, the partly filled
        # last prefix block's mask sits behind a branch in it, not in loops of its own (each loop
        # is a copy of the step that Mosaic GPU lowers again: four of them took 1.3 s of Python a
        # program, two 0.75 s)
        carry = lax.fori_loop(
            0,
            clear_steps,
            functools.partial(step, masked="prefix" if prefix_blocks is None else False),
            (acc, m_i, l_i),
        )
        acc, m_i, l_i = lax.fori_loop(clear_steps, my_steps, functools.partial(step, masked="diagonal"), carry)
        lax.fori_loop(my_steps, tile.cta_steps, drain, None)
        if wg == 0:
            schedule_barrier()

        acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
        # the queries' last reader, the last step's Q K^T wgmma, has completed (its scores were read)
        o_smem[...] = acc.astype(dtype)
        lse_smem[...] = m_i + jnp.log2(l_i)  # every row sees at least its own key: l > 0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[seq, pl.ds(row0, block_q), head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, head, pl.ds(row0, block_q)])
        plgpu.wait_smem_to_gmem(0)  # the next tile's queries land in the same buffer
        return tile.cta_steps

    for w in range(_COMPUTE_WGS):
        pl.when(wg == w)(functools.partial(_compute, w))

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
        _set_registers(40, interpret)

        def stream_tile(tile: Tile):
            def load(step, slot):
                rows = (tile.seq, pl.ds(tile.key_block(step) * block_kv, block_kv), tile.head)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bars.at[slot])

            _stream(tile.cta_steps, steps, load, (k_used, v_used), base=tile.base)
            return tile.cta_steps

        _wait_last_releases(for_each_tile(stream_tile), steps, (k_used, v_used))


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_q",
        "block_kv",
        "steps",
        "prefix_blocks",
        "lp_blocks",
        "scale_log2",
        "interpret",
        "n_ctas",
        "q_tiles_first",
    ),
)
def _hopper_core(
    q,
    k,
    v,
    p_lens,
    *,
    block_q,
    block_kv,
    steps,
    prefix_blocks,
    lp_blocks,
    scale_log2,
    interpret,
    n_ctas=0,
    q_tiles_first=False,
):
    """q [N, lq, H, Dqk], k [N, lp + lq, H, Dqk], v [N, lp + lq, H, Dv], p_lens int32 [N] (read
    only when prefix_blocks is None) -> o [N, lq, H, Dv], lse base 2 [N, H, lq].  n_ctas: 0, a
    CTA per tile; else that many persistent CTAs (at most the tiles)."""
    n, lq, h, dqk = q.shape
    n_ctas = min(n_ctas, n * h * (lq // (_COMPUTE_WGS * block_q)))
    dv = v.shape[-1]
    tiling, swizzle = plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)
    tiled = lambda shape: plgpu.SMEM(shape, q.dtype, transforms=(tiling, swizzle))
    # each compute warpgroup's query and output tiles share one buffer (their lifetimes do not
    # overlap): 2 x block_q x dv of shared memory freed, what 128-key blocks with two slots need
    smem = (
        [plgpu.RefUnion(tiled((block_q, dqk)), tiled((block_q, dv))) for _ in range(_COMPUTE_WGS)],
        tiled((steps, block_kv, dqk)),
        tiled((steps, block_kv, dv)),
        plgpu.SMEM((_COMPUTE_WGS, block_q), jnp.float32),
        tiled((_COMPUTE_WGS, block_q, block_kv)) if interpret else None,
    )

    def entry(q_ref, k_ref, v_ref, plen_ref, o_ref, lse_ref):
        pl.run_scoped(
            lambda smem, bars, used, schedule: _kernel(
                q_ref,
                k_ref,
                v_ref,
                plen_ref,
                o_ref,
                lse_ref,
                smem,
                bars,
                used,
                schedule,
                block_q=block_q,
                block_kv=block_kv,
                steps=steps,
                prefix_blocks=prefix_blocks,
                lp_blocks=lp_blocks,
                scale_log2=scale_log2,
                interpret=interpret,
                n_ctas=n_ctas,
                q_tiles_first=q_tiles_first,
            ),
            smem,
            (
                plgpu.Barrier(num_barriers=steps),
                plgpu.Barrier(num_barriers=steps),
                plgpu.Barrier(num_barriers=_COMPUTE_WGS),
            ),
            (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=steps),) * 2,
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
            collective_axes="wg",
        )

    # CTAs launch in grid order, the first axis fastest; q_tiles_first: a (seq, head)'s q tiles
    # together, so the CTAs resident at one time read the same K / V blocks (L2 hits)
    axes = dict(sm=n_ctas, heads=h, q_tile=lq // (_COMPUTE_WGS * block_q), seq=n)
    order = ("sm",) if n_ctas else ("q_tile", "heads", "seq") if q_tiles_first else ("heads", "q_tile", "seq")
    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((n, lq, h, dv), q.dtype), jax.ShapeDtypeStruct((n, h, lq), jnp.float32)),
        grid=tuple(axes[a] for a in order),
        grid_names=order,
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(q, k, v, p_lens)


def _persistent_ctas(persistent: bool, sms: int | None) -> int:
    """`_hopper_core`'s n_ctas: 0 (a CTA per tile), or `sms` (default `num_sms()`) persistent CTAs."""
    return (sms or num_sms()) if persistent else 0


def _check_16bit(*xs):
    """wgmma here takes bf16 / fp16 operands, one dtype for all."""
    if xs[0].dtype not in (jnp.bfloat16, jnp.float16) or any(x.dtype != xs[0].dtype for x in xs):
        raise ValueError(f"q, k, v must share a 16-bit float dtype; got {', '.join(str(x.dtype) for x in xs)}")


TILE_ORDERS = ("heads", "q_tiles")


def _q_tiles_first(tile_order: str) -> bool:
    if tile_order not in TILE_ORDERS:
        raise ValueError(f"tile_order must be one of {TILE_ORDERS}; got {tile_order!r}")
    return tile_order == "q_tiles"


def mla_prefill_hopper(
    q,
    k,
    v,
    *,
    cu_seqlens,
    scale,
    prefix: LatentPrefix | None = None,
    block_q=64,
    block_kv=64,
    steps=2,
    persistent=False,
    sms=None,
    tile_order="heads",
    interpret=None,
):
    """`mla_prefill` (same arguments and results, no `rope_dim` needed: q / k keep nope and rope
    together) as a Hopper kernel.  bf16 / fp16 inputs; qk and v head dims multiples of 64 and
    prefix lengths multiples of `block_kv` (`supports`).  Raises ValueError otherwise, before
    any launch.  persistent: one CTA per SM walking the tiles longest first, its K / V ring
    running on across tiles (a CTA fills an SM's shared memory, so with a CTA per tile every
    tile's first loads and last stores stand alone); a candidate until measured.  sms: its CTAs
    (default `num_sms()`; never more than tiles).  tile_order: which tiles run at one time:
    "heads" (the heads of one q tile, the measured default) or "q_tiles" (the q tiles of one
    (sequence, head), longest first: up to lq / 128 resident CTAs read the same K / V blocks, so
    most reads hit L2; a step's 128 FLOP a byte is under the H100's ~270 ridge without that
    reuse); a candidate until measured."""
    _check_16bit(q, k, v)
    q_tiles_first = _q_tiles_first(tile_order)
    if block_q % 64 or block_kv % 64 or steps < 2:
        raise ValueError(
            f"block_q and block_kv must be multiples of 64 and steps >= 2; got {block_q}, {block_kv}, {steps}"
        )
    lay = PrefillLayout(q, k, v, cu_seqlens, prefix, q_multiple=_COMPUTE_WGS * block_q, k_multiple=block_kv)
    if lay.lq % block_kv:
        raise ValueError(f"block_kv {block_kv} must divide {_COMPUTE_WGS} x block_q = {_COMPUTE_WGS * block_q}")
    if not supports(q.shape[-1], v.shape[-1], lay.p_lens, block_kv=block_kv):
        raise ValueError(
            f"head dims must be multiples of 64 (qk {q.shape[-1]}, v {v.shape[-1]}) and prefix "
            f"lengths multiples of block_kv {block_kv} (got {lay.p_lens.tolist()})"
        )
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    keys, vals = lay.keys_values(k, v)
    o, lse2 = _hopper_core(
        lay.gather(q),
        keys,
        vals,
        jnp.asarray(lay.p_lens, jnp.int32),
        block_q=block_q,
        block_kv=block_kv,
        steps=steps,
        prefix_blocks=tuple(int(n) // block_kv for n in lay.p_lens),
        lp_blocks=lay.lp // block_kv,
        scale_log2=float(scale) * _LOG2E,
        interpret=interpret,
        n_ctas=_persistent_ctas(persistent, sms),
        q_tiles_first=q_tiles_first,
    )
    return lay.unpad(o, jnp.swapaxes(lse2, 1, 2) / _LOG2E, v.shape[-1])


def mla_prefill_chunk_hopper(
    q,
    k,
    v,
    prefix: LatentPrefix,
    *,
    scale,
    block_q=64,
    block_kv=64,
    steps=2,
    persistent=False,
    sms=None,
    tile_order="heads",
    interpret=None,
):
    """`pallas_kernels.mla.mla_prefill_chunk` (same arguments and results, no `rope_dim`) as the
    Hopper prefill kernel: prefix lengths of any value, traced or concrete, read by the
    kernel (a partly filled last prefix block is one more step, masked by length).  bf16 /
    fp16; head dims multiples of 64.  persistent / sms / tile_order: as `mla_prefill_hopper`'s.
    `kimik3.ops.mla_chunk_impl` picks it on 9.x GPUs for chunks of 128+ tokens (`KIMIK3_MLA_CHUNK`;
    its GPU rows and `small`'s chunk logits: tests/gpu, RESULTS.md).  Its Mosaic
    GPU lowering is Python work, repeated in every program that holds it (RESULTS.md, serving)."""
    _check_16bit(q, k, v)
    if q.shape[-1] % 64 or v.shape[-1] % 64 or block_q % 64 or block_kv % 64 or steps < 2:
        raise ValueError(
            f"head dims (qk {q.shape[-1]}, v {v.shape[-1]}), block_q and block_kv must be multiples "
            f"of 64 and steps >= 2; got {block_q}, {block_kv}, {steps}"
        )
    lay = ChunkLayout(q, k, v, prefix, q_multiple=_COMPUTE_WGS * block_q, k_multiple=block_kv)
    if lay.lq % block_kv:
        raise ValueError(f"block_kv {block_kv} must divide {_COMPUTE_WGS} x block_q = {_COMPUTE_WGS * block_q}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    o, lse2 = _hopper_core(
        lay.q,
        lay.keys,
        lay.vals,
        lay.p_lens,
        block_q=block_q,
        block_kv=block_kv,
        steps=steps,
        prefix_blocks=None,
        lp_blocks=lay.lp // block_kv,
        scale_log2=float(scale) * _LOG2E,
        interpret=interpret,
        n_ctas=_persistent_ctas(persistent, sms),
        q_tiles_first=_q_tiles_first(tile_order),
    )
    t = q.shape[1]
    return o[:, :t], jnp.swapaxes(lse2, 1, 2)[:, :t] / _LOG2E
