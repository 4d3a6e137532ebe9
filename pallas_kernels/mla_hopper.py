"""MLA as Hopper (sm_90a) kernels in Mosaic GPU: wgmma, TMA, warp specialization.

`mla_prefill_hopper` (below) and `mla_decode_hopper` (further down, FlashMLA's layout).

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

from pallas_kernels.moe_hopper import num_sms
from pallas_kernels.mla import (_LOG2E, ChunkLayout, LatentPrefix, PrefillLayout, check_decode_inputs, fold_rows,
                                merge_splits, visible_keys)

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
    against 2.70 at 64 (B1 T16384 H16, RESULTS.md, session 30)."""
    tiles = _COMPUTE_WGS * block_q * max(dqk, dv) * itemsize + steps * 128 * (dqk + dv) * itemsize
    return 128 if tiles + _PREFILL_SMEM_RESERVE <= _SMEM_BYTES else 64


def _set_registers(count: int, interpret: bool):
    """Rebalance the register file between warpgroups (232 for each compute, 40 for the
    producer: FlashAttention-3's split); the interpreter has no register file."""
    if not interpret:
        plgpu.set_max_registers(count, action="increase" if count > 128 else "decrease")


def _mma_into(acc, mma, interpret: bool):
    """acc plus what `mma(acc_ref)` accumulates (wgmma calls).  On the GPU in place (run_state):
    a second fp32 accumulator would double the registers it takes.  The interpreter has no
    run_state over a wgmma accumulator, so there into a fresh one, added after."""
    if interpret:
        def scoped(acc_ref):
            mma(acc_ref)
            return acc_ref[...]

        return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(mma)(plgpu.ACC.init(acc))


def _stream(n_steps, steps: int, load, released, base=0):
    """The producer warpgroup's ring for one tile: `load(i, slot)` for its steps i = 0 ..
    n_steps - 1, global step base + i going into slot (base + i) % steps once the consumers have
    arrived on every barrier in `released` for the global step that held the slot before (a
    persistent CTA's tiles continue one ring: base counts the steps of its earlier tiles)."""
    @pl.loop(0, n_steps)
    def _(i):
        g = base + i
        slot = lax.rem(g, jnp.int32(steps))

        @pl.when(g >= steps)
        def _():
            for bars in released:
                plgpu.barrier_wait(bars.at[slot])

        load(i, slot)


def _wait_last_releases(total, steps: int, released):
    """The releases of the ring's last `steps` global steps (of `total`): nothing needs them, but
    every waiter then sees every phase, and no use of shared memory outlives the CTA."""
    @pl.loop(jnp.maximum(total - steps, 0), total)
    def _(g):
        for bars in released:
            plgpu.barrier_wait(bars.at[lax.rem(g, jnp.int32(steps))])


