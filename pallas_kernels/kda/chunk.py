"""`chunk_kda`: the chunked prefill as Pallas kernels (Triton on the GPU, the interpreter on
the CPU), varlen, with states exported at given positions in the same pass."""

# chunk_kda runs a fully parallel prepare step, then the sequential state pass:
#
# 1. The prepare step, grid (chunks, heads): by default ("split") two kernels,
#    `_split_intra_kernel` then `_split_solve_kernel` (described in `prepare.py`); or
#    one, `_chunk_prepare_kernel` ("fused"): everything in
#    `kda_chunk_prepare` for one chunk, computed in 16-token sub-blocks so no
#    exponent is ever large: for row block i with reference R_i = G just before
#    the block, exp(G_t - G_s) = exp(G_t - R_i) * exp(R_i - G_s); both factors
#    are <= 1 off the diagonal block and <= exp(16 * 5) on it (fits fp32).
#    (I + A)^-1 is applied by block forward substitution with 16x16 diagonal
#    inverses from the product formula (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8).
# 2. `_chunk_state_kernel`, grid (sequences, heads, V blocks): the sequential pass
#    over a sequence's chunks carrying the fp32 state.  It writes the outputs
#    and, when a chunk ends at a requested position, the state: checkpoint
#    export costs one extra store of the state in the same pass.
#
# Every sequence starts at a chunk boundary (varlen batches are laid out padded
# to multiples of the chunk), so chunks never straddle sequences.

from __future__ import annotations

import functools as _functools

import jax
import jax.numpy as jnp
import numpy as _np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda.common import CHUNK, _default_interpret, _fast_dot, _is_pow2
from pallas_kernels.kda.diagonal import diagonal_call
from pallas_kernels.kda.naive import _check_shapes, export_mask
from pallas_kernels.kda.prepare import (
    _chunk_output,
    _chunk_prepare_kernel,
    _intra_solve_kernel,
    _split_intra_kernel,
    _split_solve_kernel,
)


def _chunk_state_kernel(
    chunk_start_ref,
    ckpt_slot_ref,
    h0_ref,
    w_ref,
    u_ref,
    qd_ref,
    ke_ref,
    aqk_ref,
    de_ref,
    o_ref,
    ht_ref,
    ckpt_ref,
    *,
    block_v,
    scale,
    low_precision,
    interpret,
):
    """One (sequence, head, V block): the sequential pass over the sequence's chunks, o computed
    in its loop (four dots a chunk).  fla's structure instead (each chunk's state and v_new
    written, o in a parallel pass after) was 24-39% slower: the HBM round trip costs more than
    the shorter serial loop saves (RESULTS.md, KDA kernels)."""
    dot = _fast_dot(low_precision, interpret)
    seq, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * block_v, block_v)
    c0, c1 = chunk_start_ref[seq], chunk_start_ref[seq + 1]

    def body(n, s):
        v_new = u_ref[n, h, :, vs].astype(jnp.float32) - dot(w_ref[n, h], s)
        o_ref[n, :, h, vs] = _chunk_output(qd_ref[n, h], aqk_ref[n, h], s, v_new, scale, dot).astype(o_ref.dtype)
        s = de_ref[n, h][:, None] * s + dot(ke_ref[n, h].T, v_new)
        slot = ckpt_slot_ref[n]

        @pl.when(slot >= 0)
        def _export():
            ckpt_ref[slot, h, :, vs] = s

        return s

    s = jax.lax.fori_loop(c0, c1, body, h0_ref[seq, h, :, vs].astype(jnp.float32))
    ht_ref[seq, h, :, vs] = s


