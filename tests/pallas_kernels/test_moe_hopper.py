"""The Hopper grouped expert GEMM (`pallas_kernels.moe_hopper`): its arithmetic in Mosaic GPU's
interpret mode on this CPU (TMA copies, the warp-specialized pipeline, wgmma and the persistent
loop simulated), its CUDA lowering at the model's shapes, and the choice `kimik3.ops` makes.
The compiled body runs on the GPU: tests/gpu/test_moe_hopper.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import ops
from kimik3.layers.moe import _SituGLU, _experts_sorted
from pallas_kernels import moe, moe_hopper, moe_layout, mxfp4

S = jax.ShapeDtypeStruct
ACT = _SituGLU((8.0, 8.0))
BF16_ULP = 2.0**-8  # a bf16's rounding, relative


def _operands(seed, m, k, n, g, empty=(1,)):
    """bf16 rows and weights of O(1) outputs, and group sizes summing to at most m (groups in
    `empty` get no rows; the last rows belong to no group)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    cuts = np.sort(np.asarray(jax.random.randint(keys[2], (g,), 0, m - m // 8)))
    sizes = np.diff(np.concatenate([[0], cuts])).astype(np.int32)
    for e in empty:
        sizes[e] = 0
    return x, w, jnp.asarray(sizes)


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _layout(x, sizes, g, block_m):
    m = x.shape[0]
    n_tiles = moe_layout.layout_tiles(m, g, block_m)
    dest, tile_group = moe_layout.padded_layout(sizes, m, block_m, n_tiles)
    x_pad = (
        jnp.zeros((n_tiles * block_m, x.shape[1]), x.dtype)
        .at[jnp.where(dest >= 0, dest, n_tiles * block_m)]
        .set(x, mode="drop")
    )
    return dest, tile_group, x_pad


@pytest.mark.parametrize(
    "tiling, layout",
    [
        (moe_hopper.HopperTiling(tile_m=64, tile_n=64, steps=2, grid_width=2), "ragged"),
        (moe_hopper.HopperTiling(tile_m=128, tile_n=128, steps=3, grid_width=1, m_minor=False), "ragged"),
        (moe_hopper.HopperTiling(tile_m=64, tile_n=64, tile_k=128, steps=2, grid_width=4), "padded"),
    ],
)
def test_grouped_matmul_equals_the_reference(tiling, layout):
    """Fresh random rows over 4 groups (one empty, some rows in none), M not a multiple of the
    row tile: every row is its group's product rounded once to bf16 (fp32 accumulation in
    another order: at most one bf16 rounding apart), rows past the groups are 0; a few CTAs
    loop over many work items.  Ragged: blocks two groups share are stored row-exactly by each."""
    x, w, sizes = _operands(0, 300, 256, 256, 4)
    block_m = 128
    got = moe_hopper.grouped_matmul(x, w, sizes, layout=layout, block_m=block_m, tiling=tiling, sms=3, interpret=True)
    ref = np.asarray(moe.grouped_matmul_ref(x.astype(jnp.float32), w.astype(jnp.float32), sizes))
    np.testing.assert_allclose(_f32(got), ref, rtol=2 * BF16_ULP, atol=1e-6)
    assert np.mean(_f32(got) == _f32(jnp.asarray(ref).astype(jnp.bfloat16))) > 0.99
    used = int(np.sum(np.asarray(sizes)))
    assert used < 300 and not np.any(_f32(got)[used:])


@pytest.mark.parametrize("tile_m, items_from", [(64, "kernel"), (128, "kernel"), (64, "table")])
def test_ragged_items_of_whole_tiles_and_of_a_few_rows_each_store_exactly_their_rows(tile_m, items_from, monkeypatch):
    """Groups whose items are whole tiles (stored through the swizzled 64-row epilogue), start
    off a multiple of 8 (the first item computes up to 7 rows of the group before and stores
    from lo), and end mid-tile (the power-of-two ladder): every row its group's product, each
    written once by its own group, the rows past the groups left 0.  The items found by the
    kernel from the group sizes, or (past `INKERNEL_GROUPS` groups) read from `ragged_work`'s
    table."""
    if items_from == "table":
        monkeypatch.setattr(moe_hopper, "INKERNEL_GROUPS", 2)
    x, w, _ = _operands(3, 640, 128, 256, 4)
    sizes = jnp.asarray([200, 0, 133, 260], jnp.int32)
    work = np.asarray(moe_hopper.ragged_work(sizes, 640, tile_m))
    items = work[:, work[0] >= 0]
    assert np.any(items[3] - items[2] == tile_m) and np.any(items[2] > 0) and np.any(items[3] - items[2] < tile_m)
    tiling = moe_hopper.HopperTiling(tile_m=tile_m, tile_n=64, steps=2, grid_width=2)
    got = moe_hopper.grouped_matmul(x, w, sizes, tiling=tiling, sms=4, interpret=True)
    ref = np.asarray(moe.grouped_matmul_ref(x.astype(jnp.float32), w.astype(jnp.float32), sizes))
    np.testing.assert_allclose(_f32(got), ref, rtol=2 * BF16_ULP, atol=1e-6)
    assert np.mean(_f32(got) == _f32(jnp.asarray(ref).astype(jnp.bfloat16))) > 0.99
    assert not np.any(_f32(got)[593:])


def test_the_ragged_work_table_covers_every_row_once():
    """`ragged_work`: items (group, first row, lo, hi) cover each group's rows exactly once; a
    group's items start at its first row rounded down to 8 and step by the row tile (the tiles
    the padded layout would give it: no block computed for two groups), within the static count
    cdiv(M + 7 G, tile) + G, whatever the sizes (empty groups, groups inside one tile, rows past
    the groups)."""
    rng = np.random.default_rng(5)
    for m, tile, sizes in [
        (300, 64, [0, 100, 0, 70, 96]),
        (128, 64, [128, 0]),
        (64, 64, [0, 0, 0, 1]),
        (1000, 128, list(rng.multinomial(900, np.ones(24) / 24))),
        (256, 64, [256]),
        (4000, 64, [1] * 60 + [3000]),
    ]:
        work = np.asarray(moe_hopper.ragged_work(jnp.asarray(sizes, jnp.int32), m, tile))
        assert work.shape == (4, -(-(m + 7 * len(sizes)) // tile) + len(sizes))
        owner = np.full(m, -1)
        items = work[:, work[0] >= 0]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        assert items.shape[1] == sum(-(-(starts[i + 1] - starts[i] // 8 * 8) // tile) for i, s in enumerate(sizes) if s)
        for group, row0, lo, hi in items.T:
            assert row0 % 8 == 0 and (row0 - starts[group] // 8 * 8) % tile == 0
            assert 0 <= lo < hi <= tile
            span = np.arange(row0 + lo, row0 + hi)
            assert np.all(owner[span] == -1)
            owner[span] = group
        assert np.array_equal(owner[: sum(sizes)], np.repeat(np.arange(len(sizes)), sizes))
        assert np.all(owner[sum(sizes) :] == -1)
        # zero_tail: the rows past the groups become group G's, stored (as zeros) exactly once
        tail = np.asarray(moe_hopper.ragged_work(jnp.asarray(sizes, jnp.int32), m, tile, zero_tail=True))
        assert tail.shape == (4, -(-(m + 7 * (len(sizes) + 1)) // tile) + len(sizes) + 1)
        owner = np.full(m, -1)
        for group, row0, lo, hi in tail[:, tail[0] >= 0].T:
            assert row0 % 8 == 0 and 0 <= lo < hi <= tile and np.all(owner[row0 + lo : row0 + hi] == -1)
            owner[row0 + lo : row0 + hi] = group
        assert np.array_equal(owner, np.repeat(np.arange(len(sizes) + 1), list(sizes) + [m - sum(sizes)]))


def test_the_kernels_own_work_items_are_the_tables():
    """`ragged_item` (the kernel's unrolled loop over the groups, here on a vector of items)
    gives every item `ragged_work`'s table holds, and no other."""
    rng = np.random.default_rng(9)
    for m, tile, sizes in [
        (300, 64, [0, 100, 0, 70, 96]),
        (64, 64, [0, 0, 0, 1]),
        (4000, 64, [1] * 60 + [3000]),
        (1000, 128, list(rng.multinomial(900, np.ones(24) / 24))),
    ]:
        for zero_tail in (False, True):
            table = np.asarray(moe_hopper.ragged_work(jnp.asarray(sizes, jnp.int32), m, tile, zero_tail=zero_tail))
            item = jnp.arange(table.shape[1], dtype=jnp.int32)
            sz = jnp.asarray(sizes, jnp.int32)
            got = np.stack(
                [
                    np.asarray(a)
                    for a in moe_hopper.ragged_item(lambda i: sz[i], len(sizes), m, tile, item, zero_tail=zero_tail)
                ]
            )
            assert np.array_equal(got[0], table[0])
            valid = table[0] >= 0
            assert np.array_equal(got[:, valid], table[:, valid])


def test_ops_grouped_matmul_takes_the_hopper_kernel_where_asked(monkeypatch):
    """`KIMIK3_MOE_GMM=hopper` with the Pallas kernels: rows sorted by expert through one grouped
    GEMM per projection (`_experts_sorted`, a checkpoint without fused gate/up) run on the ragged
    Hopper kernel (the interpreter here) and equal the reference path."""
    monkeypatch.setenv("KIMIK3_MOE_GMM", "hopper")
    n, top_k, l, f, e = 48, 2, 128, 128, 4
    keys = jax.random.split(jax.random.key(6), 5)
    x = jax.random.normal(keys[0], (n, l), jnp.float32).astype(jnp.bfloat16)
    w_g, w_u = ((jax.random.normal(kk, (e, l, f), jnp.float32) / np.sqrt(l)).astype(jnp.bfloat16) for kk in keys[1:3])
    w_out = (jax.random.normal(keys[3], (e, f, l), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
    ids = jax.random.randint(keys[4], (n, top_k), 0, e + 1).astype(jnp.int32)
    calls = []
    real = moe_hopper.grouped_matmul
    monkeypatch.setattr(moe_hopper, "grouped_matmul", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    got = _f32(_experts_sorted(x, ids, w_g, w_u, w_out, ACT.caps, kernels="pallas"))
    ref = _f32(_experts_sorted(x, ids, w_g, w_u, w_out, ACT.caps, kernels="reference"))
    assert len(calls) == 3  # gate, up, down
    np.testing.assert_allclose(got, ref, rtol=4 * BF16_ULP, atol=4 * BF16_ULP * np.max(np.abs(ref)))


def test_the_activation_runs_in_the_gate_up_epilogue():
    """With act, weights gate ++ up [G, K, 2F] give act(gate, up) [.., F]: each half rounded to
    bf16 before the activation (what the unfused path reads), the result rounded once more."""
    x, w, sizes = _operands(1, 200, 128, 256, 3)
    block_m = 128
    dest, tile_group, x_pad = _layout(x, sizes, 3, block_m)
    out = moe_hopper.gmm_padded(
        tile_group,
        x_pad,
        w,
        block_m,
        act=ACT,
        tiling=moe_hopper.HopperTiling(tile_n=64, steps=2),
        sms=2,
        interpret=True,
    )
    assert out.shape == (x_pad.shape[0], 128)
    h = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    ref = _f32(ACT(h[:, :128].astype(jnp.float32), h[:, 128:].astype(jnp.float32)).astype(jnp.bfloat16))
    used = int(np.sum(np.asarray(sizes)))
    got = _f32(out)[np.asarray(dest)[:used]]
    # a gate or up value rounding the other way moves act by about one of its ulps
    np.testing.assert_allclose(got, ref[:used], rtol=4 * BF16_ULP, atol=1e-3)
    assert np.mean(got == ref[:used]) > 0.99


def test_grouped_ffn_on_the_hopper_kernels_equals_the_triton_path_and_the_sorted_reference():
    """`moe.grouped_ffn(impl="hopper")`: both GEMMs on the Hopper kernels, tokens routed to two
    experts each, some to none (id E): the same outputs as the Triton kernels and as rows sorted
    by expert through one grouped GEMM per projection, within bf16 roundings."""
    n, top_k, l, f, e = 96, 2, 128, 128, 4
    keys = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(keys[0], (n, l), jnp.float32).astype(jnp.bfloat16)
    w_gu = (jax.random.normal(keys[1], (e, l, 2 * f), jnp.float32) / np.sqrt(l)).astype(jnp.bfloat16)
    w_out = (jax.random.normal(keys[2], (e, f, l), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
    ids = jax.random.randint(keys[3], (n, top_k), 0, e + 1).astype(jnp.int32)
    hopper = _f32(moe.grouped_ffn(x, ids, w_gu, w_out, act=ACT, impl="hopper", interpret=True))
    triton = _f32(moe.grouped_ffn(x, ids, w_gu, w_out, act=ACT, interpret=True))
    with pytest.MonkeyPatch.context() as mp:  # the model's entry: `kimik3.ops` picks the kernels
        mp.setenv("KIMIK3_MOE_GMM", "hopper")
        mp.setenv("KIMIK3_KERNELS", "pallas")
        assert ops.grouped_ffn_fits(x, w_gu, w_out)
        np.testing.assert_array_equal(_f32(ops.grouped_ffn(x, ids, w_gu, w_out, ACT)), hopper)
    ref = _f32(_experts_sorted(x, ids, w_gu, None, w_out, ACT.caps, kernels="reference"))
    scale = np.max(np.abs(ref))
    for got in (hopper, triton):
        np.testing.assert_allclose(got, ref, rtol=4 * BF16_ULP, atol=4 * BF16_ULP * scale)
    assert np.mean(hopper == triton) > 0.99
    assert not np.any(hopper[np.asarray(ids) == e])
    with pytest.raises(ValueError, match="impl must be"):
        moe.grouped_ffn(x, ids, w_gu, w_out, act=ACT, impl="cutlass")


def test_bad_operands_are_named_before_any_launch():
    x, w, sizes = _operands(3, 128, 128, 256, 2, empty=())
    tg = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="16-bit rows"):
        moe_hopper.gmm_padded(tg, x.astype(jnp.float32), w, 128)
    with pytest.raises(ValueError, match=r"\[G, K=128, N\]"):
        moe_hopper.gmm_padded(tg, x, w[:, :64], 128)
    with pytest.raises(ValueError, match="must divide"):
        moe_hopper.gmm_padded(tg, x, w[..., :192], 128)
    with pytest.raises(ValueError, match="must divide"):
        moe_hopper.gmm_padded(tg, x, w, 128, tiling=moe_hopper.HopperTiling(tile_m=256))
    with pytest.raises(ValueError, match="tile_group"):
        moe_hopper.gmm_padded(jnp.zeros((2,), jnp.int32), x, w, 128)
    with pytest.raises(ValueError, match="odd"):
        moe_hopper.gmm_padded(tg, x, jnp.zeros((2, 128, 257), jnp.bfloat16), 128, act=ACT)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe.grouped_ffn(
            x,
            jnp.zeros((128, 1), jnp.int32),
            jnp.zeros((2, 128, 192), jnp.bfloat16),
            jnp.zeros((2, 96, 128), jnp.bfloat16),
            act=ACT,
            impl="hopper",
        )


# (L, F, experts, assignments): `small`'s prefill chunk of 2048 tokens x 4, a full-scale EP rank's
# 16384 assignments over 24 experts (K1024 N2048: latent 1024, F 1024)
SHAPES = [(768, 768, 32, 8192), (1024, 1024, 24, 16384)]


@pytest.mark.parametrize("l, f, e, assignments", SHAPES)
def test_lowers_for_hopper_at_the_model_shapes(l, f, e, assignments):
    """Mosaic GPU's own checks run here, on the CPU: layouts, swizzles, and shared memory (the
    default tilings' pipelines and epilogue buffers fit 227 KiB; a deeper one is refused by name)."""
    block_m = 128
    rows = moe_layout.layout_tiles(assignments, e, block_m) * block_m
    for w_shape, act in (((e, l, 2 * f), ACT), ((e, f, l), None)):
        fn = lambda tg, x, w: moe_hopper.gmm_padded(tg, x, w, block_m, act=act)
        jax.jit(fn).trace(
            S((rows // block_m,), jnp.int32), S((rows, w_shape[1]), jnp.bfloat16), S(w_shape, jnp.bfloat16)
        ).lower(lowering_platforms=("cuda",))
    for w_shape, act in (((e, l, 2 * f), ACT), ((e, f, l), None)):  # rows sorted by expert, as they are
        fn = lambda x, w, sizes: moe_hopper.gmm_ragged(x, w, sizes, act=act)
        jax.jit(fn).trace(
            S((assignments, w_shape[1]), jnp.bfloat16), S(w_shape, jnp.bfloat16), S((e,), jnp.int32)
        ).lower(lowering_platforms=("cuda",))
    deep = lambda tg, x, w: moe_hopper.gmm_padded(tg, x, w, block_m, tiling=moe_hopper.HopperTiling(steps=8))
    with pytest.raises(ValueError, match="shared memory"):
        jax.jit(deep).trace(
            S((rows // block_m,), jnp.int32), S((rows, f), jnp.bfloat16), S((e, f, l), jnp.bfloat16)
        ).lower(lowering_platforms=("cuda",))


def test_ops_chooses_the_hopper_kernels_only_where_asked_and_where_they_fit(monkeypatch):
    """`KIMIK3_MOE_GMM`: "auto" (the default) on compute capability 9.x from
    HOPPER_MOE_MIN_ASSIGNMENTS assignments; "triton" always; "hopper" wherever the dims and dtype
    fit; MXFP4 experts
    and dims the Hopper tiles do not divide stay on Triton."""
    bf = jnp.bfloat16
    w_gu, w_down = jnp.zeros((32, 768, 1536), bf), jnp.zeros((32, 768, 768), bf)
    dense = ((w_gu, True), (w_down, False))
    many, few = ops.HOPPER_MOE_MIN_ASSIGNMENTS, ops.HOPPER_MOE_MIN_ASSIGNMENTS - 1
    monkeypatch.delenv("KIMIK3_MOE_GMM", raising=False)
    assert ops.moe_gmm_impl(bf, dense, many, "9.0") == "hopper"
    assert ops.moe_gmm_impl(bf, dense, few, "9.0") == "triton"
    monkeypatch.setenv("KIMIK3_MOE_GMM", "triton")
    assert ops.moe_gmm_impl(bf, dense, many, "9.0") == "triton"
    monkeypatch.setenv("KIMIK3_MOE_GMM", "auto")
    assert ops.moe_gmm_impl(bf, dense, many, "9.0") == "hopper"
    assert ops.moe_gmm_impl(bf, dense, few, "9.0") == "triton"
    assert ops.moe_gmm_impl(bf, dense, many, "8.0") == "triton"
    assert ops.moe_gmm_impl(bf, dense, many, None) == "triton"
    assert ops.moe_gmm_impl(jnp.float32, dense, many, "9.0") == "triton"
    odd = ((jnp.zeros((8, 96, 192), bf), True), (jnp.zeros((8, 96, 96), bf), False))
    assert ops.moe_gmm_impl(bf, odd, many, "9.0") == "triton"
    assert ops.moe_gmm_impl(bf, ((w_down, False),), many, "9.0") == "hopper"  # one GEMM, no activation
    assert ops.moe_gmm_impl(bf, ((jnp.zeros((32, 768, 1400), bf), False),), many, "9.0") == "triton"  # N % 128
    packed = mxfp4.PackedMXFP4(jnp.zeros((32, 768, 768), jnp.uint8), jnp.zeros((32, 24, 1536), jnp.float8_e8m0fnu))
    assert ops.moe_gmm_impl(bf, ((packed, True), (w_down, False)), many, "9.0") == "triton"
    monkeypatch.setenv("KIMIK3_MOE_GMM", "hopper")
    assert ops.moe_gmm_impl(bf, dense, few, None) == "hopper"  # the interpreter, off the GPU
    assert ops.moe_gmm_impl(bf, dense, many, "8.0") == "triton"  # no wgmma before Hopper
    monkeypatch.setenv("KIMIK3_MOE_GMM", "cutlass")
    with pytest.raises(ValueError, match="KIMIK3_MOE_GMM"):
        ops.moe_gmm_impl(bf, dense, many, "9.0")
