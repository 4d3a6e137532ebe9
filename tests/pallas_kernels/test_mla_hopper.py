"""The Hopper (Mosaic GPU) MLA prefill, run by the Mosaic GPU interpreter on CPU, against
attention on expanded K/V.  bf16 inputs (the kernel's wgmma dtype), fp32 reference on the
same bf16 values: outputs agree to bf16 rounding, LSE to fp32."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import LatentPrefix, mla_decode_ref, mla_prefill_ref
from pallas_kernels.mla_decode_hopper import mla_decode_hopper
from pallas_kernels.mla_hopper import mla_prefill_chunk_hopper, mla_prefill_hopper, prefill_block_kv, supports

O_ATOL = 2e-2  # outputs of O(1) stored in bf16, P rounded to bf16 before P @ V
LSE_ATOL = 1e-4


def _inputs(rng, lens, h, dqk, dv):
    t = sum(lens)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    return f(t, h, dqk), f(t, h, dqk), f(t, h, dv), np.concatenate([[0], np.cumsum(lens)])


def _check(o, lse, q, k, v, cu, scale, prefix=None):
    up = lambda x: x.astype(jnp.float32)
    o_ref, lse_ref = mla_prefill_ref(up(q), up(k), up(v), cu_seqlens=cu, scale=scale, prefix=prefix)
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(np.asarray(o, np.float32), o_ref, atol=O_ATOL, rtol=0)
    np.testing.assert_allclose(lse, lse_ref, atol=LSE_ATOL, rtol=0)


def test_varlen_with_page_granular_prefixes(rng):
    """Two sequences, one with a 64-token cached prefix read from non-contiguous pages."""
    h, r, rope, nope, dv, page = 1, 32, 16, 48, 64, 64
    q, k, v, cu = _inputs(rng, [100, 30], h, nope + rope, dv)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    prefix = LatentPrefix(
        f(4, page, r + rope).astype(jnp.bfloat16),
        jnp.asarray([[2, 1], [3, 0]], jnp.int32),
        jnp.asarray([64, 0]),
        f(r, h, nope) * 0.2,
        f(r, h, dv) * 0.2,
    )
    o, lse = mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=0.125, prefix=prefix)
    assert o.shape == (130, h, dv) and o.dtype == jnp.bfloat16 and lse.shape == (130, h)
    _check(o, lse, q, k, v, cu, 0.125, prefix)


@pytest.mark.parametrize("tile_order", ["heads", "q_tiles"])
def test_several_query_tiles_heads_and_a_deeper_ring(rng, tile_order):
    """Rows past 2 x block_q (a second CTA per sequence), two heads, 128-key blocks, 3 slots:
    the warpgroups' causal ends differ, so one drains steps only the other computes.  Either
    launch order (a q tile's heads together, or a head's q tiles) gives every tile its rows."""
    heads = 2 if tile_order == "heads" else 3  # 3 heads, 2 q tiles: a grid axis taken for another fails
    q, k, v, cu = _inputs(rng, [200, 60], heads, 128, 64)
    o, lse = mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=128**-0.5, block_kv=128, steps=3, tile_order=tile_order)
    _check(o, lse, q, k, v, cu, 128**-0.5)


def test_the_model_head_dims_with_128_key_blocks(rng):
    """qk 192 / v 128 (the model's), 128-key blocks in two slots: each warpgroup's output is
    written into the buffer its queries were read from, after its last Q K^T; the warpgroups
    finish at different steps, so one writes its output while the other still reads queries."""
    q, k, v, cu = _inputs(rng, [150, 40], 1, 192, 128)
    o, lse = mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=192**-0.5, block_kv=128, steps=2)
    _check(o, lse, q, k, v, cu, 192**-0.5)


def test_one_prompt_of_whole_tiles_takes_the_reshaped_layout(rng):
    """A prompt of exactly two query tiles (2 x 2 x 64 rows): no padding, the layout is a reshape
    in and out (`PrefillLayout.dense`), and the output rows land where the packed rows were."""
    q, k, v, cu = _inputs(rng, [256], 2, 128, 64)
    o, lse = mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=128**-0.5, block_kv=64, steps=2)
    _check(o, lse, q, k, v, cu, 128**-0.5)


@pytest.mark.parametrize(
    "block_kv, steps, sms, tile_order",
    [(64, 2, 2, "heads"), (128, 3, 3, "heads"), (64, 3, 1, "heads"), (64, 2, 3, "q_tiles")],
)
def test_persistent_ctas_walk_many_tiles_on_one_ring(rng, block_kv, steps, sms, tile_order):
    """Persistent: a few CTAs take every tile (three sequences, two heads, query tiles of
    different causal lengths, page-granular prefixes), the K / V ring's slots and phases running
    on from one tile to the next, each warpgroup's queries reloaded into the buffer its last
    output left; every output and LSE as the reference's."""
    h, r, rope, nope, dv, page = 2, 32, 16, 112, 64, 64
    q, k, v, cu = _inputs(rng, [300, 70, 140], h, nope + rope, dv)
    prefix = None
    if block_kv == 64:  # cached prefixes of 1, 0 and 2 pages, from pages out of order
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
        prefix = LatentPrefix(
            f(5, page, r + rope).astype(jnp.bfloat16),
            jnp.asarray([[4, 0], [1, 0], [2, 3]], jnp.int32),
            jnp.asarray([64, 0, 128]),
            f(r, h, nope) * 0.2,
            f(r, h, dv) * 0.2,
        )
    o, lse = mla_prefill_hopper(
        q,
        k,
        v,
        cu_seqlens=cu,
        scale=0.125,
        prefix=prefix,
        block_kv=block_kv,
        steps=steps,
        persistent=True,
        sms=sms,
        tile_order=tile_order,
    )
    _check(o, lse, q, k, v, cu, 0.125, prefix)


def test_fresh_prefills_take_128_key_blocks_where_their_tiles_fit_shared_memory():
    """`kimik3.ops` runs fresh prefills with `prefill_block_kv`'s block: 128 at the model's qk 192
    / v 128 (213 KB, lowered for CUDA in test_mosaic_lowering), 64 where two slots of 128-key
    blocks would pass sm_90's 227 KB."""
    assert prefill_block_kv(192, 128) == 128
    assert prefill_block_kv(128, 64) == 128
    assert prefill_block_kv(256, 256) == 64
    assert prefill_block_kv(192, 128, steps=3) == 64


@pytest.mark.parametrize(
    "b, sq, h, lens, n_splits, block_kv, steps, p_slots",
    [
        (2, 2, 3, [200, 70], 4, 32, 2, 2),  # speculative rows; a split of the short sequence holds no keys
        (2, 2, 3, [200, 70], 4, 32, 2, 1),  # the same with one P slot (warpgroup 0 waits for its release)
        (1, 2, 40, [150], 1, 64, 3, 1),  # 80 rows: two 64-row blocks, 64-key tiles, a 3-slot ring
        (1, 2, 40, [150], None, None, 2, None),  # the defaults: 64-key tiles, splits that fill the SMs
        (1, 40, 3, [130], 2, 32, 2, None),  # a prefill chunk: the first row tile stops at key 112
    ],
)
def test_decode_equals_attention_on_the_gathered_pages(rng, b, sq, h, lens, n_splits, block_kv, steps, p_slots):
    inputs = _paged_decode_inputs(rng, b, sq, h, lens)
    o = _check_decode(inputs, n_splits=n_splits, block_kv=block_kv, steps=steps, p_slots=p_slots)
    assert o.shape == (b, sq, h, 128) and o.dtype == jnp.bfloat16


def _paged_decode_inputs(rng, b, sq, h, lens, n_pages=10, pages_per_seq=4, r=128, p=64, page=64):
    """bf16 latent pages [n_pages, page, r + p], a block table of distinct pages, queries
    q_latent [b, sq, h, r] / q_pe [b, sq, h, p], lengths: `mla_decode_hopper`'s arguments."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    pages = f(n_pages, page, r + p)
    table = jnp.asarray(rng.permutation(n_pages)[: b * pages_per_seq].reshape(b, pages_per_seq), jnp.int32)
    q_latent, q_pe = f(b, sq, h, r), f(b, sq, h, p)
    return q_latent, q_pe, pages, table, jnp.asarray(lens, jnp.int32)


def _check_decode(inputs, **decode_kw):
    """`mla_decode_hopper(*inputs, **decode_kw)` against the reference on the same inputs in fp32
    (outputs to bf16's rounding, LSE to fp32's); returns the outputs."""
    q_latent, q_pe, pages, table, seq_lens = inputs
    o, lse = mla_decode_hopper(*inputs, scale=0.1, **decode_kw)
    up = lambda x: x.astype(jnp.float32)
    o_ref, lse_ref = mla_decode_ref(up(q_latent), up(q_pe), up(pages), table, seq_lens, scale=0.1)
    np.testing.assert_allclose(up(o), o_ref, atol=O_ATOL, rtol=0)
    np.testing.assert_allclose(lse, lse_ref, atol=LSE_ATOL, rtol=0)
    return o


def test_row_tiles_in_cta_pairs_share_each_key_tile(rng):
    """`cluster=2`: 128 heads, the two row tiles of each query in one CTA cluster,
    each key tile multicast into both CTAs (Mosaic GPU's interpreter): the reference's outputs
    (3 and 2 key tiles: a split of one tile and one of none); refused where a pair's tiles
    would see different keys (96 heads)."""
    inputs = _paged_decode_inputs(rng, 2, 1, 128, [150, 65], n_pages=8, pages_per_seq=3)
    _check_decode(inputs, n_splits=2, cluster=2)
    q_latent, q_pe, pages, table, lens = inputs
    with pytest.raises(ValueError, match="cluster 2"):
        mla_decode_hopper(q_latent[:, :, :96], q_pe[:, :, :96], pages, table, lens, scale=0.1, cluster=2)


@pytest.mark.parametrize("persistent", [False, True])
def test_chunk_with_traced_prefix_lengths_of_any_value(rng, persistent):
    """A batch of chunks after prefixes of 37 (not a whole key block), 0 and 100 cached tokens,
    the lengths traced (a jitted serving step) == the packed reference; persistent: two CTAs
    over the three chunks' tiles, one ring."""
    import jax

    b, t, h, r, rope, nope, dv, page = 3, 20, 1, 32, 64, 64, 64, 32
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = f(b, t, h, nope + rope), f(b, t, h, nope + rope), f(b, t, h, dv)
    pages = f(14, page, r + rope)
    table = jnp.asarray(rng.permutation(14)[:12].reshape(b, 4), jnp.int32)
    w_kb, w_vb = f(r, h, nope) * 0.2, f(r, h, dv) * 0.2
    p_lens = jnp.asarray([37, 0, 100], jnp.int32)
    chunk = jax.jit(
        lambda lens: mla_prefill_chunk_hopper(
            q, k, v, LatentPrefix(pages, table, lens, w_kb, w_vb), scale=0.125, persistent=persistent, sms=2
        )
    )
    o, lse = chunk(p_lens)
    assert o.shape == (b, t, h, dv) and lse.shape == (b, t, h)
    pack = lambda x: x.reshape((b * t,) + x.shape[2:])
    _check(
        pack(o),
        pack(lse),
        pack(q),
        pack(k),
        pack(v),
        np.arange(b + 1) * t,
        0.125,
        LatentPrefix(pages, table, p_lens, w_kb, w_vb),
    )


class TestRefused:
    def test_prefix_not_a_whole_number_of_key_blocks(self, rng):
        q, k, v, cu = _inputs(rng, [10], 1, 64, 64)
        pre = LatentPrefix(
            jnp.zeros((2, 64, 48), jnp.bfloat16),
            jnp.asarray([[0]], jnp.int32),
            jnp.asarray([40]),
            jnp.zeros((32, 1, 48)),
            jnp.zeros((32, 1, 64)),
        )
        assert not supports(64, 64, [40])
        with pytest.raises(ValueError, match="multiples of block_kv"):
            mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=0.1, prefix=pre)

    def test_decode_dims(self, rng):
        pages = jnp.zeros((4, 64, 96 + 64), jnp.bfloat16)
        args = (
            jnp.zeros((1, 1, 2, 96), jnp.bfloat16),
            jnp.zeros((1, 1, 2, 64), jnp.bfloat16),
            pages,
            jnp.zeros((1, 2), jnp.int32),
            jnp.asarray([10], jnp.int32),
        )
        with pytest.raises(ValueError, match="kv_lora % 128"):
            mla_decode_hopper(*args, scale=0.1)
        for scale in (0.0, -0.1):  # the max is taken unscaled
            with pytest.raises(ValueError, match="scale must be positive"):
                mla_decode_hopper(*args, scale=scale)

    def test_decode_ring_over_shared_memory(self, rng):
        pages = jnp.zeros((4, 64, 512 + 64), jnp.bfloat16)
        args = (
            jnp.zeros((1, 1, 2, 512), jnp.bfloat16),
            jnp.zeros((1, 1, 2, 64), jnp.bfloat16),
            pages,
            jnp.zeros((1, 2), jnp.int32),
            jnp.asarray([10], jnp.int32),
        )
        with pytest.raises(ValueError, match="shared memory"):
            mla_decode_hopper(*args, scale=0.1, block_kv=64, steps=3)

    def test_unknown_tile_order(self, rng):
        q, k, v, cu = _inputs(rng, [64], 1, 64, 64)
        with pytest.raises(ValueError, match="tile_order"):
            mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=0.1, tile_order="seqs")

    def test_head_dims_and_dtypes(self, rng):
        q, k, v, cu = _inputs(rng, [10], 1, 96, 64)
        with pytest.raises(ValueError, match="multiples of 64"):
            mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=0.1)
        q, k, v, cu = _inputs(rng, [10], 1, 64, 64)
        with pytest.raises(ValueError, match="16-bit"):
            mla_prefill_hopper(q.astype(jnp.float32), k, v, cu_seqlens=cu, scale=0.1)