def _kernel(q_ref, k_ref, v_ref, plen_ref, o_ref, lse_ref, smem, bars, used, schedule, *, block_q, block_kv, steps,
            prefix_blocks, lp_blocks, scale_log2, interpret, n_ctas, q_tiles_first=False):
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
            return Tile(lax.div(rest, jnp.int32(n_heads)), lax.rem(rest, jnp.int32(n_heads)),
                        n_qt - 1 - lax.rem(item, jnp.int32(n_qt)), base)
        per_tile_row = n_heads * n_seq
        rest = lax.rem(item, jnp.int32(per_tile_row))
        return Tile(lax.div(rest, jnp.int32(n_heads)), lax.rem(rest, jnp.int32(n_heads)),
                    n_qt - 1 - lax.div(item, jnp.int32(per_tile_row)), base)

    def for_each_tile(body):
        """body(tile) -> its steps, for this CTA's tiles; the steps of all of them."""
        if not n_ctas:
            # the longest causal rows first (FlashAttention's order): CTAs launch in grid order, so
            # the last wave holds the shortest tiles rather than the longest
            # base a Python 0: a constant array closed over by `run_state` does not lower
            return body(Tile(lax.axis_index("seq"), lax.axis_index("heads"), n_qt - 1 - lax.axis_index("q_tile"), 0))
        return pl.loop(lax.axis_index("sm"), n_seq * n_heads * n_qt, step=n_ctas, init_carry=jnp.int32(0))(
            lambda item, base: base + body(tile_of(item, base)))

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
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                if masked == "prefix":  # the partly filled prefix block: keys before the prefix's end
                    s = jnp.where(cols + kv_step * block_kv < tile.plen, s, -jnp.inf)
                else:  # new-token block reaching the diagonal: key index <= query index
                    s = jnp.where(rows + row0 >= cols + (kv_step - n_prefix) * block_kv, s, -jnp.inf)
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

        carry = (acc, m_i, l_i)
        if prefix_blocks is None:  # whole prefix blocks, then the partly filled one (a row sees key 0)
            carry = lax.fori_loop(0, tile.n_full, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(tile.n_full, n_prefix, functools.partial(step, masked="prefix"), carry)
            carry = lax.fori_loop(n_prefix, clear_steps, functools.partial(step, masked=False), carry)
        else:
            carry = lax.fori_loop(0, clear_steps, functools.partial(step, masked=False), carry)
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


@functools.partial(jax.jit, static_argnames=("block_q", "block_kv", "steps", "prefix_blocks", "lp_blocks",
                                             "scale_log2", "interpret", "n_ctas", "q_tiles_first"))
def _hopper_core(q, k, v, p_lens, *, block_q, block_kv, steps, prefix_blocks, lp_blocks, scale_log2, interpret,
                 n_ctas=0, q_tiles_first=False):
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
    smem = ([plgpu.RefUnion(tiled((block_q, dqk)), tiled((block_q, dv))) for _ in range(_COMPUTE_WGS)],
            tiled((steps, block_kv, dqk)), tiled((steps, block_kv, dv)),
            plgpu.SMEM((_COMPUTE_WGS, block_q), jnp.float32),
            tiled((_COMPUTE_WGS, block_q, block_kv)) if interpret else None)

    def entry(q_ref, k_ref, v_ref, plen_ref, o_ref, lse_ref):
        pl.run_scoped(
            lambda smem, bars, used, schedule: _kernel(
                q_ref, k_ref, v_ref, plen_ref, o_ref, lse_ref, smem, bars, used, schedule, block_q=block_q,
                block_kv=block_kv, steps=steps, prefix_blocks=prefix_blocks, lp_blocks=lp_blocks,
                scale_log2=scale_log2, interpret=interpret, n_ctas=n_ctas, q_tiles_first=q_tiles_first),
            smem,
            (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps),
             plgpu.Barrier(num_barriers=_COMPUTE_WGS)),
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


def mla_prefill_hopper(q, k, v, *, cu_seqlens, scale, prefix: LatentPrefix | None = None, block_q=64,
                       block_kv=64, steps=2, persistent=False, sms=None, tile_order="heads", interpret=None):
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
        raise ValueError(f"block_q and block_kv must be multiples of 64 and steps >= 2; got {block_q}, "
                         f"{block_kv}, {steps}")
    lay = PrefillLayout(q, k, v, cu_seqlens, prefix, q_multiple=_COMPUTE_WGS * block_q, k_multiple=block_kv)
    if lay.lq % block_kv:
        raise ValueError(f"block_kv {block_kv} must divide {_COMPUTE_WGS} x block_q = {_COMPUTE_WGS * block_q}")
    if not supports(q.shape[-1], v.shape[-1], lay.p_lens, block_kv=block_kv):
        raise ValueError(f"head dims must be multiples of 64 (qk {q.shape[-1]}, v {v.shape[-1]}) and prefix "
                         f"lengths multiples of block_kv {block_kv} (got {lay.p_lens.tolist()})")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    keys, vals = lay.keys_values(k, v)
    o, lse2 = _hopper_core(lay.gather(q), keys, vals, jnp.asarray(lay.p_lens, jnp.int32), block_q=block_q,
                           block_kv=block_kv, steps=steps,
                           prefix_blocks=tuple(int(n) // block_kv for n in lay.p_lens), lp_blocks=lay.lp // block_kv,
                           scale_log2=float(scale) * _LOG2E, interpret=interpret,
                           n_ctas=_persistent_ctas(persistent, sms), q_tiles_first=q_tiles_first)
    return lay.unpad(o, jnp.swapaxes(lse2, 1, 2) / _LOG2E, v.shape[-1])


def mla_prefill_chunk_hopper(q, k, v, prefix: LatentPrefix, *, scale, block_q=64, block_kv=64, steps=2,
                             persistent=False, sms=None, tile_order="heads", interpret=None):
    """`pallas_kernels.mla.mla_prefill_chunk` (same arguments and results, no `rope_dim`) as the
    Hopper prefill kernel: prefix lengths of any value, traced or concrete, read by the
    kernel (a partly filled last prefix block is one more step, masked by length).  bf16 /
    fp16; head dims multiples of 64.  persistent / sms / tile_order: as `mla_prefill_hopper`'s.

    Not yet run on a GPU (written after the session's device time was spent; the interpreter
    and the CUDA lowering test it): `kimik3.ops` runs the Triton `mla_prefill_chunk` until
    `benchmarks/mla.py --sections chunk` has measured both."""
    _check_16bit(q, k, v)
    if q.shape[-1] % 64 or v.shape[-1] % 64 or block_q % 64 or block_kv % 64 or steps < 2:
        raise ValueError(f"head dims (qk {q.shape[-1]}, v {v.shape[-1]}), block_q and block_kv must be multiples "
                         f"of 64 and steps >= 2; got {block_q}, {block_kv}, {steps}")
    lay = ChunkLayout(q, k, v, prefix, q_multiple=_COMPUTE_WGS * block_q, k_multiple=block_kv)
    if lay.lq % block_kv:
        raise ValueError(f"block_kv {block_kv} must divide {_COMPUTE_WGS} x block_q = {_COMPUTE_WGS * block_q}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    o, lse2 = _hopper_core(lay.q, lay.keys, lay.vals, lay.p_lens, block_q=block_q, block_kv=block_kv, steps=steps,
                           prefix_blocks=None, lp_blocks=lay.lp // block_kv, scale_log2=float(scale) * _LOG2E,
                           interpret=interpret, n_ctas=_persistent_ctas(persistent, sms),
                           q_tiles_first=_q_tiles_first(tile_order))
    t = q.shape[1]
    return o[:, :t], jnp.swapaxes(lse2, 1, 2)[:, :t] / _LOG2E


# ---- decode ------------------------------------------------------------------------------------
#
# Absorbed decode at many heads is compute-bound (H96: ~180 FLOP per latent byte), so it needs
# wgmma at 64 rows.  A 64 x 512 fp32 accumulator is 256 registers a thread for one warpgroup,
# too many; as in FlashMLA, two compute warpgroups share the same 64 rows and each owns half
# of the 512 value columns.  Warpgroup 0 computes the scores Q K^T (all 576 latent columns),
# the online softmax, and hands P and the rescale factors to warpgroup 1 through shared memory
# (two P slots where they fit, else one); both then multiply P by their half of the same key
# tile (the value is the first 512 columns of the latent).  A third warpgroup streams key tiles
# from the pages by TMA.  A block of rows stops at the last key its last query sees, so a
# prefill chunk (Sq = the chunk) skips the causal upper triangle a tile at a time.


def _decode_kernel(bt_ref, len_ref, q_lat_ref, q_pe_ref, pages_ref, o_ref, lse_ref, smem, bars, *, n_heads,
                   n_queries, block_kv, steps, p_slots, n_splits, page, rank, scale_log2, interpret, stall_ns=0,
                   cluster=1):
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
    b, split, rb = lax.axis_index("b"), lax.axis_index("split"), lax.axis_index("rows")
    if cluster > 1:
        rb = rb * cluster + lax.axis_index("cluster")
    wg = lax.axis_index("wg")
    block_m = q_parts[0].shape[0]
    half = rank // 2
    cols_of = ((0, half), (half, half), (rank, pages_ref.shape[-1] - rank))  # (start, width) per part
    q_of = ((q_lat_ref, 0), (q_lat_ref, half), (q_pe_ref, 0))  # (array, first column) per part
    dtype = q_lat_ref.dtype
    seq_len = len_ref[b]
    n_blocks = pl.cdiv(visible_keys(seq_len, n_queries, n_heads, rb * block_m + block_m - 1), jnp.int32(block_kv))
    per_split = pl.cdiv(n_blocks, jnp.int32(n_splits))
    kb0 = split * per_split
    n_steps = jnp.maximum(jnp.minimum(n_blocks, kb0 + per_split) - kb0, 0)
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
        q_parts[w][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_parts[w], o_ref.at[b, split, pl.ds(rb * block_m, block_m), pl.ds(w * half, half)])

    @pl.when(wg == 0)
    def _scores_and_first_half():
        _set_registers(232, interpret)
        for i, ((q_ref, c0), (_, width)) in enumerate(zip(q_of, cols_of)):
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(rb * block_m, block_m), pl.ds(c0, width)], q_parts[i],
                                    q_bars.at[i])
        for i in range(3):
            plgpu.barrier_wait(q_bars.at[i])
        rows = rb * block_m + plgpu.broadcasted_iota(jnp.int32, (block_m, block_kv), 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, (block_m, block_kv), 1, layout=plgpu.Layout.WGMMA)
        limit = seq_len - n_queries + lax.div(rows, jnp.int32(n_heads)) + 1  # keys < limit are visible

        def issue_scores(acc_ref, i):
            """Q K^T of step i's key tile into acc_ref (wgmma issued; reading acc_ref waits)."""
            slot = lax.rem(i, jnp.int32(steps))
            for part in range(3):
                plgpu.barrier_wait(k_bars.at[part * steps + slot])
            for part in range(3):
                plgpu.wgmma(acc_ref, q_parts[part], k_parts[part].at[slot].transpose((1, 0)))

        def softmax_and_hand_over(s, i, m_i, l_i):
            """Online softmax of step i's raw scores; P and the rescale factors go to warpgroup 1."""
            pslot = lax.rem(i, p_slots)
            s = jnp.where(cols + (kb0 + i) * block_kv < limit, s * scale_log2, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with no visible key yet
            alpha = jnp.exp2(m_i - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)

            @pl.when(i >= p_slots)
            def _():
                plgpu.barrier_wait(p_free.at[pslot])  # warpgroup 1 is done with this buffer

            p_smem.at[pslot][...] = p.astype(dtype)
            alpha_smem.at[pslot][...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready.at[pslot])
            return alpha, m_new, l_i

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
            alpha, m_i, l_i = softmax_and_hand_over(s, i, m_i, l_i)
            return first_half(acc, alpha, i), m_i, l_i

        init = (plgpu.layout_cast(jnp.full((block_m, half), 0, jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((block_m,), -jnp.inf, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.full((block_m,), 0, jnp.float32), row_layout))
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

        acc = lax.fori_loop(0, n_steps, step,
                            plgpu.layout_cast(jnp.full((block_m, half), 0, jnp.float32), plgpu.Layout.WGMMA))
        plgpu.barrier_wait(stats_ready)  # also: warpgroup 0's last score has read the queries
        store_half(1, acc, plgpu.load(stat_smem, layout=row_layout, optimized=False))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        _set_registers(40, interpret)

        def load(i, slot):
            pos = (kb0 + i) * block_kv
            pg = bt_ref[b, lax.div(pos, jnp.int32(page))]
            keys = pl.ds(lax.rem(pos, jnp.int32(page)), block_kv)
            for part, (c0, width) in enumerate(cols_of):
                plgpu.copy_gmem_to_smem(pages_ref.at[pg, keys, pl.ds(c0, width)], k_parts[part].at[slot],
                                        k_bars.at[part * steps + slot],
                                        collective_axes="cluster" if cluster > 1 else None)

        _stream(n_steps, steps, load, (k_used,))
        _wait_last_releases(n_steps, steps, (k_used,))


DECODE_SCHEDULES = ("default", "alternate")


@functools.partial(jax.jit, static_argnames=("n_heads", "n_queries", "rank", "block_kv", "steps", "p_slots",
                                             "n_splits", "scale_log2", "interpret", "stall_ns", "schedule",
                                             "cluster"))
def _decode_core(block_tables, seq_lens, q_lat_rows, q_pe_rows, latent_pages, *, n_heads, n_queries, rank, block_kv,
                 steps, p_slots, n_splits, scale_log2, interpret, stall_ns=0, schedule="default", cluster=1):
    """q_lat_rows [B, rows_pad, kv_lora = rank], q_pe_rows [B, rows_pad, rope] (heads x queries
    folded, padded to 64) -> o [B, splits, rows_pad, rank] (q's dtype), lse [B, splits,
    rows_pad] fp32 (natural log; -inf for a split with no keys).  schedule "alternate": the
    score tiles dealt to both compute warpgroups in turn (`mla_decode_alternating`; one P slot).
    cluster 2 (heads a multiple of 128): row tiles in pairs share each key tile, multicast."""
    from pallas_kernels import mla_decode_alternating as alternating

    if schedule not in DECODE_SCHEDULES:
        raise ValueError(f"schedule must be one of {DECODE_SCHEDULES}; got {schedule!r}")
    alternate = schedule == "alternate"
    if alternate and p_slots != 1:
        raise ValueError(f"the alternating schedule hands P over through one slot; got p_slots={p_slots}")
    b, rows_pad, _ = q_lat_rows.shape
    if cluster not in (1, 2) or (cluster == 2 and (n_heads % 128 or (rows_pad // 64) % 2)):
        raise ValueError(f"cluster 2 pairs row tiles of the same query (heads a multiple of 128); got "
                         f"cluster={cluster}, {n_heads} heads")
    block_m, half, rope = 64, rank // 2, q_pe_rows.shape[-1]
    dtype = q_lat_rows.dtype
    # wgmma wants one swizzle for both operands, and P's contraction (block_kv) must span the
    # swizzle: every 16-bit buffer takes min(64, block_kv) columns per tile.
    minor = min(64, block_kv)
    tiled = lambda shape: plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(2 * minor)))
    smem = ((tiled((block_m, half)), tiled((block_m, half)), tiled((block_m, rope))),
            (tiled((steps, block_kv, half)), tiled((steps, block_kv, half)), tiled((steps, block_kv, rope))),
            tiled((p_slots, block_m, block_kv)),
            plgpu.SMEM((p_slots + 2, block_m), jnp.float32))

    def entry(bt_ref, len_ref, q_lat_ref, q_pe_ref, pages_ref, o_ref, lse_ref):
        if alternate:
            q_smem, k_smem, p_smem, _ = smem
            pl.run_scoped(
                lambda smem, bars: alternating.decode_kernel(
                    bt_ref, len_ref, q_lat_ref, q_pe_ref, pages_ref, o_ref, lse_ref, smem, bars, n_heads=n_heads,
                    n_queries=n_queries, block_kv=block_kv, steps=steps, n_splits=n_splits,
                    page=latent_pages.shape[1], rank=rank, scale_log2=scale_log2, interpret=interpret,
                    stall_ns=stall_ns, cluster=cluster),
                (q_smem, k_smem, tiled((block_m, block_kv)), plgpu.SMEM((alternating.VECTORS, block_m), jnp.float32)),
                alternating.barriers(steps, cluster),
                collective_axes="wg",
            )
            return
        pl.run_scoped(
            lambda smem, bars: _decode_kernel(
                bt_ref, len_ref, q_lat_ref, q_pe_ref, pages_ref, o_ref, lse_ref, smem, bars, n_heads=n_heads,
                n_queries=n_queries, block_kv=block_kv, steps=steps, p_slots=p_slots, n_splits=n_splits,
                page=latent_pages.shape[1], rank=rank, scale_log2=scale_log2, interpret=interpret,
                stall_ns=stall_ns, cluster=cluster),
            smem,
            (plgpu.Barrier(num_barriers=3), plgpu.Barrier(num_barriers=3 * steps),
             plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=2, num_barriers=steps) if cluster > 1
             else plgpu.Barrier(num_arrivals=2, num_barriers=steps),
             plgpu.Barrier(num_barriers=p_slots), plgpu.Barrier(num_barriers=p_slots), plgpu.Barrier()),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((b, n_splits, rows_pad, rank), dtype),
                  jax.ShapeDtypeStruct((b, n_splits, rows_pad), jnp.float32)),
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


_SMEM_BYTES = 232448  # H100 / H200: 227 KiB per CTA


def decode_smem_bytes(width: int, block_kv: int, steps: int, p_slots: int = 2, itemsize: int = 2,
                      schedule: str = "default") -> int:
    """Shared memory `mla_decode_hopper` asks for, counted as Mosaic GPU counts it (checked by
    lowering: 238720 bytes for block_kv 64, 2 steps, 2 P slots at width 576): the queries, the
    key ring and the P slots (16-bit tiles), the fp32 row vectors (one buffer, 1 KiB aligned)
    and 8 bytes per barrier.  The alternating schedule: one P slot, five row vectors, P ready
    and free per warpgroup."""
    if schedule == "alternate":
        p_slots, n_vectors, p_barriers = 1, 5, 4
    else:
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


def mla_decode_hopper(q_latent, q_pe, latent_pages, block_tables, seq_lens, *, scale, n_splits=None, block_kv=None,
                      steps=2, p_slots=None, interpret=None, stall_ns=0, schedule="default", cluster=1):
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

    schedule "alternate" deals the key tiles' scores to both compute warpgroups in turn, each
    issuing its next Q K^T before it waits for the other's P, so a softmax runs beside the other
    warpgroup's matmuls (`mla_decode_alternating`; one P slot).  cluster 2 (heads a multiple
    of 128): the two row tiles of a query form a CTA cluster that reads each key tile once,
    multicast into both.

    stall_ns > 0 (a test's knob, never the service's) makes warpgroup 1 sleep that long between
    a P buffer's arrival and its read at every step: a release of the buffer that does not wait
    for the read then shows as a wrong answer on every run, not by chance (tests/gpu)."""
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    if stall_ns and interpret:
        raise ValueError("stall_ns is a compiled kernel's timing knob; the interpreter has no warpgroup timing")
    r, p, page = check_decode_inputs(q_latent, q_pe, latent_pages, block_tables, seq_lens)
    block_kv = block_kv or (64 if page % 64 == 0 else 32)
    if q_latent.dtype not in (jnp.bfloat16, jnp.float16) or latent_pages.dtype != q_latent.dtype:
        raise ValueError(f"q_latent and latent_pages must share a 16-bit float dtype; got {q_latent.dtype}, "
                         f"{latent_pages.dtype}")
    if r % 128 or p % 64 or block_kv not in (32, 64) or page % block_kv or steps < 2:
        raise ValueError(f"need kv_lora % 128 == 0 (got {r}), rope % 64 == 0 (got {p}), block_kv 32 or 64 "
                         f"dividing the page {page} (got {block_kv}) and steps >= 2 (got {steps})")
    # Two P slots let warpgroup 0 write the next P before warpgroup 1 is done with the last;
    # one is taken when two do not fit (block_kv 64 at kv_lora 512).
    if schedule not in DECODE_SCHEDULES:
        raise ValueError(f"schedule must be one of {DECODE_SCHEDULES}; got {schedule!r}")
    if schedule == "alternate" and p_slots not in (None, 1):
        raise ValueError(f"the alternating schedule hands P over through one slot; got p_slots={p_slots}")
    itemsize = jnp.dtype(q_latent.dtype).itemsize
    smem_bytes = {n: decode_smem_bytes(r + p, block_kv, steps, n, itemsize, schedule) for n in (1, 2)}
    if smem_bytes[1] > _SMEM_BYTES:
        raise ValueError(f"block_kv {block_kv} x {steps} steps needs {smem_bytes[1]} bytes of shared memory at "
                         f"kv_lora + rope = {r + p}; a Hopper CTA has {_SMEM_BYTES}")
    p_slots = 1 if schedule == "alternate" else p_slots or (2 if smem_bytes[2] <= _SMEM_BYTES else 1)
    b, sq, h, _ = q_latent.shape
    rows_pad = -(-sq * h // 64) * 64
    if n_splits is None:
        device = jax.devices()[0]
        sms = (getattr(device, "core_count", None) if device.platform == "gpu" else None) or 132
        n_splits = decode_splits(b * (rows_pad // 64), block_tables.shape[1] * page, block_kv, sms)
    o_part, lse_part = _decode_core(jnp.asarray(block_tables, jnp.int32), jnp.asarray(seq_lens, jnp.int32),
                                    fold_rows(q_latent, rows_pad), fold_rows(q_pe.astype(q_latent.dtype), rows_pad),
                                    latent_pages, n_heads=h, n_queries=sq, rank=r, block_kv=block_kv, steps=steps,
                                    p_slots=p_slots, n_splits=int(n_splits), scale_log2=float(scale) * _LOG2E,
                                    interpret=interpret, stall_ns=int(stall_ns), schedule=schedule,
                                    cluster=int(cluster))
    if int(n_splits) == 1:  # one split's rows are the answer: normalized, zero with no keys (`merge_splits`' values)
        return (o_part[:, 0, :sq * h].reshape(b, sq, h, r),
                lse_part[:, 0, :sq * h].reshape(b, sq, h))
    return merge_splits(o_part, lse_part, q_latent.shape, q_latent.dtype)
