"""The chunked prefill's prepare kernels, one (chunk, head) each (`chunk.py` calls them): the
intra-chunk products A_qk and A_kk with 16-token sub-block references, (I + A)^-1 by the product
formula, W and U.  "fused" (`_chunk_prepare_kernel`), "split" (`_split_intra_kernel` then
`_split_solve_kernel`, the default) and "intra_solve" (both as one program) give the same
intermediates (`TUNING["prepare_impl"]`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import CHUNK, SUB, _precise_dot


def _unit_lower_inverse(a, dot, n: int):
    """(I + a)^-1 for a [m, m] with a^n = 0 (n a power of two), e.g. strictly
    lower-triangular n x n, or block-diagonal with strictly lower n x n blocks:
    the product formula (I - a)(I + a^2)(I + a^4)...(I + a^(n/2))."""
    m = a.shape[0]
    r = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
    eye = jnp.where(r == c, 1.0, 0.0).astype(jnp.float32)
    power = -a
    inv = eye + power
    span = 2
    while span < n:
        power = dot(power, power)
        inv = dot(inv, eye + power)
        span *= 2
    return inv


def _decayed_q_k(q, k, gcum, g_end):
    """q exp(G) and k exp(G_C - G) for rows [R, K] of a chunk (G = gcum, G_C = g_end [K])."""
    return q * jnp.exp(gcum), k * jnp.exp(g_end[None, :] - gcum)


def _a_tiles(kd, qd, kr, beta_rows, row0, col0, dot):
    """Rows [R] x columns [S] tiles of A_kk (strictly causal, times beta_t) and A_qk
    (causal incl. the diagonal) from row operands kd / qd [R, K] (k, q decayed to a
    reference) and the column operand kr [S, K] (k decayed from it); row0 / col0:
    the tile's first token in the chunk.  Masking by token index is a no-op for
    tiles left of the diagonal block."""
    t = row0 + jax.lax.broadcasted_iota(jnp.int32, (kd.shape[0], kr.shape[0]), 0)
    s = col0 + jax.lax.broadcasted_iota(jnp.int32, (kd.shape[0], kr.shape[0]), 1)
    akk = jnp.where(s < t, dot(kd, kr.T), 0.0) * beta_rows[:, None]
    aqk = jnp.where(s <= t, dot(qd, kr.T), 0.0)
    return akk, aqk


def _column_operand(k, gcum, ref, row, end_row):
    """k [C, K] decayed from the reference ref [K] (G just before a row block): exp(R - G_s) <= 1
    before the block, <= exp(SUB * max|g|) inside it; rows from end_row on (past the block, where
    R - G_s could overflow) masked to 0 by an exponent of -inf.  row: the rows' index [C, K]."""
    return k * jnp.exp(jnp.where(row < end_row, ref[None, :] - gcum, -jnp.inf))


def _chunk_output(qd, aqk, s, v_new, scale, dot):
    """A chunk's output: scale (q_decayed S_before + A_qk v_new)."""
    return scale * (dot(qd, s) + dot(aqk, v_new))


def _w_rhs(k, gcum, beta):
    """beta exp(G) k [R, K]: what (I + A)^-1 maps to W."""
    return beta[:, None] * jnp.exp(gcum) * k