# Lowering for CUDA runs Mosaic GPU's own checks (layout inference, wgmma operand swizzles,
# shared-memory size) on this CPU machine: what the interpreter does not check.
def _lowers_for_cuda(fn, *shapes):
    import jax

    jax.jit(fn).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("block_kv, steps", [(64, 2), (64, 3), (128, 2)])
def test_prefill_lowers_for_hopper_at_the_model_dims(block_kv, steps):
    """qk 192, v 128, a CTA per tile and persistent.  128-key blocks with two slots fit 227 KiB
    because each compute warpgroup's output tile shares its query tile's buffer; three such
    slots do not."""
    from pallas_kernels import mla_hopper

    n, lq, h, lp = 2, 256, 2, block_kv
    shapes = (
        ((n, lq, h, 192), jnp.bfloat16),
        ((n, lp + lq, h, 192), jnp.bfloat16),
        ((n, lp + lq, h, 128), jnp.bfloat16),
        ((n,), jnp.int32),
    )
    core = lambda prefix_blocks, steps, n_ctas=0, q_first=False: (
        lambda q, k, v, n_p: mla_hopper._hopper_core(
            q,
            k,
            v,
            n_p,
            block_q=64,
            block_kv=block_kv,
            steps=steps,
            prefix_blocks=prefix_blocks,
            lp_blocks=1,
            scale_log2=0.1,
            interpret=False,
            n_ctas=n_ctas,
            q_tiles_first=q_first,
        )
    )
    for prefix_blocks in ((1, 0), None):  # static whole blocks; lengths read by the kernel
        _lowers_for_cuda(core(prefix_blocks, steps), *shapes)
        _lowers_for_cuda(core(prefix_blocks, steps, n_ctas=3), *shapes)  # persistent: 3 CTAs, 8 tiles
    _lowers_for_cuda(core(None, steps, q_first=True), *shapes)  # a head's q tiles launched together
    _lowers_for_cuda(core(None, steps, n_ctas=3, q_first=True), *shapes)
    if block_kv == 128:
        with pytest.raises(ValueError, match="shared memory"):
            _lowers_for_cuda(core(None, 3), *shapes)


