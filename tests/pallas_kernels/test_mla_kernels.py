"""Pallas MLA kernels (interpret mode on CPU) against attention on expanded K/V.

Interpret mode fills outputs with NaN before the kernel runs, so finite
results prove every element was written (split partials included: a NaN
partial would poison the merge).
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jax

from pallas_kernels.mla import (
    LatentPrefix,
    gather_pages,
    mla_decode,
    mla_decode_ref,
    mla_prefill,
    mla_prefill_chunk,
    mla_prefill_ref,
    write_latent,
)
from pallas_kernels.attention import attend

ATOL, RTOL = 2e-5, 2e-5  # fp32 inputs, fp32 accumulation; online softmax reorders sums


@pytest.fixture(autouse=True)
def _fp32_reference_dots():
    """The references' dots at fp32: a GPU's default fp32 dot is TF32 (~1e-3 relative), which
    these tolerances are not for (the kernels pick their own dot precision)."""
    with jax.default_matmul_precision("highest"):
        yield


def _rand(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _paged(rng, b, n_pages, page, width, max_pages):
    pages = _rand(rng, n_pages, page, width)
    table = jnp.asarray(rng.permutation(n_pages)[: b * max_pages].reshape(b, max_pages), jnp.int32)
    return pages, table


@pytest.mark.parametrize("sq, n_splits, block_v", [(1, 1, None), (1, 3, None), (3, 2, None), (3, 2, 16), (40, 2, None)])
def test_decode_equals_naive_attention_on_expanded_kv(rng, sq, n_splits, block_v):
    """Absorbed paged decode == naive attention with per-head K/V expanded from the latent
    (block_v 16: the value columns split over two programs per row block; Sq 40: a prefill
    chunk continuing a cache, 160 rows in 64-row blocks, the early blocks stopping at their
    last query's position)."""
    b, h, r, p, nope, dv, page = 3, 4, 32, 16, 16, 16, 32
    pages, table = _paged(rng, b, 24, page, r + p, 6)
    lens = jnp.asarray([sq + 2, 100, 161], jnp.int32)  # not multiples of the page size
    w_kb, w_vb = _rand(rng, r, h, nope) * 0.3, _rand(rng, r, h, dv) * 0.3
    q_nope, q_pe = _rand(rng, b, sq, h, nope), _rand(rng, b, sq, h, p)
    q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, w_kb)
    o_lat, lse = mla_decode(
        q_latent, q_pe, pages, table, lens, scale=0.2, n_splits=n_splits, block_k=16, block_v=block_v
    )
    assert np.isfinite(o_lat).all() and np.isfinite(lse).all()
    # naive form on expanded keys and values
    kv = gather_pages(pages, table)
    k = jnp.concatenate(
        [jnp.einsum("bsr,rhn->bshn", kv[..., :r], w_kb), jnp.broadcast_to(kv[:, :, None, r:], kv.shape[:2] + (h, p))],
        -1,
    )
    v = jnp.einsum("bsr,rhv->bshv", kv[..., :r], w_vb)
    q_pos = lens[:, None] - sq + jnp.arange(sq)[None]
    k_pos = jnp.broadcast_to(jnp.arange(kv.shape[1])[None], kv.shape[:2])
    o_naive, lse_naive = attend(
        jnp.concatenate([q_nope, q_pe], -1), k, v, scale=0.2, q_pos_bt=q_pos, k_pos_bs=k_pos, return_lse=True
    )
    np.testing.assert_allclose(jnp.einsum("bshr,rhv->bshv", o_lat, w_vb), o_naive, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(lse, lse_naive, atol=1e-4, rtol=1e-4)
    o_ref, lse_ref = mla_decode_ref(q_latent, q_pe, pages, table, lens, scale=0.2)
    np.testing.assert_allclose(o_lat, o_ref, atol=ATOL, rtol=RTOL)


def test_decode_ignores_pages_beyond_the_sequence(rng):
    b, h, r, p, page = 1, 2, 32, 16, 16
    pages, table = _paged(rng, b, 8, page, r + p, 4)
    args = (_rand(rng, b, 1, h, r), _rand(rng, b, 1, h, p))
    lens = jnp.asarray([20], jnp.int32)
    o1, _ = mla_decode(*args, pages, table, lens, scale=0.1)
    poisoned = pages.at[table[0, 2:]].set(1e4).at[table[0, 1], 4:].set(1e4)
    o2, _ = mla_decode(*args, poisoned, table, lens, scale=0.1)
    np.testing.assert_array_equal(o1, o2)


def test_write_latent_lands_in_the_right_pages(rng):
    pages, table = _paged(rng, 2, 8, 4, 3, 3)
    new = _rand(rng, 2, 2, 3)
    pos = jnp.asarray([[3, 4], [0, 1]])
    out = write_latent(pages, new, table, pos)
    kv = gather_pages(out, table)
    np.testing.assert_array_equal(kv[0, 3:5], new[0])
    np.testing.assert_array_equal(kv[1, 0:2], new[1])
    untouched = gather_pages(pages, table)
    np.testing.assert_array_equal(kv[0, :3], untouched[0, :3])


# block_k < block: several key steps per query block, so the unmasked fast loops (whole
# prefix blocks, new blocks before the diagonal) and the masked ones all run.
@pytest.mark.parametrize("with_prefix, block, block_k", [(False, 16, None), (True, 16, None), (True, 32, 16)])
def test_prefill_with_cached_prefix_equals_reference(rng, with_prefix, block, block_k):
    h, r, p, nope, dv, page = 2, 32, 8, 16, 16, 32
    lens, p_lens = [5, 70, 33], [0, 40, 100]
    cu = np.concatenate([[0], np.cumsum(lens)])
    t = int(cu[-1])
    q, k, v = _rand(rng, t, h, nope + p), _rand(rng, t, h, nope + p), _rand(rng, t, h, dv)
    prefix = None
    if with_prefix:
        pages, table = _paged(rng, 3, 12, page, r + p, 4)
        prefix = LatentPrefix(
            pages, table, jnp.asarray(p_lens), _rand(rng, r, h, nope) * 0.2, _rand(rng, r, h, dv) * 0.2
        )
    o, lse = mla_prefill(q, k, v, cu_seqlens=cu, scale=0.2, rope_dim=p, prefix=prefix, block=block, block_k=block_k)
    assert o.shape == (t, h, dv) and np.isfinite(o).all() and np.isfinite(lse).all()
    o_ref, lse_ref = mla_prefill_ref(q, k, v, cu_seqlens=cu, scale=0.2, prefix=prefix)
    np.testing.assert_allclose(o, o_ref, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(lse, lse_ref, atol=ATOL, rtol=RTOL)


def test_sequences_of_whole_query_tiles_are_laid_out_by_a_reshape_and_give_the_reference(rng):
    """Every sequence exactly lq tokens (here two of 32, query tiles of 16): the packed rows are
    already [N, lq] row-major, so the layout around the kernel is a reshape (no gather in the
    program), the padded path's values, and the prefill still equals the reference, with a
    cached prefix as well."""
    from pallas_kernels.mla import PrefillLayout

    h, r, p, nope, dv, page = 2, 32, 8, 16, 16, 32
    cu = np.array([0, 32, 64])  # two rows of 32
    q, k, v = _rand(rng, 64, h, nope + p), _rand(rng, 64, h, nope + p), _rand(rng, 64, h, dv)
    lay = PrefillLayout(q, k, v, cu, None, q_multiple=16, k_multiple=16)
    assert lay.dense and not PrefillLayout(q, k, v, np.array([0, 30, 64]), None, q_multiple=16, k_multiple=16).dense
    slow = jnp.where(jnp.asarray(lay.valid)[..., None, None], q[jnp.asarray(np.maximum(lay.src, 0))], 0)
    np.testing.assert_array_equal(lay.gather(q), slow)
    assert "gather" not in str(jax.make_jaxpr(lay.gather)(q))
    pages, table = _paged(rng, 2, 8, page, r + p, 4)
    for prefix in (
        None,
        LatentPrefix(pages, table, jnp.asarray([40, 0]), _rand(rng, r, h, nope) * 0.2, _rand(rng, r, h, dv) * 0.2),
    ):
        o, lse = mla_prefill(q, k, v, cu_seqlens=cu, scale=0.2, rope_dim=p, prefix=prefix, block=16, block_k=16)
        o_ref, lse_ref = mla_prefill_ref(q, k, v, cu_seqlens=cu, scale=0.2, prefix=prefix)
        assert o.shape == (64, h, dv)
        np.testing.assert_allclose(o, o_ref, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(lse, lse_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("t", [20, 3])
def test_prefill_chunk_with_traced_prefix_lengths_equals_reference(rng, t):
    """A batch of chunks of T new tokens after prefixes of 37, 0 and 100 cached tokens, the
    lengths traced (as in a jitted serving step) == the packed reference with the same
    prefixes; T 3 takes one 16-row query block."""
    b, h, r, p, nope, dv, page = 3, 2, 32, 8, 16, 16, 32
    p_lens = jnp.asarray([37, 0, 100], jnp.int32)
    q, k, v = _rand(rng, b, t, h, nope + p), _rand(rng, b, t, h, nope + p), _rand(rng, b, t, h, dv)
    pages, table = _paged(rng, b, 14, page, r + p, 4)
    w_kb, w_vb = _rand(rng, r, h, nope) * 0.2, _rand(rng, r, h, dv) * 0.2
    chunk = jax.jit(
        lambda lens: mla_prefill_chunk(q, k, v, LatentPrefix(pages, table, lens, w_kb, w_vb), scale=0.2, rope_dim=p)
    )
    o, lse = chunk(p_lens)
    assert o.shape == (b, t, h, dv) and lse.shape == (b, t, h) and np.isfinite(o).all() and np.isfinite(lse).all()
    pack = lambda x: x.reshape((b * t,) + x.shape[2:])
    o_ref, lse_ref = mla_prefill_ref(
        pack(q),
        pack(k),
        pack(v),
        cu_seqlens=np.arange(b + 1) * t,
        scale=0.2,
        prefix=LatentPrefix(pages, table, p_lens, w_kb, w_vb),
    )
    np.testing.assert_allclose(pack(o), o_ref, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(pack(lse), lse_ref, atol=ATOL, rtol=RTOL)


class TestBadInput:
    def _decode_args(self, rng):
        pages, table = _paged(rng, 2, 8, 16, 48, 3)
        return _rand(rng, 2, 1, 2, 32), _rand(rng, 2, 1, 2, 16), pages, table

    def test_page_index_out_of_range(self, rng):
        ql, qp, pages, table = self._decode_args(rng)
        with pytest.raises(ValueError, match="page indices"):
            mla_decode(ql, qp, pages, table.at[0, 0].set(99), jnp.asarray([5, 5]), scale=0.1)

    def test_chunk_prefix_beyond_the_table(self, rng):
        pages, table = _paged(rng, 1, 4, 16, 48, 2)
        x = _rand(rng, 1, 4, 2, 24)
        with pytest.raises(ValueError, match="covering prefix.lens"):
            mla_prefill_chunk(
                x,
                x,
                x,
                LatentPrefix(pages, table, jnp.asarray([40]), _rand(rng, 32, 2, 8), _rand(rng, 32, 2, 24)),
                scale=0.1,
                rope_dim=16,
            )

    def test_seq_len_beyond_the_table(self, rng):
        ql, qp, pages, table = self._decode_args(rng)
        with pytest.raises(ValueError, match="seq_lens"):
            mla_decode(ql, qp, pages, table, jnp.asarray([5, 49]), scale=0.1)

    def test_value_block_that_does_not_tile_the_latent(self, rng):
        ql, qp, pages, table = self._decode_args(rng)
        with pytest.raises(ValueError, match="block_v"):
            mla_decode(ql, qp, pages, table, jnp.asarray([5, 5]), scale=0.1, block_v=24)

    def test_wrong_dims(self, rng):
        ql, qp, pages, table = self._decode_args(rng)
        with pytest.raises(ValueError, match="kv_lora \\+ rope"):
            mla_decode(ql, qp[..., :8], pages, table, jnp.asarray([5, 5]), scale=0.1)
        with pytest.raises(ValueError, match="cu_seqlens"):
            mla_prefill(ql[0], ql[0], ql[0], cu_seqlens=[0, 2, 1], scale=0.1, rope_dim=16)


@pytest.mark.parametrize("rows", [16, 64, 96 * 4])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_decode_blocking_fits_shared_memory_at_model_dims(rows, itemsize):
    """The Triton decode's blocks fit an H200 block's shared memory at `small`'s and the full
    model's latent width (512 + 64) in bf16 and fp32 by `decode_smem_bytes`' estimate (the GPU
    suite runs the fp32 blockings: tests/gpu/test_fp32_kernels.py)."""
    from pallas_kernels.mla import SMEM_BYTES, _decode_blocking, decode_smem_bytes

    block_m, block_k, _ = _decode_blocking(rows, 576, itemsize)
    assert decode_smem_bytes(block_m, block_k, 2, 576, itemsize) <= SMEM_BYTES
    if itemsize == 2:  # bf16 keeps the blocking measured on the H200
        assert (block_m, block_k) == ((64, 32) if rows >= 64 else (16, 64))


def test_prefill_stages_fit_shared_memory_at_model_dims():
    """The Triton prefill at the model's qk 192 / v 128: fp32 at 3 stages asks the H200 for
    295,424 bytes (tests/gpu/test_fp32_kernels.py), which `prefill_smem_bytes` reproduces; fp32
    runs 2 stages, bf16 keeps its measured 3."""
    from pallas_kernels.mla import SMEM_BYTES, _prefill_stages, prefill_smem_bytes

    assert prefill_smem_bytes(128, 64, 3, 192, 128, 4) == 295_424
    assert _prefill_stages(128, 64, None, 192, 128, 64, 2) == 3
    assert _prefill_stages(128, 64, None, 192, 128, 64, 4) == 2
    assert prefill_smem_bytes(128, 64, 2, 192, 128, 4) <= SMEM_BYTES
    with pytest.raises(ValueError, match="shared memory"):
        _prefill_stages(128, 64, 3, 192, 128, 64, 4)


def test_prefill_refuses_stages_over_shared_memory(rng):
    q, k, v = (
        _rand(rng, 64, 2, 192).astype(jnp.float32),
        _rand(rng, 64, 2, 192).astype(jnp.float32),
        _rand(rng, 64, 2, 128).astype(jnp.float32),
    )
    with pytest.raises(ValueError, match="shared memory"):
        mla_prefill(q, k, v, cu_seqlens=[0, 64], scale=0.1, rope_dim=64, num_stages=3)


def test_decode_refuses_blocks_over_shared_memory(rng):
    pages, table = _paged(rng, 2, 8, 64, 576, 3)
    ql, qp = _rand(rng, 2, 1, 64, 512), _rand(rng, 2, 1, 64, 64)
    with pytest.raises(ValueError, match="shared memory"):
        mla_decode(ql, qp, pages.astype(jnp.float32), table, jnp.asarray([5, 5]), scale=0.1, block_m=64, block_k=64)


@pytest.mark.parametrize("b, splits, sq, h, r", [(2, 5, 1, 16, 256), (3, 1, 2, 8, 128), (1, 8, 1, 12, 128)])
def test_the_split_merge_kernel_equals_its_reference(rng, b, splits, sq, h, r):
    """`merge_splits` as one kernel (compiled on a GPU, interpreted elsewhere) against the jnp
    logsumexp merge, with splits that saw no keys (lse -inf, o 0) and rows past Sq * H."""
    from pallas_kernels.mla import merge_splits, merge_splits_ref

    rows_pad = -(-sq * h // 16) * 16
    o = jnp.asarray(rng.standard_normal((b, splits, rows_pad, r)), jnp.float32)
    lse = rng.standard_normal((b, splits, rows_pad)).astype(np.float32) * 3
    lse[:, -1, ::3] = -np.inf  # a split past some rows' keys
    if splits == 1:
        lse[0, 0, :4] = -np.inf  # rows with no keys at all: o 0, lse -inf
    o = jnp.where(jnp.isfinite(jnp.asarray(lse))[..., None], o, 0.0)
    got = merge_splits(
        o, jnp.asarray(lse), (b, sq, h, r), jnp.float32, kernel=True, interpret=jax.default_backend() != "gpu"
    )
    want = merge_splits_ref(o, jnp.asarray(lse), (b, sq, h, r), jnp.float32)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)