# (num_warps, num_stages) of the prepare and state kernels, and the prepare
# kernel's dot algorithm; tuned on H200 (the kda_chunk benchmark's variants time the others).
# prepare_dot "auto": bf16 operands for bf16/fp16 inputs (the inputs carry no more
# precision; what fla does; 2.5x faster than 3xTF32 on H200, same error against the
# fp32 recurrence as fla), 3xTF32 for fp32 inputs (fp32-level agreement).
# prepare_impl: "split" (`_split_intra_kernel` with the "intra" warps / stages, then
# `_split_solve_kernel` with the "solve" ones), "intra_solve" (both as one program,
# `_intra_solve_kernel`, "intra_solve"; the split's numbers) or "fused" (`_chunk_prepare_kernel`,
# one kernel, "prepare"); split is faster on H200 at every benchmarked shape, same error
# (RESULTS.md).  "intra" at B1 T32768 H32 on H200: 8 warps 1.85 ms, 4 warps 3.89, 16 warps
# 2.65, 8 warps x 2 stages 1.91; "solve": 4 warps 0.57 ms.
# "state_block_v": V columns per state-pass program; "auto": 64, or 32 when that leaves
# fewer than 96 programs (sequences x heads x V / 64) for 132 SMs.  H200, B1 T32768 H32
# (64 programs at 64): 3.34 ms at 32 vs 3.43 at 64, with a state exported every 128
# tokens ~0.2 vs ~0.4 ms more; B8 T4096 H32 3.03 at 64 vs 3.51; B4 T8192 H12 1.32 vs 1.54.
# "state_fp32": the state kernel for fp32 inputs, whose pipelined chunk operands
# would need ~350 KiB of shared memory at 3 stages (H200 has 227 KiB).
TUNING = {
    "prepare": (4, 1),
    "intra": (8, 1),
    "solve": (4, 1),
    "state": (4, 3),
    "state_fp32": (4, 1),
    "prepare_dot": "auto",
    "prepare_impl": "split",
    "state_block_v": "auto",
    "intra_chunks": 1,
    "solve_chunks": 1,
    "intra_solve": (8, 1),
}
PREPARE_IMPLS = ("fused", "split", "intra_solve")


def _tuned(tuning):
    return dict(TUNING, **dict(tuning or ()))


def _params(name, tuning):
    warps, stages = _tuned(tuning)[name]
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _state_block_v(n_seq: int, heads: int, dv: int, tuning) -> int:
    """V columns per state-pass program (TUNING["state_block_v"])."""
    block_v = _tuned(tuning)["state_block_v"]
    if block_v == "auto":
        block_v = 64 if n_seq * heads * dv // 64 >= 96 else 32
    return min(dv, int(block_v))


def _loop_chunks(nt: int, name: str, tuning) -> int:
    """Chunks a prepare program loops over (TUNING["intra_chunks"] / ["solve_chunks"]), halved
    until it divides nt (the chunks of every head)."""
    n = max(1, int(_tuned(tuning)[name]))
    while nt % n:
        n //= 2
    return max(n, 1)


def _looped_blocks(n_chunks: int):
    """BlockSpec makers for a (chunk group, head) grid over n_chunks chunks: in_blk(*d) takes a [T, H,
    *d] input's n C rows of one head; out_blk(*shape) an [NT, H, *shape] array's n chunks of one head."""
    in_blk = lambda *d: pl.BlockSpec((n_chunks * CHUNK, None) + d, lambda n, hh: (n, hh) + (0,) * len(d))
    out_blk = lambda *shape: pl.BlockSpec((n_chunks, None) + shape, lambda n, hh: (n, hh) + (0,) * len(shape))
    return in_blk, out_blk


def _prepare_algorithm(dtype, tuning):
    """The prepare dot algorithm after resolving "auto" for the input dtype."""
    algorithm = _tuned(tuning)["prepare_dot"]
    if algorithm == "auto":
        algorithm = "tf32x3" if dtype == jnp.float32 else "bf16"
    return algorithm


def _out_blk(*shape):  # [NT, H, *shape] chunk-major array -> one (chunk, head) block
    return pl.BlockSpec((None, None) + shape, lambda n, hh: (n, hh) + (0,) * len(shape))