@pytest.mark.parametrize(
    "block_kv, steps, stall_ns, cluster",
    [(32, 2, 0, 1), (32, 3, 0, 1), (64, 2, 0, 1), (64, 3, 0, 1), (64, 2, 2000, 1), (64, 2, 0, 2)],
)
def test_decode_lowers_for_hopper_at_full_scale_dims(block_kv, steps, stall_ns, cluster):
    """kv_lora 512 + rope 64, 96 heads; block_kv 64 fits with one P slot and two steps, not
    three (refused by the wrapper first); `decode_smem_bytes` counts as Mosaic GPU does.  The
    GPU suite's stalled kernel (warpgroup 1 sleeps before each P @ V) lowers too, and so do
    row tiles in CTA pairs (cluster 2: 128 heads, key tiles multicast)."""
    from pallas_kernels import hopper_ring, mla_decode_hopper as mla_hopper

    b, h, r, p, page = 2, 128 if cluster > 1 else 96, 512, 64, 64
    p_slots = 2 if mla_hopper.decode_smem_bytes(r + p, block_kv, steps, 2) <= hopper_ring.SMEM_BYTES else 1
    fits = mla_hopper.decode_smem_bytes(r + p, block_kv, steps, p_slots) <= hopper_ring.SMEM_BYTES
    assert (fits, p_slots) == (
        {(32, 2): (True, 2), (32, 3): (True, 2), (64, 2): (True, 1), (64, 3): (False, 1)}[block_kv, steps]
    )
    lower = lambda: _lowers_for_cuda(
        lambda bt, sl, q, qp, pg: mla_hopper._decode_core(
            bt,
            sl,
            q,
            qp,
            pg,
            n_heads=h,
            n_queries=1,
            rank=r,
            block_kv=block_kv,
            steps=steps,
            p_slots=p_slots,
            n_splits=2,
            scale_log2=0.1,
            interpret=False,
            stall_ns=stall_ns,
            cluster=cluster,
        ),
        ((b, 8), jnp.int32),
        ((b,), jnp.int32),
        ((b, 128, r), jnp.bfloat16),
        ((b, 128, p), jnp.bfloat16),
        ((32, page, r + p), jnp.bfloat16),
    )
    if fits:
        lower()
    else:
        with pytest.raises(Exception, match="shared memory"):
            lower()