def _chunk_prepare_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qd_ref, ke_ref, aqk_ref, de_ref, *, interpret, algorithm
):
    """One (chunk, head): refs are [C, K] / [C, V] / [C] in, intermediates out.

    Works in 16-token sub-blocks: A's blocks (i, j <= i) are dots of row block i
    decayed relative to R_i with column block j decayed from R_i, and
    (I + A)^-1 is applied by block forward substitution whose 16 x 16 diagonal
    inverses come from the product formula.  Sub-blocks are re-read from the
    refs where needed rather than kept live, and A_qk tiles are stored as soon
    as they exist: what stays in registers is the A_kk tiles and the finished
    W / U blocks.
    """
    f32 = jnp.float32
    dot = _precise_dot(interpret, algorithm)
    n_sub = CHUNK // SUB
    rows = lambda ref, i: ref[pl.ds(i * SUB, SUB), :].astype(f32)
    base = [None] * (n_sub + 1)  # R_i = G just before sub-block i, [K]
    base[0] = jnp.zeros((g_ref.shape[-1],), f32)
    for i in range(n_sub):
        base[i + 1] = base[i] + jnp.sum(rows(g_ref, i), axis=0)
    gcum = lambda i: jnp.cumsum(rows(g_ref, i), axis=0) + base[i][None, :]  # G of sub-block i
    g_end = base[n_sub]
    de_ref[...] = jnp.exp(g_end)

    a_kk = {}
    w_blocks, u_blocks = [], []
    for i in range(n_sub):
        sl = pl.ds(i * SUB, SUB)
        g_i = gcum(i)
        k_i, q_i = rows(k_ref, i), rows(q_ref, i)
        beta_i = beta_ref[sl].astype(f32)
        qd_i, ke_i = _decayed_q_k(q_i, k_i, g_i, g_end)
        qd_ref[sl, :] = qd_i.astype(qd_ref.dtype)
        ke_ref[sl, :] = ke_i.astype(ke_ref.dtype)
        row_decay = jnp.exp(g_i - base[i][None, :])  # <= 1
        kd, qd = k_i * row_decay, q_i * row_decay
        for j in range(i + 1):
            k_j, g_j = (k_i, g_i) if j == i else (rows(k_ref, j), gcum(j))
            kr = k_j * jnp.exp(base[i][None, :] - g_j)  # <= 1 for j < i, <= exp(SUB * 5) for j == i
            a_kk[i, j], aqk = _a_tiles(kd, qd, kr, beta_i, i * SUB, j * SUB, dot)
            aqk_ref[sl, pl.ds(j * SUB, SUB)] = aqk.astype(aqk_ref.dtype)
        for j in range(i + 1, n_sub):
            aqk_ref[sl, pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)
        # W_i = T_ii (beta exp(G) k - sum_j A_ij W_j), likewise U with beta v.
        rhs_w = _w_rhs(k_i, g_i, beta_i)
        rhs_u = beta_i[:, None] * rows(v_ref, i)
        for j in range(i):
            rhs_w = rhs_w - dot(a_kk[i, j], w_blocks[j])
            rhs_u = rhs_u - dot(a_kk[i, j], u_blocks[j])
        inv = _unit_lower_inverse(a_kk[i, i], dot, SUB)
        w_blocks.append(dot(inv, rhs_w))
        u_blocks.append(dot(inv, rhs_u))
        w_ref[sl, :] = w_blocks[i].astype(w_ref.dtype)
        u_ref[sl, :] = u_blocks[i].astype(u_ref.dtype)


# ---- "split" prepare (TUNING["prepare_impl"] = "split") -----------------------------------------
#
# The same intermediates as `_chunk_prepare_kernel`, from two kernels shaped like
# fla's (chunk_intra + solve_tril + recompute_w_u), with no chain of dependent
# tiny dots:
#
# 1. `_split_intra_kernel`, grid (chunks, heads): G by one scan, q exp(G),
#    k exp(G_C - G), beta exp(G) k elementwise, and A_kk / A_qk as four full
#    [C, K] x [K, C] dots, one per 16-row block i, of which only block i's rows
#    are kept.  Rows are decayed relative to R_i = G just before their block,
#    columns from R_i with the exponent masked to -inf past block i (where
#    R_i - G_s > 0 could overflow), so as in the fused kernel every factor is
#    <= exp(16 * 5).
#    A_kk and beta exp(G) k go through HBM to kernel 2 (bf16 with bf16 dots).
# 2. `_split_solve_kernel`, grid (chunks, heads): T = (I + A)^-1 with 64 x 64
#    dots only.  Writing A = D + L (D: the 16 x 16 diagonal blocks, L: the
#    blocks below them), I + A = (I + D)(I + X L) with X = (I + D)^-1, so
#    T = (I + X L)^-1 X.  X is the product formula applied to all four diagonal
#    blocks at once (D^16 = 0); X L is strictly block-lower over 4 blocks, so
#    (I + X L)^-1 = (I - X L)(I + (X L)^2).  Then W = T (beta exp(G) k) and
#    U = T (beta v).


def _each_chunk(n_chunks: int, one):
    """one(c) for a program's chunks c < n_chunks: inline for one, else a loop (which Triton's
    pipeliner can overlap)."""
    if n_chunks == 1:
        one(0)
    else:
        jax.lax.fori_loop(0, n_chunks, lambda c, carry: (one(c), carry)[1], 0)


def _intra_loader(q_ref, k_ref, g_ref, beta_ref, rows):
    """load(name) for `_split_intra_chunk`: q, k, g [C, K] or beta [C] of the chunk at `rows`, fp32."""
    refs = dict(q=q_ref, k=k_ref, g=g_ref)
    return lambda name: (beta_ref[rows] if name == "beta" else refs[name][rows, :]).astype(jnp.float32)


