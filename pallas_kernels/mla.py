"""MLA kernels over the latent cache, and their pure-jnp references.

Latent pages hold, per token, ``c_kv ++ k_pe`` ([kv_lora + rope] values);
`block_tables[b, i]` is the page holding tokens ``[i * page, (i + 1) * page)``
of sequence b.  Conventions follow FlashMLA: heads x query tokens fold into
rows, so speculative verification (Sq > 1) is one launch.

* `mla_decode`: absorbed-form paged attention (one latent KV head; key dim
  kv_lora + rope, value dim kv_lora), split-KV with an LSE merge.
* `mla_prefill`: naive-form causal flash attention over new tokens plus a
  cached prefix read from latent pages (expanded through W_UK / W_UV).
* `write_latent`: new tokens' latents into their pages, in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dots
from pallas_kernels.attention import attend
from pallas_kernels.mla_forms import expand_heads, latent_attention  # noqa: F401 (expand_heads re-exported)


def _default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def gather_pages(latent_pages, block_tables):
    """[num_pages, page, D] pages, [B, max_pages] table -> contiguous [B, max_pages * page, D]."""
    b, n = block_tables.shape
    return latent_pages[block_tables].reshape(b, n * latent_pages.shape[1], latent_pages.shape[2])


# ---- decode ------------------------------------------------------------------------------------


def mla_decode_ref(q_latent, q_pe, latent_pages, block_tables, seq_lens, *, scale):
    """Reference: gather the pages, attend with the shared attention math.  Same contract as `mla_decode`."""
    sq = q_latent.shape[1]
    kv = gather_pages(latent_pages, block_tables)
    q_pos = seq_lens[:, None] - sq + jnp.arange(sq)[None]
    k_pos = jnp.broadcast_to(jnp.arange(kv.shape[1])[None], kv.shape[:2])
    return latent_attention(q_latent, q_pe, kv, scale=scale, q_pos_bt=q_pos, k_pos_bs=k_pos, return_lse=True)


def visible_keys(seq_len, n_queries: int, n_heads: int, last_row):
    """Keys a block of folded rows (heads x queries, query-major) can see at all: those before
    its last row's query's position + 1 (row r is query r // n_heads; padding rows, past the
    last query, see the whole sequence).  A long chunk's early row blocks skip its later keys."""
    return jnp.minimum(seq_len, seq_len - n_queries + last_row // n_heads + 1)


def _decode_kernel(
    bt_ref,
    len_ref,
    ql_ref,
    qp_ref,
    pages_ref,
    o_ref,
    lse_ref,
    *,
    n_heads,
    n_queries,
    rank,
    block_m,
    block_k,
    block_v,
    page,
    n_splits,
    scale,
    precision,
):
    """One (sequence, split, row block, value block): online softmax over this split's key
    blocks.  Scores use the whole latent (kv_lora + rope); the output accumulates only value
    columns [vb * block_v, (vb + 1) * block_v) of the latent (FlashMLA splits the 512 value
    columns over two warpgroups the same way), so a 64-row block keeps its fp32 accumulator
    in registers; every value block recomputes the same scores."""
    f32 = jnp.float32
    b, split, mb, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    rows = mb * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    seq_len = len_ref[b]
    limit = seq_len - n_queries + rows // n_heads + 1  # keys < limit are visible to each row
    q_lat = ql_ref[b, pl.ds(mb * block_m, block_m), :]
    q_pe = qp_ref[b, pl.ds(mb * block_m, block_m), :]
    n_blocks = (visible_keys(seq_len, n_queries, n_heads, mb * block_m + block_m - 1) + block_k - 1) // block_k
    per_split = (n_blocks + n_splits - 1) // n_splits
    kb0 = split * per_split
    kb1 = jnp.minimum(n_blocks, kb0 + per_split)

    def body(kb, carry):
        m, l, acc = carry
        pos0 = kb * block_k
        pg = bt_ref[b, pos0 // page]
        keys = pl.ds(pos0 % page, block_k)
        c = pages_ref[pg, keys, pl.ds(0, rank)]
        k_pe = pages_ref[pg, keys, pl.ds(rank, qp_ref.shape[-1])]
        s = (
            jnp.dot(q_lat, c.T, preferred_element_type=f32, precision=precision)
            + jnp.dot(q_pe, k_pe.T, preferred_element_type=f32, precision=precision)
        ) * scale
        k_pos = pos0 + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        s = jnp.where(k_pos[None, :] < limit[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        l = l * alpha + jnp.sum(p, axis=1)
        c_v = c if block_v == rank else pages_ref[pg, keys, pl.ds(vb * block_v, block_v)]
        acc = acc * alpha[:, None] + jnp.dot(p.astype(c.dtype), c_v, preferred_element_type=f32, precision=precision)
        return m_new, l, acc

    init = (jnp.full((block_m,), -jnp.inf, f32), jnp.zeros((block_m,), f32), jnp.zeros((block_m, block_v), f32))
    m, l, acc = jax.lax.fori_loop(kb0, kb1, body, init)
    has = l > 0
    o_ref[b, split, pl.ds(mb * block_m, block_m), pl.ds(vb * block_v, block_v)] = jnp.where(
        has[:, None], acc / jnp.where(has, l, 1.0)[:, None], 0.0
    )

    # every value block computed the same softmax statistics: value block 0 stores them
    @pl.when(vb == 0)
    def _():
        lse_ref[b, split, pl.ds(mb * block_m, block_m)] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "n_splits", "block_m", "block_k", "block_v", "interpret", "num_warps", "num_stages"),
)
def _mla_decode_core(
    q_latent,
    q_pe,
    latent_pages,
    block_tables,
    seq_lens,
    *,
    scale,
    n_splits,
    block_m,
    block_k,
    block_v,
    interpret,
    num_warps,
    num_stages,
):
    b, sq, h, r = q_latent.shape
    rows = sq * h
    rows_pad = -(-rows // block_m) * block_m
    fold = functools.partial(fold_rows, rows_pad=rows_pad)
    o_part, lse_part = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            n_heads=h,
            n_queries=sq,
            rank=r,
            block_m=block_m,
            block_k=block_k,
            block_v=block_v,
            page=latent_pages.shape[1],
            n_splits=n_splits,
            scale=scale,
            precision=_dot_precision(latent_pages.dtype, interpret),
        ),
        grid=(b, n_splits, rows_pad // block_m, r // block_v),
        out_shape=[
            jax.ShapeDtypeStruct((b, n_splits, rows_pad, r), jnp.float32),
            jax.ShapeDtypeStruct((b, n_splits, rows_pad), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="mla_decode",
    )(block_tables, seq_lens, fold(q_latent), fold(q_pe.astype(q_latent.dtype)), latent_pages)
    return merge_splits(o_part, lse_part, q_latent.shape, q_latent.dtype)


def fold_rows(x, rows_pad: int):
    """[B, Sq, H, D] -> [B, rows_pad, D]: heads x query tokens as rows (zero rows past Sq * H)."""
    b, sq, h, d = x.shape
    return jnp.pad(x.reshape(b, sq * h, d), ((0, 0), (0, rows_pad - sq * h), (0, 0)))


def merge_splits_ref(o_part, lse_part, shape, dtype):
    """Split-KV partials o [B, S, rows_pad, r] (each normalized over its own keys), lse [B, S,
    rows_pad] -> o [B, Sq, H, r] in `dtype` and lse [B, Sq, H] (shape = q_latent's), as
    o = sum_s exp(lse_s - lse) o_s."""
    b, sq, h, r = shape
    lse = jax.nn.logsumexp(lse_part, axis=1)  # [B, rows_pad]
    weights = jnp.exp(lse_part - jnp.where(jnp.isfinite(lse), lse, 0.0)[:, None])
    o = jnp.sum(weights[..., None] * o_part.astype(jnp.float32), axis=1)
    return o[:, : sq * h].reshape(b, sq, h, r).astype(dtype), lse[:, : sq * h].reshape(b, sq, h)


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, n_splits):
    """Program (b, row block, value block): the splits' partials folded in one pass, as the
    decode kernel folds key blocks (running max, rescaled sum)."""
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bv = out_ref.shape
    m = jnp.full((bm,), -jnp.inf, jnp.float32)
    l = jnp.zeros((bm,), jnp.float32)
    acc = jnp.zeros((bm, bv), jnp.float32)
    for s in range(n_splits):  # a handful of splits: unrolled
        ls = lse_ref[b, s, pl.ds(i * bm, bm)]
        m_new = jnp.maximum(m, ls)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha, w = jnp.exp(m - m_safe), jnp.exp(ls - m_safe)
        l = l * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_ref[b, s, pl.ds(i * bm, bm), pl.ds(j * bv, bv)]
        m = m_new
    has = l > 0
    out_ref[...] = jnp.where(has[:, None], acc / jnp.where(has, l, 1.0)[:, None], 0.0).astype(out_ref.dtype)

    @pl.when(j == 0)
    def _():
        lse_out_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


_MERGE_ROWS, _MERGE_VALUES = 16, 128


# kernel=None's choice on a GPU backend (its GPU check and A/B: RESULTS.md).
MERGE_KERNEL_ON_GPU = True


def merge_splits(o_part, lse_part, shape, dtype, *, kernel=None, interpret=None):
    """`merge_splits_ref` (its arguments and results) in one kernel, where XLA's logsumexp and
    weighted sum took three launches a layer.  kernel: None runs it on a GPU backend when
    `MERGE_KERNEL_ON_GPU` (the reference elsewhere: the same math, no interpreter in CPU runs);
    True runs it anywhere (interpreted off the GPU unless interpret=False, for tests); False the
    reference."""
    b, sq, h, r = shape
    n_splits, rows_pad = o_part.shape[1], o_part.shape[2]
    on_gpu = jax.default_backend() == "gpu" and MERGE_KERNEL_ON_GPU
    if not (on_gpu if kernel is None else kernel) or rows_pad % _MERGE_ROWS or r % _MERGE_VALUES:
        return merge_splits_ref(o_part, lse_part, shape, dtype)
    o, lse = pl.pallas_call(
        functools.partial(_merge_kernel, n_splits=n_splits),
        grid=(b, rows_pad // _MERGE_ROWS, r // _MERGE_VALUES),
        out_specs=[
            pl.BlockSpec((None, _MERGE_ROWS, _MERGE_VALUES), lambda bb, i, j: (bb, i, j)),
            pl.BlockSpec((None, _MERGE_ROWS), lambda bb, i, j: (bb, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, rows_pad, r), dtype), jax.ShapeDtypeStruct((b, rows_pad), jnp.float32)],
        interpret=(not on_gpu) if interpret is None else interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="mla_merge_splits",
    )(o_part, lse_part)
    return o[:, : sq * h].reshape(b, sq, h, r), lse[:, : sq * h].reshape(b, sq, h)


def check_decode_inputs(q_latent, q_pe, latent_pages, block_tables, seq_lens):
    """The decode kernels' input checks, before any launch (table contents and lengths when
    concrete).  Returns (kv_lora, rope, page)."""
    b, sq, h, r = q_latent.shape
    if q_pe.shape[:3] != (b, sq, h):
        raise ValueError(f"q_pe must be [B, Sq, H, rope] = [{b}, {sq}, {h}, rope]; got {tuple(q_pe.shape)}")
    p = q_pe.shape[-1]
    if latent_pages.ndim != 3 or latent_pages.shape[2] != r + p:
        raise ValueError(
            f"latent_pages must be [num_pages, page, kv_lora + rope = {r + p}]; got {tuple(latent_pages.shape)}"
        )
    page = latent_pages.shape[1]
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B={b}, max_pages]; got {tuple(block_tables.shape)}")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must be [B={b}]; got {tuple(seq_lens.shape)}")
    if _concrete(seq_lens) and _concrete(block_tables):
        lens, table = np.asarray(seq_lens), np.asarray(block_tables)
        if lens.min() < sq or lens.max() > table.shape[1] * page:
            raise ValueError(
                f"seq_lens must lie in [Sq={sq}, max_pages * page = {table.shape[1] * page}]; got {lens.tolist()}"
            )
        used = np.arange(table.shape[1])[None, :] * page < lens[:, None]
        if (table[used] < 0).any() or (table[used] >= latent_pages.shape[0]).any():
            raise ValueError(f"block_tables hold page indices outside [0, {latent_pages.shape[0]})")
    return r, p, page


SMEM_BYTES = 232_448  # shared memory per block on H100 / H200 (227 KiB)


def decode_smem_bytes(block_m: int, block_k: int, num_stages: int, width: int, itemsize: int) -> int:
    """Shared memory of one decode program: `num_stages` key tiles [block_k, width] and the
    queries [block_m, width] (width = kv_lora + rope), plus 1 KiB of Triton's own: an
    upper estimate (the fp32 overflow it was fitted to came from the prefill kernel,
    `prefill_smem_bytes`); tests/gpu/test_fp32_kernels.py runs the fp32 blockings it picks."""
    return (num_stages * block_k + block_m) * width * itemsize + 1024


def _decode_blocking(rows: int, width: int = 576, itemsize: int = 2, num_stages: int = 2):
    """(block_m, block_k, num_warps) by rows = heads x query tokens, from H200 runs
    (RESULTS.md): 16-row blocks for few rows (H16); 64-row blocks with 32-key steps and
    8 warps once there are 64 rows to fill them (H96 B16 ctx8k: 0.262 vs 0.337 ms).  Wider
    elements (fp32) halve the rows, then the keys, until the tiles fit `SMEM_BYTES`."""
    block_m, block_k, warps = (64, 32, 8) if rows >= 64 else (16, 64, 4)
    while decode_smem_bytes(block_m, block_k, num_stages, width, itemsize) > SMEM_BYTES:
        if block_m > 16:
            block_m //= 2
        elif block_k > 16:
            block_k //= 2
        else:
            break  # the caller's check names the shape
    return block_m, block_k, warps


def mla_decode(
    q_latent,
    q_pe,
    latent_pages,
    block_tables,
    seq_lens,
    *,
    scale,
    n_splits=None,
    block_m=None,
    block_k=None,
    block_v=None,
    interpret=None,
    num_warps=None,
    num_stages=2,
):
    """Paged absorbed MLA decode.

    Args:
      q_latent: [B, Sq, H, kv_lora] queries already multiplied by W_UK.
      q_pe: [B, Sq, H, rope].
      latent_pages: [num_pages, page_size, kv_lora + rope] (c_kv then k_pe).
      block_tables: int32 [B, max_pages], any (non-contiguous) pages.
      seq_lens: int32 [B], cached tokens including the Sq new ones; query i
        sees positions < seq_len - Sq + i + 1.
      scale: softmax scale.
      n_splits: KV splits per sequence (default: enough to fill the GPU for small B).
      block_m / block_k / block_v / num_warps / num_stages: rows (heads x queries) per
        program, keys per step, value columns per program (default all kv_lora; a power
        of two dividing it), warps, pipeline stages; None picks by heads x queries
        (`_decode_blocking`, which shrinks blocks for fp32).  Shared memory holds num_stages
        key tiles of block_k x (kv_lora + rope) plus the queries (`decode_smem_bytes`):
        a choice over the H200's 227 KiB is refused before any launch.
    Returns:
      o_latent [B, Sq, H, kv_lora] in q_latent's dtype, lse fp32 [B, Sq, H].
    Raises:
      ValueError before any launch for wrong dims, page indices out of range,
      or seq_lens beyond the table.
    """
    b, sq, h, r = q_latent.shape
    r, p, page = check_decode_inputs(q_latent, q_pe, latent_pages, block_tables, seq_lens)
    if not (_is_pow2(r) and _is_pow2(p) and r >= 16 and p >= 16):
        raise ValueError(f"kv_lora and rope dims must be powers of two >= 16; got {r}, {p}")
    itemsize = jnp.dtype(latent_pages.dtype).itemsize
    auto_m, auto_k, auto_warps = _decode_blocking(sq * h, r + p, itemsize, num_stages)
    block_m, num_warps = block_m or auto_m, num_warps or auto_warps
    block_k = min(block_k or auto_k, page)
    if page % block_k:
        raise ValueError(f"page size {page} must be a multiple of block_k {block_k}")
    smem = decode_smem_bytes(block_m, block_k, num_stages, r + p, itemsize)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"mla_decode: block_m {block_m} x block_k {block_k} x {num_stages} stages needs {smem} "
            f"bytes of shared memory at kv_lora + rope = {r + p} ({latent_pages.dtype}); a block "
            f"has {SMEM_BYTES}"
        )
    block_v = r if block_v is None else block_v
    if not (_is_pow2(block_v) and 16 <= block_v <= r):
        raise ValueError(f"block_v must be a power of two in [16, kv_lora={r}]; got {block_v}")
    if n_splits is None:
        n_splits = max(1, min(32, 132 // max(1, b * (-(-sq * h // block_m)) * (r // block_v))))
    interpret = _default_interpret() if interpret is None else interpret
    return _mla_decode_core(
        q_latent,
        q_pe,
        latent_pages,
        jnp.asarray(block_tables, jnp.int32),
        jnp.asarray(seq_lens, jnp.int32),
        scale=float(scale),
        n_splits=int(n_splits),
        block_m=block_m,
        block_k=block_k,
        block_v=block_v,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def write_latent(latent_pages, new_latent, block_tables, positions, valid=None):
    """Write new latents [B, T, D] at absolute `positions` [B, T] into their pages (a scatter;
    in place when `latent_pages` is donated by the caller's jit).  valid: int32 [B] or None;
    row b's latents after its first valid[b] are dropped (they pad a chunk, and their
    positions may lie past the row's block table)."""
    page = latent_pages.shape[1]
    page_idx = jnp.take_along_axis(block_tables, positions // page, axis=1, mode="clip")
    if valid is not None:  # an out-of-range page index: the scatter drops the row
        real = jnp.arange(positions.shape[1])[None] < valid[:, None]
        page_idx = jnp.where(real, page_idx, latent_pages.shape[0])
    return latent_pages.at[page_idx, positions % page].set(new_latent.astype(latent_pages.dtype), mode="drop")


# ---- prefill -----------------------------------------------------------------------------------


class LatentPrefix:
    """A cached prefix per sequence, read from latent pages and expanded through W_UK / W_UV.

    latent_pages [num_pages, page, kv_lora + rope], block_tables int32 [N, max_pages],
    lens int32 [N] (tokens cached before each sequence's new ones; concrete),
    w_kb [kv_lora, H, nope] (W_UK), w_vb [kv_lora, H, v] (W_UV).
    """

    def __init__(self, latent_pages, block_tables, lens, w_kb, w_vb):
        self.latent_pages, self.block_tables, self.lens, self.w_kb, self.w_vb = (
            latent_pages,
            block_tables,
            lens,
            w_kb,
            w_vb,
        )

    def expand(self, max_len: int):
        """Per-head prefix keys [N, max_len, H, nope + rope] and values [N, max_len, H, v]."""
        kv = gather_pages(self.latent_pages, self.block_tables)[:, :max_len]
        return expand_heads(kv, self.w_kb, self.w_vb)


def mla_prefill_ref(q, k, v, *, cu_seqlens, scale, prefix: LatentPrefix | None = None):
    """Reference, sequence by sequence with the shared attention math.  Same contract as `mla_prefill`."""
    cu = np.asarray(cu_seqlens)
    outs, lses = [], []
    for n in range(len(cu) - 1):
        lo, hi = int(cu[n]), int(cu[n + 1])
        qn, kn, vn = q[lo:hi][None], k[lo:hi][None], v[lo:hi][None]
        p_len = 0 if prefix is None else int(np.asarray(prefix.lens)[n])
        if p_len:
            pk, pv = prefix.expand(p_len)
            kn = jnp.concatenate([pk[n : n + 1].astype(kn.dtype), kn], axis=1)
            vn = jnp.concatenate([pv[n : n + 1].astype(vn.dtype), vn], axis=1)
        q_pos = (p_len + jnp.arange(hi - lo))[None]
        k_pos = jnp.arange(kn.shape[1])[None]
        o, lse = attend(qn, kn, vn, scale=scale, q_pos_bt=q_pos, k_pos_bs=k_pos, return_lse=True)
        outs.append(o[0])
        lses.append(lse[0])
    return jnp.concatenate(outs), jnp.concatenate(lses)


_NEVER = 1 << 30  # key position of padding: visible to no query


_LOG2E = 1.4426950408889634


def _prefill_kernel(
    plen_ref,
    qpos_ref,
    kpos_ref,
    qn_ref,
    qr_ref,
    kn_ref,
    kr_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    block_q,
    block_k,
    prefix_blocks,
    scale,
    precision,
):
    """One (sequence, head, query block): the prefix's key blocks, then new key blocks up to
    the diagonal.  Only blocks that can hold an invisible key are masked: the prefix's last
    (padded) blocks and the new blocks that reach the diagonal; scores are kept in base 2
    (scale * log2 e folded in) so the exponentials are exp2."""
    f32 = jnp.float32
    n, h, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    qs = pl.ds(qb * block_q, block_q)
    q_nope, q_rope = qn_ref[n, qs, h, :], qr_ref[n, qs, h, :]
    q_pos = qpos_ref[n, qs]

    def step(kb, carry, masked):
        m, l, acc = carry
        ks = pl.ds(kb * block_k, block_k)
        s = (
            jnp.dot(q_nope, kn_ref[n, ks, h, :].T, preferred_element_type=f32, precision=precision)
            + jnp.dot(q_rope, kr_ref[n, ks, h, :].T, preferred_element_type=f32, precision=precision)
        ) * (scale * _LOG2E)
        if masked:
            s = jnp.where(kpos_ref[n, ks][None, :] <= q_pos[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_safe[:, None])
        alpha = jnp.exp2(m - m_safe)
        vv = v_ref[n, ks, h, :]
        acc = acc * alpha[:, None] + jnp.dot(p.astype(vv.dtype), vv, preferred_element_type=f32, precision=precision)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    loop = lambda lo, hi, carry, masked: jax.lax.fori_loop(lo, hi, functools.partial(step, masked=masked), carry)
    dv = v_ref.shape[-1]
    carry = (jnp.full((block_q,), -jnp.inf, f32), jnp.zeros((block_q,), f32), jnp.zeros((block_q, dv), f32))
    full_prefix = plen_ref[n] // block_k  # prefix blocks holding no padding
    carry = loop(0, full_prefix, carry, False)
    # the partly filled block, if any; the padding blocks after it hold no visible key
    carry = loop(full_prefix, (plen_ref[n] + block_k - 1) // block_k, carry, True)
    # New keys: blocks wholly before this query block's first row are visible to all of it.
    before = (qb * block_q) // block_k
    carry = loop(prefix_blocks, prefix_blocks + before, carry, False)
    carry = loop(prefix_blocks + before, prefix_blocks + ((qb + 1) * block_q + block_k - 1) // block_k, carry, True)
    m, l, acc = carry
    has = l > 0
    o_ref[n, qs, h, :] = jnp.where(has[:, None], acc / jnp.where(has, l, 1.0)[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[n, qs, h] = jnp.where(has, (m + jnp.log2(jnp.where(has, l, 1.0))) / _LOG2E, -jnp.inf)


def _dot_precision(dtype, interpret: bool):
    """The decode kernel's dots: fp32 operands in 3xTF32 (a Triton dot of fp32 defaults to single
    TF32, ~1e-3 relative), 16-bit operands the default.  The prefill kernel's: `_prefill_precision`."""
    return dots.fp32_precision(interpret) if jnp.dtype(dtype) == jnp.float32 else None


def _prefill_precision(dtype, interpret: bool, fp32_dots: str | None):
    """The prefill kernel's dots: 16-bit operands the default; fp32 operands as `fp32_dots` asks,
    by default IEEE fp32.  On the H200 at `small`'s dims IEEE costs what single TF32 does
    (the kernel is not bound by its dots there) and is exact where TF32 is 3.3e-3 off; 3xTF32's
    tiles overflow shared memory (344,320 of 232,448 bytes), so it is refused before launch
    (RESULTS.md, MLA kernels)."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    fp32_dots = fp32_dots or "ieee"
    if fp32_dots == "tf32x3":
        raise ValueError(
            "mla_prefill: 3xTF32 tiles overflow the GPU's shared memory at two stages (the H200 asks "
            "344,320 of 232,448 bytes at small's dims); use fp32_dots='ieee' (exact, as fast) or 'tf32'"
        )
    return dots.fp32_precision(interpret, fp32_dots)


def _pad_last(x, d):
    return x if x.shape[-1] == d else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])])


def _pow2_at_least_16(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def prefill_smem_bytes(block: int, block_k: int, num_stages: int, dqk: int, dv: int, itemsize: int) -> int:
    """Shared memory of one prefill program: the query block [block, dqk], num_stages - 1
    buffered key / value tiles [block_k, dqk + dv] and the probabilities [block, block_k]
    (dims padded to powers of two as the kernel pads them), plus 512 bytes of Triton's own.
    Matches the H200's report for fp32 at block 128 / block_k 64, 3 stages, qk 192, v 128:
    295,424 bytes."""
    return (block * dqk + (num_stages - 1) * block_k * (dqk + dv) + block * block_k) * itemsize + 512


def _prefill_stages(block: int, block_k: int, num_stages, dqk: int, dv: int, rope_dim: int, itemsize: int) -> int:
    """num_stages for the prefill kernel: the caller's, refused before any launch if its tiles
    overflow `SMEM_BYTES`; None: 3 (the H200's fastest for bf16), fewer where they would
    not fit (fp32 at the model's dims: 2)."""
    dims = (_pow2_at_least_16(dqk - rope_dim) + _pow2_at_least_16(rope_dim), _pow2_at_least_16(dv))
    fits = lambda n: prefill_smem_bytes(block, block_k, n, *dims, itemsize) <= SMEM_BYTES
    if num_stages is None:
        num_stages = next((n for n in (3, 2, 1) if fits(n)), 1)
    if not fits(num_stages):
        raise ValueError(
            f"mla_prefill: block {block} x block_k {block_k} x {num_stages} stages needs "
            f"{prefill_smem_bytes(block, block_k, num_stages, *dims, itemsize)} bytes of shared memory "
            f"at qk {dqk} / v {dv} ({itemsize}-byte elements); a block has {SMEM_BYTES}: pass a "
            f"smaller block or block_k"
        )
    return num_stages


def mla_prefill(
    q,
    k,
    v,
    *,
    cu_seqlens,
    scale,
    rope_dim,
    prefix: LatentPrefix | None = None,
    block=128,
    block_k=64,
    interpret=None,
    num_warps=8,
    num_stages=None,
    fp32_dots=None,
):
    """Causal flash attention (naive MLA form) over packed new tokens plus a cached prefix.

    Args:
      q, k: [T, H, nope + rope] (the last `rope_dim` dims are the rope part);
        v: [T, H, v_dim]; T = sum of new-token counts.
      cu_seqlens: int [N + 1] cumulative new-token counts (concrete).
      scale: softmax scale.
      prefix: the cached tokens before each sequence's new ones, or None.
      block / block_k / num_warps / num_stages: query rows and keys per step (block_k
        divides block; None: block), warps, pipeline stages.  The defaults are the
        fastest of five on H200 at every benchmarked shape (RESULTS.md); num_stages None:
        3, fewer where the tiles overflow shared memory (`_prefill_stages`: fp32).
      fp32_dots: how fp32 operands multiply (`pallas_kernels.dots.GPU_DOT_ALGORITHMS`: "tf32",
        "ieee"; "tf32x3" overflows shared memory and is refused); None: "ieee".  16-bit
        operands ignore it.
    Returns:
      o [T, H, v_dim] in v's dtype, lse fp32 [T, H].
    """
    interpret = _default_interpret() if interpret is None else interpret
    block_k = block if block_k is None else block_k
    if not (_is_pow2(block) and _is_pow2(block_k) and 16 <= block_k <= block):
        raise ValueError(f"block and block_k must be powers of two with 16 <= block_k <= block; got {block}, {block_k}")
    num_stages = _prefill_stages(
        block, block_k, num_stages, q.shape[-1], v.shape[-1], rope_dim, jnp.dtype(k.dtype).itemsize
    )
    lay = PrefillLayout(q, k, v, cu_seqlens, prefix, q_multiple=block, k_multiple=block)
    keys, vals = lay.keys_values(k, v)
    q_pos, k_pos = lay.positions()
    o, lse = _prefill_padded(
        lay.p_lens,
        q_pos,
        k_pos,
        lay.gather(q),
        keys,
        vals,
        lp=lay.lp,
        rope_dim=rope_dim,
        scale=scale,
        block=block,
        block_k=block_k,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        fp32_dots=fp32_dots,
    )
    return lay.unpad(o, lse, v.shape[-1])


def _prefill_padded(
    p_lens,
    q_pos,
    k_pos,
    q,
    keys,
    vals,
    *,
    lp,
    rope_dim,
    scale,
    block,
    block_k,
    interpret,
    num_warps,
    num_stages,
    fp32_dots,
):
    """The prefill kernel on padded operands: q [N, lq, H, Dqk], keys [N, lp + lq, H, Dqk], vals
    [N, lp + lq, H, Dv] (prefix then new tokens), positions q_pos [N, lq], k_pos [N, lp + lq],
    p_lens [N] (concrete or traced).  Head dims go to powers of two >= 16 (Triton's dot
    tiles), nope and rope apart.  Returns o [N, lq, H, >= Dv], lse [N, lq, H]."""
    d_nope = q.shape[-1] - rope_dim
    dn, dr, dv = _pow2_at_least_16(d_nope), _pow2_at_least_16(rope_dim), _pow2_at_least_16(vals.shape[-1])
    split = lambda x: (_pad_last(x[..., :d_nope], dn), _pad_last(x[..., d_nope:], dr))
    (qn, qr), (kn, kr) = split(q), split(keys)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return _mla_prefill_core(
        i32(p_lens),
        i32(q_pos),
        i32(k_pos),
        qn,
        qr,
        kn,
        kr,
        _pad_last(vals, dv),
        block=block,
        block_k=block_k,
        prefix_blocks=lp // block_k,
        scale=float(scale),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        precision=_prefill_precision(keys.dtype, interpret, fp32_dots),
    )


def mla_prefill_chunk(
    q,
    k,
    v,
    prefix: LatentPrefix,
    *,
    scale,
    rope_dim,
    block=128,
    block_k=64,
    interpret=None,
    num_warps=8,
    num_stages=None,
    fp32_dots=None,
):
    """A prefill chunk continuing a cache, as a serving step batches it: B sequences each adding
    the same T new tokens after `prefix.lens[b]` cached ones, whose length may be traced (a
    jitted step's cache view).  The prefix is expanded from its pages over the whole block
    table (its rows past a sequence's length are never attended), the chunk attends
    causally to itself; one launch of the `mla_prefill` kernel, whose loops over the prefix
    stop at each sequence's own length.

    Args:
      q, k: [B, T, H, nope + rope]; v: [B, T, H, v_dim]: the chunk's queries, keys and values
        (positions prefix.lens[b] + 0 .. T - 1).
      prefix: LatentPrefix with lens int32 [B] (concrete or traced) and block_tables [B,
        max_pages] covering them.
      fp32_dots: as `mla_prefill`'s.
    Returns:
      o [B, T, H, v_dim] in v's dtype, lse fp32 [B, T, H].
    """
    interpret = _default_interpret() if interpret is None else interpret
    t = q.shape[1]
    block = min(block, max(16, 1 << (t - 1).bit_length()))  # a short chunk: one small query block
    block_k = min(block_k, block)
    num_stages = _prefill_stages(
        block, block_k, num_stages, q.shape[-1], v.shape[-1], rope_dim, jnp.dtype(k.dtype).itemsize
    )
    lay = ChunkLayout(q, k, v, prefix, q_multiple=block, k_multiple=block_k)
    o, lse = _prefill_padded(
        lay.p_lens,
        lay.q_pos,
        lay.k_pos,
        lay.q,
        lay.keys,
        lay.vals,
        lp=lay.lp,
        rope_dim=rope_dim,
        scale=scale,
        block=block,
        block_k=block_k,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        fp32_dots=fp32_dots,
    )
    return o[:, :t, :, : v.shape[-1]], lse[:, :t]


class ChunkLayout:
    """The padded operands of a prefill chunk continuing a cache, shared by the chunk kernels:
    q [B, lq, H, Dqk] (T rows padded to a multiple of `q_multiple`), keys / vals [B, lp + lq,
    H, D*] (the prefix expanded over the whole block table, padded to `lp`, a multiple of
    `k_multiple`, then the chunk), positions q_pos [B, lq] (-1 for padding) and k_pos [B, lp +
    lq] (past each prefix's length and for padding: a position no query reaches), p_lens
    int32 [B] (concrete or traced).  Validates shapes (and concrete tables) first."""

    def __init__(self, q, k, v, prefix: LatentPrefix, *, q_multiple: int, k_multiple: int):
        if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
            raise ValueError(
                f"q, k must be [B, T, H, D] and v [B, T, H, Dv] with one B, T, H; got {q.shape}, {k.shape}, {v.shape}"
            )
        b, t = q.shape[:2]
        if prefix.block_tables.ndim != 2 or prefix.block_tables.shape[0] != b or jnp.shape(prefix.lens) != (b,):
            raise ValueError(
                f"prefix.block_tables must be [B={b}, max_pages] and prefix.lens [B]; got "
                f"{tuple(prefix.block_tables.shape)}, {tuple(jnp.shape(prefix.lens))}"
            )
        if _concrete(prefix.lens) and _concrete(prefix.block_tables):
            check_prefix_pages(prefix, np.asarray(prefix.lens))
        capacity = prefix.block_tables.shape[1] * prefix.latent_pages.shape[1]
        self.lp, self.lq = lp, lq = -(-capacity // k_multiple) * k_multiple, -(-t // q_multiple) * q_multiple
        self.p_lens = p_lens = jnp.asarray(prefix.lens, jnp.int32)
        pad_to = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1])) + ((0, 0),) * (x.ndim - 2))
        pk, pv = prefix.expand(capacity)
        self.q = pad_to(q, lq)
        self.keys = jnp.concatenate([pad_to(pk.astype(k.dtype), lp), pad_to(k, lq)], axis=1)
        self.vals = jnp.concatenate([pad_to(pv.astype(v.dtype), lp), pad_to(v, lq)], axis=1)
        valid = jnp.arange(lq)[None] < t
        self.q_pos = jnp.where(valid, p_lens[:, None] + jnp.arange(lq)[None], -1)
        self.k_pos = jnp.concatenate(
            [
                jnp.where(jnp.arange(lp)[None] < p_lens[:, None], jnp.arange(lp)[None], _NEVER),
                jnp.where(valid, self.q_pos, _NEVER),
            ],
            axis=1,
        )


def check_prefix_pages(prefix: LatentPrefix, p_lens):
    """Concrete prefix lengths [N] within the block tables, whose used entries are valid pages."""
    page = prefix.latent_pages.shape[1]
    table = np.asarray(prefix.block_tables)
    if p_lens.max() > table.shape[1] * page:
        raise ValueError("prefix.block_tables must have a row per sequence covering prefix.lens")
    used = np.arange(table.shape[1])[None, :] * page < p_lens[:, None]
    if (table[used] < 0).any() or (table[used] >= prefix.latent_pages.shape[0]).any():
        raise ValueError(f"prefix.block_tables hold page indices outside [0, {prefix.latent_pages.shape[0]})")


class PrefillLayout:
    """The host-side plan the prefill kernels share: each sequence's new tokens padded to `lq`
    query rows (a multiple of `q_multiple`), and its keys laid out as [lp + lq] = the cached
    prefix (padded to `lp`, a multiple of `k_multiple`) then the new tokens.

    Validates q / k / v [T, H, D*], cu_seqlens (concrete, [N + 1]) and the prefix's tables
    before anything is launched.
    """

    def __init__(self, q, k, v, cu_seqlens, prefix: LatentPrefix | None, *, q_multiple: int, k_multiple: int):
        if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
            raise ValueError(
                f"q, k must be [T, H, D] and v [T, H, Dv] with one T, H; got {q.shape}, {k.shape}, {v.shape}"
            )
        t = q.shape[0]
        cu = np.asarray(cu_seqlens).astype(np.int64)
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != t or np.any(np.diff(cu) <= 0):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to T={t}; got {cu.tolist()}")
        n_seq = cu.size - 1
        lens = np.diff(cu)
        p_lens = np.zeros(n_seq, np.int64) if prefix is None else np.asarray(prefix.lens).astype(np.int64)
        if p_lens.shape != (n_seq,):
            raise ValueError(f"prefix.lens must be [N={n_seq}]; got {p_lens.shape}")
        if prefix is not None:
            if np.shape(prefix.block_tables)[0] != n_seq:
                raise ValueError("prefix.block_tables must have a row per sequence covering prefix.lens")
            check_prefix_pages(prefix, p_lens)
        self.prefix, self.p_lens = prefix, p_lens
        self.lq = lq = int(-(-lens.max() // q_multiple) * q_multiple)
        self.lp = int(-(-p_lens.max() // k_multiple) * k_multiple)
        src = np.full((n_seq, lq), -1, np.int64)
        for i in range(n_seq):
            src[i, : lens[i]] = cu[i] + np.arange(lens[i])
        self.src, self.valid = src, src >= 0
        # every sequence exactly lq tokens (one prompt of a multiple of the tile, or equal ones):
        # the packed rows already are [N, lq] row-major, and the layout is a reshape, not a copy
        # (the gathers around the kernel cost a third of a B1 T4096 prefill: RESULTS.md, MLA kernels)
        self.dense = bool(np.all(lens == lq))

    def gather(self, x):
        """Packed [T, H, D] -> padded [N, lq, H, D] (zeros in padding rows)."""
        if self.dense:
            return x.reshape((self.src.shape[0], self.lq) + x.shape[1:])
        return jnp.where(jnp.asarray(self.valid)[..., None, None], x[jnp.asarray(np.maximum(self.src, 0))], 0)

    def keys_values(self, k, v):
        """Keys [N, lp + lq, H, Dqk] and values [N, lp + lq, H, Dv]: the prefix expanded
        through W_UK / W_UV (rows past a prefix's length hold whatever its table points at:
        the kernels never attend to them), then the new tokens."""
        keys, vals = self.gather(k), self.gather(v)
        if self.lp:
            pk, pv = self.prefix.expand(self.lp)
            keys = jnp.concatenate([pk.astype(keys.dtype), keys], axis=1)
            vals = jnp.concatenate([pv.astype(vals.dtype), vals], axis=1)
        return keys, vals

    def positions(self):
        """Query positions [N, lq] (-1 for padding) and key positions [N, lp + lq] (a position no
        query reaches for padding), counted from each sequence's first cached token."""
        q_pos = np.where(self.valid, self.p_lens[:, None] + np.arange(self.lq)[None], -1)
        k_pos_new = np.where(self.valid, q_pos, _NEVER)
        ar = np.arange(self.lp)[None]
        k_pos_pre = np.where(ar < self.p_lens[:, None], ar, _NEVER)
        return q_pos, np.concatenate([k_pos_pre, k_pos_new], 1)

    def unpad(self, o_nqhd, lse_nqh, dv: int):
        """Padded outputs [N, lq, H, >= dv] and LSE [N, lq, H] -> packed [T, H, dv] and [T, H]."""
        n, lq, h = lse_nqh.shape
        o, lse = o_nqhd.reshape(n * lq, h, -1), lse_nqh.reshape(n * lq, h)
        if not self.dense:
            flat = np.flatnonzero(self.valid.reshape(-1))
            o, lse = o[flat], lse[flat]
        return o if o.shape[-1] == dv else o[..., :dv], lse


@functools.partial(
    jax.jit,
    static_argnames=("block", "block_k", "prefix_blocks", "scale", "interpret", "num_warps", "num_stages", "precision"),
)
def _mla_prefill_core(
    p_lens,
    q_pos,
    k_pos,
    qn,
    qr,
    kn,
    kr,
    v,
    *,
    block,
    block_k,
    prefix_blocks,
    scale,
    interpret,
    num_warps,
    num_stages,
    precision,
):
    n_seq, lq, h, _ = qn.shape
    return pl.pallas_call(
        functools.partial(
            _prefill_kernel,
            block_q=block,
            block_k=block_k,
            prefix_blocks=prefix_blocks,
            scale=scale,
            precision=precision,
        ),
        grid=(n_seq, h, lq // block),
        out_shape=[
            jax.ShapeDtypeStruct((n_seq, lq, h, v.shape[-1]), v.dtype),
            jax.ShapeDtypeStruct((n_seq, lq, h), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="mla_prefill",
    )(p_lens, q_pos, k_pos, qn, qr, kn, kr, v)