@pytest.mark.parametrize(
    "row_tiles, max_keys, want",
    [
        (32, 8192, 4),  # H96 B16: 128 CTAs, one wave
        (48, 8192, 5),  # 192 rows x B16: 240 CTAs fill two waves 91%; 2 splits would leave 36 SMs idle
        (128, 8192, 1),  # H128 B64: the batch fills the GPU
        (2, 32768, 60),  # B1: 120 CTAs of ~546 keys
        (2, 1024, 4),  # a short context keeps >= 4 key tiles per split
    ],
)
def test_decode_splits_fill_the_sms_in_whole_waves(row_tiles, max_keys, want):
    from pallas_kernels.mla_decode_hopper import decode_splits

    assert decode_splits(row_tiles, max_keys, 64) == want


def test_the_gpu_suites_p_slot_mutant_still_applies():
    """tests/gpu's mutation check edits the decode kernel's source; a refactor that moves the
    edited lines must update it, not silently leave it testing nothing."""
    from tests.gpu.test_hopper_kernels import _READ, _RELEASE, mutant_source

    mutant = mutant_source()
    assert _RELEASE + _READ in mutant and _READ + _RELEASE not in mutant


def test_one_splits_rows_are_what_the_merge_would_give(rng):
    """`mla_decode_hopper` returns a single split's rows as they are (no merge launch): the merge
    of one split (`merge_splits`, kernel and reference) gives those rows bit for bit, a row with
    no keys (zeros, lse -inf) included."""
    from pallas_kernels.mla import merge_splits, merge_splits_ref

    b, sq, h, r = 2, 1, 64, 128
    o_part = jnp.asarray(rng.standard_normal((b, 1, 64, r)), jnp.bfloat16)
    lse_part = jnp.asarray(rng.standard_normal((b, 1, 64)) * 5, jnp.float32)
    o_part, lse_part = o_part.at[1, 0, 3].set(0), lse_part.at[1, 0, 3].set(-jnp.inf)
    for o, lse in (
        merge_splits(o_part, lse_part, (b, sq, h, r), jnp.bfloat16, kernel=True),
        merge_splits_ref(o_part, lse_part, (b, sq, h, r), jnp.bfloat16),
    ):
        np.testing.assert_array_equal(
            np.asarray(o, np.float32), np.asarray(o_part[:, 0].reshape(b, sq, h, r), np.float32)
        )
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_part[:, 0].reshape(b, sq, h)))