def _chunk_prepare_call(q, k, v, g, beta, *, interpret, tuning=None, gate_bounded=True):
    """[T, H, D] inputs (T a multiple of CHUNK) -> per-chunk intermediates [NT, H, ...]:
    (w [NT, H, C, K], u [NT, H, C, V], q_decayed [NT, H, C, K], k_to_end [NT, H, C, K],
    a_qk [NT, H, C, C] in the inputs' dtype (fp32 for fp32), decay_end [NT, H, K] fp32).
    gate_bounded=False: any g <= 0, by the split prepare with exact diagonal tiles
    (`diagonal.py`); the other prepare implementations take bounded gates only."""
    impl = _tuned(tuning)["prepare_impl"]
    if not gate_bounded:
        if impl != "split":
            raise ValueError(f"an unbounded gate needs prepare_impl 'split' (exact diagonal tiles); got {impl!r}")
        return _split_prepare_call(q, k, v, g, beta, interpret=interpret, tuning=tuning, exact_diagonal=True)
    if impl == "split":
        return _split_prepare_call(q, k, v, g, beta, interpret=interpret, tuning=tuning)
    if impl == "intra_solve":
        return _intra_solve_call(q, k, v, g, beta, interpret=interpret, tuning=tuning)
    if impl != "fused":
        raise ValueError(f"prepare_impl must be one of {PREPARE_IMPLS}; got {impl!r}")
    t, h, dk = q.shape
    dv = v.shape[-1]
    nt = t // CHUNK
    inter = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    in_blk, _ = _looped_blocks(1)  # one chunk of one head: [C, d] / [C]
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        _functools.partial(_chunk_prepare_kernel, interpret=interpret, algorithm=_prepare_algorithm(q.dtype, tuning)),
        grid=(nt, h),
        in_specs=[in_blk(dk), in_blk(dk), in_blk(dv), in_blk(dk), in_blk()],
        out_specs=[
            _out_blk(CHUNK, dk),
            _out_blk(CHUNK, dv),
            _out_blk(CHUNK, dk),
            _out_blk(CHUNK, dk),
            _out_blk(CHUNK, CHUNK),
            _out_blk(dk),
        ],
        out_shape=[
            sds((nt, h, CHUNK, dk), inter),
            sds((nt, h, CHUNK, dv), inter),
            sds((nt, h, CHUNK, dk), inter),
            sds((nt, h, CHUNK, dk), inter),
            sds((nt, h, CHUNK, CHUNK), inter),
            sds((nt, h, dk), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_params("prepare", tuning),
        name="kda_chunk_prepare",
    )(q, k, v, g, beta)


def _split_intra_call(q, k, g, beta, *, interpret, tuning=None, exact_diagonal=False):
    """Kernel 1 of the split prepare.  [T, H, K] q / k / g, [T, H] beta ->
    (q_decayed, k_to_end, a_qk, decay_end) as `_chunk_prepare_call` returns them,
    plus a_kk [NT, H, C, C] and beta exp(G) k [NT, H, C, K].  Those two are bf16
    when the dots take bf16 operands anyway (half the HBM round trip), else fp32.
    exact_diagonal: the diagonal tiles come from `diagonal.diagonal_call` (any gate <= 0)."""
    t, h, dk = q.shape
    nt = t // CHUNK
    inter = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    algorithm = _prepare_algorithm(q.dtype, tuning)
    solve_in = jnp.bfloat16 if algorithm == "bf16" else jnp.float32
    n_chunks = _loop_chunks(nt, "intra_chunks", tuning)
    sds = jax.ShapeDtypeStruct
    out_shape = [
        sds((nt, h, CHUNK, dk), inter),
        sds((nt, h, CHUNK, dk), inter),
        sds((nt, h, CHUNK, CHUNK), inter),
        sds((nt, h, dk), jnp.float32),
        sds((nt, h, CHUNK, CHUNK), solve_in),
        sds((nt, h, CHUNK, dk), solve_in),
    ]
    in_blk, out_blk = _looped_blocks(n_chunks)
    diag = diagonal_call(q, k, g, interpret=interpret) if exact_diagonal else ()
    return pl.pallas_call(
        _functools.partial(
            _split_intra_kernel,
            interpret=interpret,
            algorithm=algorithm,
            n_chunks=n_chunks,
            exact_diagonal=exact_diagonal,
        ),
        grid=(nt // n_chunks, h),
        in_specs=[in_blk(dk), in_blk(dk), in_blk(dk), in_blk()] + [out_blk(CHUNK, CHUNK)] * len(diag),
        out_specs=[
            out_blk(CHUNK, dk),
            out_blk(CHUNK, dk),
            out_blk(CHUNK, CHUNK),
            out_blk(dk),
            out_blk(CHUNK, CHUNK),
            out_blk(CHUNK, dk),
        ],
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_params("intra", tuning),
        name="kda_split_intra",
    )(q, k, g, beta, *diag)


def _split_solve_call(akk, kbg, v, beta, *, interpret, tuning=None, in_dtype=None):
    """Kernel 2 of the split prepare.  a_kk [NT, H, C, C], beta exp(G) k [NT, H, C, K],
    v [T, H, V], beta [T, H] -> (w [NT, H, C, K], u [NT, H, C, V]) in `in_dtype` (q's
    dtype, which picks the dot algorithm as in kernel 1; default v's)."""
    nt, h, _, dk = kbg.shape
    dv = v.shape[-1]
    in_dtype = v.dtype if in_dtype is None else in_dtype
    inter = jnp.float32 if in_dtype == jnp.float32 else in_dtype
    n_chunks = _loop_chunks(nt, "solve_chunks", tuning)
    sds = jax.ShapeDtypeStruct
    in_blk, out_blk = _looped_blocks(n_chunks)
    return pl.pallas_call(
        _functools.partial(
            _split_solve_kernel, interpret=interpret, algorithm=_prepare_algorithm(in_dtype, tuning), n_chunks=n_chunks
        ),
        grid=(nt // n_chunks, h),
        in_specs=[out_blk(CHUNK, CHUNK), out_blk(CHUNK, dk), in_blk(dv), in_blk()],
        out_specs=[out_blk(CHUNK, dk), out_blk(CHUNK, dv)],
        out_shape=[sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, dv), inter)],
        interpret=interpret,
        compiler_params=_params("solve", tuning),
        name="kda_split_solve",
    )(akk, kbg, v, beta)


def _intra_solve_call(q, k, v, g, beta, *, interpret, tuning=None):
    """`_chunk_prepare_call` by one kernel, `_intra_solve_kernel`: the split's intermediates."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    nt = t // CHUNK
    inter = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    algorithm = _prepare_algorithm(q.dtype, tuning)
    solve_in = jnp.bfloat16 if algorithm == "bf16" else jnp.float32
    in_blk, _ = _looped_blocks(1)
    sds = jax.ShapeDtypeStruct
    qd, ke, aqk, de, w, u = pl.pallas_call(
        _functools.partial(_intra_solve_kernel, interpret=interpret, algorithm=algorithm, solve_in=solve_in),
        grid=(nt, h),
        in_specs=[in_blk(dk), in_blk(dk), in_blk(dk), in_blk(), in_blk(dv)],
        out_specs=[
            _out_blk(CHUNK, dk),
            _out_blk(CHUNK, dk),
            _out_blk(CHUNK, CHUNK),
            _out_blk(dk),
            _out_blk(CHUNK, dk),
            _out_blk(CHUNK, dv),
        ],
        out_shape=[
            sds((nt, h, CHUNK, dk), inter),
            sds((nt, h, CHUNK, dk), inter),
            sds((nt, h, CHUNK, CHUNK), inter),
            sds((nt, h, dk), jnp.float32),
            sds((nt, h, CHUNK, dk), inter),
            sds((nt, h, CHUNK, dv), inter),
        ],
        interpret=interpret,
        compiler_params=_params("intra_solve", tuning),
        name="kda_intra_solve",
    )(q, k, g, beta, v)
    return w, u, qd, ke, aqk, de


def _split_prepare_call(q, k, v, g, beta, *, interpret, tuning=None, exact_diagonal=False):
    """`_chunk_prepare_call` by the split kernels: the same intermediates."""
    qd, ke, aqk, de, akk, kbg = _split_intra_call(
        q, k, g, beta, interpret=interpret, tuning=tuning, exact_diagonal=exact_diagonal
    )
    w, u = _split_solve_call(akk, kbg, v, beta, interpret=interpret, tuning=tuning, in_dtype=q.dtype)
    return w, u, qd, ke, aqk, de


def _chunk_state_call(prep, h0, chunk_start, ckpt_slot, *, out_dtype, n_ckpt, scale, block_v, interpret, tuning=None):
    """The sequential pass.  Returns o [NT, C, H, V], ht [N, H, K, V], checkpoints
    [max(n_ckpt, 1), H, K, V]."""
    w, u, qd, ke, aqk, de = prep
    nt, h, _, dk = w.shape
    dv = u.shape[-1]
    n_seq = h0.shape[0]
    sds = jax.ShapeDtypeStruct
    low_precision = bool(w.dtype != jnp.float32)
    return pl.pallas_call(
        _functools.partial(
            _chunk_state_kernel, block_v=block_v, scale=scale, low_precision=low_precision, interpret=interpret
        ),
        grid=(n_seq, h, dv // block_v),
        out_shape=[
            sds((nt, CHUNK, h, dv), out_dtype),
            sds((n_seq, h, dk, dv), jnp.float32),
            sds((max(n_ckpt, 1), h, dk, dv), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_params("state_fp32" if w.dtype == jnp.float32 else "state", tuning),
        name="kda_chunk_state",
    )(chunk_start, ckpt_slot, h0, w, u, qd, ke, aqk, de)


@_functools.partial(jax.jit, static_argnames=("n_ckpt", "scale", "block_v", "interpret", "tuning", "gate_bounded"))
def _chunk_kda_core(
    q, k, v, g, beta, h0, chunk_start, ckpt_slot, *, n_ckpt, scale, block_v, interpret, tuning=None, gate_bounded=True
):
    """q/k/g [1, T, H, K], v [1, T, H, V], beta [1, T, H] with T a multiple of CHUNK and
    sequences starting at chunk boundaries.  Returns o [1, T, H, V], ht [N, H, K, V],
    checkpoints [max(n_ckpt, 1), H, K, V]."""
    _, t, h, _ = q.shape
    prep = _chunk_prepare_call(
        q[0], k[0], v[0], g[0], beta[0], interpret=interpret, tuning=tuning, gate_bounded=gate_bounded
    )
    o, ht, ckpt = _chunk_state_call(
        prep,
        h0,
        chunk_start,
        ckpt_slot,
        out_dtype=v.dtype,
        n_ckpt=n_ckpt,
        scale=scale,
        block_v=block_v,
        interpret=interpret,
        tuning=tuning,
    )
    return o.reshape(1, t, h, v.shape[-1]), ht, ckpt


def _plan_layout(seq_lens, checkpoint_positions):
    """Host-side plan: where each sequence's chunks start in the padded layout,
    and which chunk ends export to which checkpoint slot."""
    seq_lens = [int(x) for x in seq_lens]
    n_chunks = [-(-n // CHUNK) for n in seq_lens]
    chunk_start = _np.concatenate([[0], _np.cumsum(n_chunks)]).astype(_np.int32)
    ckpt_slot = _np.full(max(int(chunk_start[-1]), 1), -1, _np.int32)
    slot = 0
    for i, positions in enumerate(checkpoint_positions):
        for p in positions:
            p = int(p)
            if p <= 0 or p % CHUNK:
                raise ValueError(f"checkpoint position {p} must be a positive multiple of {CHUNK}")
            if p > seq_lens[i]:
                raise ValueError(f"checkpoint position {p} is beyond sequence {i}'s {seq_lens[i]} tokens")
            ckpt_slot[chunk_start[i] + p // CHUNK - 1] = slot
            slot += 1
    return chunk_start, ckpt_slot, slot


def _sequence_lists(t, b, cu_seqlens, checkpoint_positions):
    """Each sequence's length and checkpoint positions: B rows of T tokens sharing one position
    list without `cu_seqlens`; with it (B == 1, concrete int [N + 1] cumulative lengths) N packed
    sequences, one list each.  Returns (seq_lens [N] ints, per-sequence position lists)."""
    if cu_seqlens is None:
        return [t] * b, [list(checkpoint_positions or [])] * b
    if b != 1:
        raise ValueError(f"with cu_seqlens the batch dim must be 1 (sequences packed in T); got B={b}")
    cu = _np.asarray(cu_seqlens).astype(_np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != t or _np.any(_np.diff(cu) <= 0):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T={t}; got {cu.tolist()}")
    seq_lens = _np.diff(cu).tolist()
    if checkpoint_positions is None:
        return seq_lens, [[] for _ in seq_lens]
    per_seq_positions = [list(p) for p in checkpoint_positions]
    if len(per_seq_positions) != len(seq_lens):
        raise ValueError(
            f"with cu_seqlens give one list of checkpoint positions per sequence "
            f"({len(seq_lens)}); got {len(per_seq_positions)}"
        )
    return seq_lens, per_seq_positions


def _checked_initial_state(initial_state, n_seq, h, dk, dv):
    """initial_state float32 [N, H, K, V] as given (checked), or zeros of that shape for None."""
    if initial_state is None:
        return jnp.zeros((n_seq, h, dk, dv), jnp.float32)
    if initial_state.shape != (n_seq, h, dk, dv) or initial_state.dtype != jnp.float32:
        raise ValueError(
            f"initial_state must be float32 [{n_seq}, {h}, {dk}, {dv}]; "
            f"got {initial_state.dtype} {tuple(initial_state.shape)}"
        )
    return initial_state


def _traced_checkpoint_slots(export_at, t, b, chunk_start, ckpt_slot):
    """The checkpoint plan for traced positions export_at int32 [E] (every row's, no packing):
    returns (export_valid bool [E], ckpt_slot int32 [n_chunks] with row r's e-th export at slot
    r * E + e, and -1 elsewhere, n_ckpt = B * E).  Invalid positions (`export_mask`) name no
    chunk, so their slots stay unwritten and the caller zeros them."""
    e = export_at.shape[0]
    export_valid = export_mask(export_at, t, CHUNK)
    chunk_of = jnp.asarray(chunk_start[:-1])[:, None] + export_at[None, :] // CHUNK - 1  # [B, E]
    chunk_of = jnp.where(export_valid[None, :], chunk_of, ckpt_slot.shape[0])  # invalid: dropped
    ckpt_slot = jnp.asarray(ckpt_slot).at[chunk_of].set(jnp.arange(b * e, dtype=jnp.int32).reshape(b, e), mode="drop")
    return export_valid, ckpt_slot, b * e


def _chunk_layout_maps(b, t, h, dv, seq_lens, chunk_start, packed):
    """(flat, unflat): flat maps a [B, T, ...] input to [1, padded_len, ...] with every sequence
    starting on a chunk boundary and zeros in its tail (zero k/v/g/beta leave the state
    unchanged); unflat maps the kernel's [1, padded_len, H, V] output back to [B, T, H, V].
    Unpacked rows already whole chunks long need only a reshape."""
    if not packed and t % CHUNK == 0:
        flat = lambda x: x.reshape((1, b * t) + x.shape[2:])
        unflat = lambda o: o.reshape(b, t, h, dv)
        return flat, unflat
    padded_len = int(chunk_start[-1]) * CHUNK
    starts = _np.concatenate([[0], _np.cumsum(seq_lens)])
    src = _np.full(padded_len, -1, _np.int64)
    for i, n in enumerate(seq_lens):
        src[chunk_start[i] * CHUNK : chunk_start[i] * CHUNK + n] = starts[i] + _np.arange(n)
    valid = jnp.asarray(src >= 0)
    gather_idx = jnp.asarray(_np.maximum(src, 0))
    dst = jnp.asarray(_np.flatnonzero(src >= 0))

    def flat(x):
        x = x.reshape((b * t,) + x.shape[2:])[gather_idx]
        return jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)[None]

    unflat = lambda o: o[0][dst].reshape(b, t, h, dv)
    return flat, unflat


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    checkpoint_positions=None,
    cu_seqlens=None,
    interpret=None,
    block_v=None,
    tuning=None,
    export_at=None,
    gate_bounded=True,
):
    """Chunked KDA prefill (Pallas) exporting states at `checkpoint_positions` in the same pass.

    Args:
      q, k: [B, T, H, K] (L2-normalized), v: [B, T, H, V], g: [B, T, H, K] log
        decay (fp32 recommended), beta: [B, T, H]; bf16 or fp32.  K and V must
        be powers of two >= 16.
      scale: default K ** -0.5.
      initial_state: [N, H, K, V] float32 (N = B, or the number of sequences
        with `cu_seqlens`), or None for zeros.
      output_final_state: return the state after each sequence.
      checkpoint_positions: token counts (positive multiples of 64, at most the
        sequence length) after which to export the state.  Without
        `cu_seqlens`: one list for every sequence; with it: one list per sequence.
      cu_seqlens: int [N + 1] cumulative lengths of N sequences packed into
        T with B == 1 (concrete values: the layout is planned on the host).
      export_at: int32 [E], the traced form of checkpoint_positions (one list for
        every sequence, no cu_seqlens): positions known only on the device, one
        compiled program for any values.  Entries that are not positive multiples
        of 64 within T (`export_mask`) export zeros.
      gate_bounded: every g >= -5 (Kimi-K3's bounded gate), which the prepare's factored 16-token
        diagonal tiles need (exp(16 * 5) is finite).  False: any g <= 0 (Kimi-Linear's softplus
        gate), the diagonal tiles computed exactly (`diagonal.py`), at 16 more exps per token per
        key channel.
    Returns:
      (o [B, T, H, V] in v's dtype,
       final_state [N, H, K, V] fp32 or None,
       checkpoints fp32 or None: [B, P, H, K, V] without `cu_seqlens`,
         [sum P_i, H, K, V] in sequence order with it).
    """
    _check_shapes(q, k, v, g, beta, None)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if not (_is_pow2(dk) and _is_pow2(dv) and dk >= 16 and dv >= 16):
        raise ValueError(f"head dims must be powers of two >= 16; got K={dk}, V={dv}")
    seq_lens, per_seq_positions = _sequence_lists(t, b, cu_seqlens, checkpoint_positions)
    n_seq = len(seq_lens)
    initial_state = _checked_initial_state(initial_state, n_seq, h, dk, dv)
    chunk_start, ckpt_slot, n_ckpt = _plan_layout(seq_lens, per_seq_positions)
    if export_at is not None:
        if cu_seqlens is not None or checkpoint_positions is not None:
            raise ValueError("export_at takes neither cu_seqlens nor checkpoint_positions")
        export_valid, ckpt_slot, n_ckpt = _traced_checkpoint_slots(export_at, t, b, chunk_start, ckpt_slot)
    interpret = _default_interpret() if interpret is None else interpret
    block_v = block_v or _state_block_v(n_seq, h, dv, tuning)
    scale = float(dk**-0.5 if scale is None else scale)
    flat, unflat = _chunk_layout_maps(b, t, h, dv, seq_lens, chunk_start, packed=cu_seqlens is not None)

    o, ht, ckpt = _chunk_kda_core(
        flat(q),
        flat(k),
        flat(v),
        flat(g.astype(jnp.float32)),
        flat(beta),
        initial_state,
        jnp.asarray(chunk_start),
        jnp.asarray(ckpt_slot),
        n_ckpt=n_ckpt,
        scale=scale,
        block_v=block_v,
        interpret=interpret,
        tuning=tuple(sorted(dict(tuning or {}).items())) or None,
        gate_bounded=bool(gate_bounded),
    )
    o = unflat(o)
    checkpoints = None
    if export_at is not None:
        checkpoints = jnp.where(export_valid[None, :, None, None, None], ckpt[:n_ckpt].reshape(b, -1, h, dk, dv), 0.0)
    elif checkpoint_positions is not None:
        checkpoints = ckpt[:n_ckpt]
        if cu_seqlens is None:
            checkpoints = checkpoints.reshape(b, -1, h, dk, dv)
    return o, (ht if output_final_state else None), checkpoints