def _split_intra_chunk(load, dot, store, diagonal=None):
    """One (chunk, head) of `_split_intra_kernel`: load(name) gives q, k, g [C, K] or beta [C] in
    fp32, each read where it is first needed (beta, g, then q and k: the order the kernel's PTX was
    measured in); each output goes to store(i, value) as soon as it exists (i: its place in the
    kernel's output refs), so nothing stays live past its store: held to the end, q exp(G),
    k exp(G_C - G) and beta exp(G) k spill the kernel's registers at 8 warps (ptxas).

    diagonal: None (the gate is bounded: the diagonal tiles factor like the rest), or a function
    giving the exact diagonal tiles (A_kk raw, A_qk) [C, C] fp32 (`diagonal.diagonal_call`'s, zero
    off the diagonal blocks): the dots then take only the columns before each row block, where
    every factor is <= 1 whatever the gate."""
    beta = load("beta")
    t = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    s = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    t_block = jax.lax.div(t, SUB)

    g_all = jnp.cumsum(load("g"), axis=0)  # G, [C, K]
    row = jax.lax.broadcasted_iota(jnp.int32, g_all.shape, 0)
    block = jax.lax.div(row, SUB)
    g_end = jnp.sum(jnp.where(row == CHUNK - 1, g_all, 0.0), axis=0)  # G_C, [K]
    store(3, jnp.exp(g_end))
    q, k = load("q"), load("k")
    exp_g = jnp.exp(g_all)
    store(0, q * exp_g)
    store(1, k * jnp.exp(g_end[None, :] - g_all))
    store(5, beta[:, None] * exp_g * k)
    # R_i = G just before row block i (0 for i = 0), and each row's own R.
    refs = [jnp.zeros_like(g_end)] + [
        jnp.sum(jnp.where(row == i * SUB - 1, g_all, 0.0), axis=0) for i in range(1, CHUNK // SUB)
    ]
    ref_rows = sum(jnp.where(block == i, r[None, :], 0.0) for i, r in enumerate(refs))
    row_decay = jnp.exp(g_all - ref_rows)  # exp(G_t - R_i) <= 1
    kd, qd = k * row_decay, q * row_decay
    akk = aqk = jnp.zeros((CHUNK, CHUNK), jnp.float32)
    end = (lambda i: (i + 1) * SUB) if diagonal is None else (lambda i: i * SUB)
    for i, r in enumerate(refs):  # row block i's rows of A (the causal masks come once, after)
        if end(i) == 0:
            continue  # no column before the first block: its tile is all diagonal
        kr = _column_operand(k, g_all, r, row, end(i))
        mine = t_block == i
        akk = akk + jnp.where(mine, dot(kd, kr.T), 0.0)
        aqk = aqk + jnp.where(mine, dot(qd, kr.T), 0.0)
    if diagonal is not None:
        diag_kk, diag_qk = diagonal()
        akk, aqk = akk + diag_kk, aqk + diag_qk
    store(4, jnp.where(s < t, akk, 0.0) * beta[:, None])
    store(2, jnp.where(s <= t, aqk, 0.0))


def _split_intra_kernel(*refs, interpret, algorithm, n_chunks=1, exact_diagonal=False):
    """One head's `n_chunks` chunks: q, k, g [n C, K], beta [n C] in (with exact_diagonal also the
    diagonal tiles (A_kk raw, A_qk) [n, C, C] fp32 of `diagonal.diagonal_call`); q exp(G),
    k exp(G_C - G) [n, C, K], A_qk [n, C, C], exp(G_C) [n, K] out, plus A_kk [n, C, C] (times beta,
    strictly lower) and beta exp(G) k [n, C, K] for `_split_solve_kernel`.

    Whole-chunk values only (Triton cannot slice values): one scan gives G; the
    16-row references R_i come out as masked row sums; row block i of A is the
    rows of a full [C, K] x [K, C] dot against the columns decayed from R_i,
    kept by a row-block mask.  The four full dots cost 4x the FLOPs of the
    causal tiles, but tensor cores have them to spare, while per-sub-block
    scans and ref re-reads make a kernel latency-bound.  (Measured and not used: K in column
    slices one after another, and a program per 16-row block: both fewer live arrays, both
    14-58% slower; RESULTS.md, KDA kernels.)

    With n_chunks > 1 (TUNING["intra_chunks"]) the chunks go through a loop, whose loads Triton's
    pipeliner (num_stages > 1) issues while the chunk before is computed (at 255 registers one
    program fills an SM).  Measured 2-9% slower at the kda_chunk benchmark's three shapes on an
    H100 (RESULTS.md, KDA kernels): the loads are not what the kernel waits on, so the default is 1.
    """
    dot = _precise_dot(interpret, algorithm)
    n_in = 6 if exact_diagonal else 4
    (q_ref, k_ref, g_ref, beta_ref), diag_refs, out_refs = refs[:4], refs[4:n_in], refs[n_in:]

    def one(c):
        rows = pl.ds(c * CHUNK, CHUNK)

        def store(i, x):
            out_refs[i][c] = x.astype(out_refs[i].dtype)

        diagonal = (lambda: (diag_refs[0][c], diag_refs[1][c])) if exact_diagonal else None
        _split_intra_chunk(_intra_loader(q_ref, k_ref, g_ref, beta_ref, rows), dot, store, diagonal)

    _each_chunk(n_chunks, one)


def _inverse_t(a, dot):
    """T = (I + a)^-1 [C, C] for one chunk's a = A_kk times beta (strictly lower, fp32); then
    W = T beta exp(G) k and U = T beta v."""
    r = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
    c = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
    same_block = jax.lax.div(r, SUB) == jax.lax.div(c, SUB)
    x = _unit_lower_inverse(jnp.where(same_block, a, 0.0), dot, SUB)  # (I + D)^-1
    return dot(_unit_lower_inverse(dot(x, jnp.where(same_block, 0.0, a)), dot, CHUNK // SUB), x)


def _split_solve_kernel(akk_ref, kbg_ref, v_ref, beta_ref, w_ref, u_ref, *, interpret, algorithm, n_chunks=1):
    """One head's `n_chunks` chunks (looped as in `_split_intra_kernel`): A_kk [n, C, C], beta
    exp(G) k [n, C, K], v [n C, V], beta [n C] in; W = (I + A_kk)^-1 beta exp(G) k [n, C, K] and
    U = (I + A_kk)^-1 beta v [n, C, V] out."""
    f32 = jnp.float32
    dot = _precise_dot(interpret, algorithm)

    def one(n):
        rows = pl.ds(n * CHUNK, CHUNK)
        t = _inverse_t(akk_ref[n].astype(f32), dot)
        w_ref[n] = dot(t, kbg_ref[n].astype(f32)).astype(w_ref.dtype)
        u_ref[n] = dot(t, beta_ref[rows].astype(f32)[:, None] * v_ref[rows, :].astype(f32)).astype(u_ref.dtype)

    _each_chunk(n_chunks, one)


def _intra_solve_kernel(
    q_ref,
    k_ref,
    g_ref,
    beta_ref,
    v_ref,
    qd_ref,
    ke_ref,
    aqk_ref,
    de_ref,
    w_ref,
    u_ref,
    *,
    interpret,
    algorithm,
    solve_in,
):
    """One (chunk, head), TUNING["prepare_impl"] = "intra_solve": `_split_intra_kernel` and
    `_split_solve_kernel` in one program, so A_kk and beta exp(G) k never go through HBM (nor
    beta and the launch of a second kernel).  They are rounded to `solve_in` (the split's HBM
    dtype) before the solve, so the intermediates are the split's.  Measured slower than the split
    at the kda_chunk benchmark's three shapes (its `intra_solve` variant) on an H100: the solve's
    arrays on top of the intra kernel's 255 registers spill, with one 8-warp program an SM."""
    f32 = jnp.float32
    dot = _precise_dot(interpret, algorithm)
    out_refs = (qd_ref, ke_ref, aqk_ref, de_ref)
    held = {}

    def store(i, x):
        if i < len(out_refs):
            out_refs[i][...] = x.astype(out_refs[i].dtype)
        else:  # A_kk (4) and beta exp(G) k (5): kept for the solve, in solve_in (bf16: half the
            # registers; formed after the A loop instead, ptxas finds more spills: 604 B against 212)
            held[i] = x.astype(solve_in)

    load = _intra_loader(q_ref, k_ref, g_ref, beta_ref, pl.ds(0, CHUNK))
    _split_intra_chunk(load, dot, store)
    t = _inverse_t(held[4].astype(f32), dot)
    w_ref[...] = dot(t, held[5].astype(f32)).astype(w_ref.dtype)
    u_ref[...] = dot(t, load("beta")[:, None] * v_ref[...].astype(f32)).astype(u_ref.dtype)
