"""The Pallas grouped expert GEMM (interpret mode on CPU) equals `lax.ragged_dot`.

Interpret mode fills outputs with NaN before the kernel runs, so finite results
prove every tile was written, the empty ones past the last group included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe as moe_module, moe_layout
from pallas_kernels.moe import GATHER_ROWS_PER_GROUP, grouped_matmul, grouped_matmul_ref


def _groups(rng, m, g, empty=(1,)):
    sizes = rng.multinomial(m, np.ones(g) / g)
    for e in empty:  # some experts get no rows at all
        sizes[(e + 1) % g] += sizes[e]
        sizes[e] = 0
    return jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize(
    "m, k, n, g, dtype, block_m",
    [
        (37, 32, 48, 8, jnp.float32, None),  # decode-like: a few rows per expert, N not a multiple of 32
        (300, 64, 128, 5, jnp.bfloat16, None),  # bf16 operands, fp32 accumulation
        (700, 96, 32, 6, jnp.float32, None),  # M > 512: 64-row tiles; K by 32-wide steps
        (5, 16, 16, 4, jnp.float32, 16),  # fewer rows than experts
    ],
)
def test_grouped_matmul_equals_ragged_dot(rng, m, k, n, g, dtype, block_m):
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / k**0.5, dtype)
    sizes = _groups(rng, m, g)
    out = grouped_matmul(lhs, rhs, sizes, block_m=block_m)
    ref = grouped_matmul_ref(lhs, rhs, sizes)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of the output
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "m, g, dtype, short",
    [
        (5, 4, jnp.float32, 0),  # fewer rows than groups: the gather form
        (16, 8, jnp.float32, 3),  # M = 2G, three rows past the groups' sum
        (32, 32, jnp.bfloat16, 0),  # a decode step's B8 x top-4 over 32 experts, bf16 weights
        (40, 8, jnp.float32, 5),  # M > GATHER_ROWS_PER_GROUP * G: lax.ragged_dot itself
    ],
)
@pytest.mark.parametrize("gather_bytes_limit", [None, 0])  # 0: the few rows one by one, never gathered
def test_reference_is_ragged_dot_in_both_forms(rng, m, g, dtype, short, gather_bytes_limit, monkeypatch):
    """The reference's three forms (gathered weights for a few rows, or one row at a time where
    that copy would be large; `lax.ragged_dot` past them) compute ragged_dot's rows: row r times
    its group's weights, zero past the groups' sum."""
    if gather_bytes_limit is not None:
        monkeypatch.setattr(moe_module, "GATHER_BYTES_LIMIT", gather_bytes_limit)
    k, n = 24, 40
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / k**0.5, dtype)
    sizes = np.asarray(_groups(rng, m - short, g))
    want = jax.lax.ragged_dot(
        lhs, rhs, jnp.asarray(sizes), preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    ).astype(dtype)
    got = grouped_matmul_ref(lhs, rhs, jnp.asarray(sizes))
    assert got.shape == (m, n) and got.dtype == dtype
    assert (m <= GATHER_ROWS_PER_GROUP * g) == (m != 40)  # the cases cover both forms
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of the output
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    assert (np.asarray(got)[m - short :] == 0).all()
    row_group = np.repeat(np.arange(g), sizes)  # and row by row, with numpy's own matmul
    mine = np.stack(
        [np.asarray(lhs[r], np.float32) @ np.asarray(rhs[row_group[r]], np.float32) for r in range(m - short)]
    )
    np.testing.assert_allclose(np.asarray(got[: m - short], np.float32), mine, atol=5 * tol, rtol=5 * tol)


def test_rows_past_the_groups_sum_are_zero(rng):
    lhs = jnp.asarray(rng.standard_normal((20, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 16, 16)), jnp.float32)
    sizes = jnp.asarray([4, 0, 9], jnp.int32)  # 13 of 20 rows belong to a group
    out = np.asarray(grouped_matmul(lhs, rhs, sizes))
    np.testing.assert_allclose(out, np.asarray(grouped_matmul_ref(lhs, rhs, sizes)), atol=1e-5, rtol=1e-5)
    assert (out[13:] == 0).all()


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, sizes_shape, dtype2, match",
    [
        ((8, 16), (2, 32, 16), (2,), jnp.float32, "do not match"),
        ((8, 16), (2, 16, 16), (3,), jnp.float32, "do not match"),
        ((8, 16), (2, 16, 16), (2,), jnp.bfloat16, "share a dtype"),
        ((8, 24), (2, 24, 16), (2,), jnp.float32, "multiples of 16"),
    ],
)
def test_bad_shapes_are_refused_before_launch(lhs_shape, rhs_shape, sizes_shape, dtype2, match):
    with pytest.raises(ValueError, match=match):
        grouped_matmul(jnp.ones(lhs_shape, jnp.float32), jnp.ones(rhs_shape, dtype2), jnp.ones(sizes_shape, jnp.int32))


# ---- grouped_ffn: both expert GEMMs and the activation in one layout ------------------------------
def _silu_glu(gate, up):  # act(0, 0) == 0, as grouped_ffn requires
    return (gate * (1 / (1 + jnp.exp(-gate))) * up).astype(gate.dtype)


def _ffn_ref(x, ids, w_gateup, w_out):
    """Per (row, slot): expert ids[n, j]'s FFN of row n, in fp32 numpy."""
    x, w_gateup, w_out = (np.asarray(a, np.float64) for a in (x, w_gateup, w_out))
    f = w_out.shape[1]
    out = np.zeros(ids.shape + (x.shape[1],))
    for n in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            h = x[n] @ w_gateup[ids[n, j]]
            g, u = h[:f], h[f:]
            out[n, j] = (g / (1 + np.exp(-g)) * u) @ w_out[ids[n, j]]
    return out


def _rank_path(monkeypatch, path):
    """Force assignment_layout's rank path: 'pairwise' (a decode step's few assignments),
    'onehot' (a running count), 'sort' (large batches)."""
    if path != "pairwise":
        monkeypatch.setattr(moe_layout, "PAIRWISE_LIMIT", 0)
    if path == "sort":
        monkeypatch.setattr(moe_layout, "_ONE_HOT_RANK_LIMIT", 0)


@pytest.mark.parametrize(
    "n, k, e, path",
    [
        (32, 4, 8, "pairwise"),  # a decode step
        (32, 4, 8, "onehot"),
        (9, 2, 6, "pairwise"),  # fewer rows than experts, some experts idle
        (40, 3, 5, "sort"),  # the path large batches take
    ],
)
def test_grouped_ffn_equals_each_expert_applied_to_its_rows(rng, monkeypatch, n, k, e, path):
    from pallas_kernels import moe

    _rank_path(monkeypatch, path)
    l, f = 32, 16
    x = jnp.asarray(rng.standard_normal((n, l)), jnp.float32)
    ids = np.stack([rng.choice(e - 1, k, replace=False) for _ in range(n)]).astype(np.int32)  # expert e-1 idle
    w_gateup = jnp.asarray(rng.standard_normal((e, l, 2 * f)) / l**0.5, jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((e, f, l)) / f**0.5, jnp.float32)
    y = moe.grouped_ffn(x, jnp.asarray(ids), w_gateup, w_out, act=_silu_glu)
    assert y.shape == (n, k, l) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), _ffn_ref(x, ids, w_gateup, w_out), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["pairwise", "onehot", "sort"])
def test_assignment_layout_puts_each_assignment_in_its_experts_tiles_in_order(rng, monkeypatch, path):
    from pallas_kernels import moe

    _rank_path(monkeypatch, path)
    ids = jnp.asarray(rng.integers(0, 5, 60), jnp.int32)
    dest, tile_group, n_tiles = moe.assignment_layout(ids, 7, 8)  # experts 5 and 6 idle
    dest, tile_group, ids = np.asarray(dest), np.asarray(tile_group), np.asarray(ids)
    assert len(set(dest.tolist())) == 60 and dest.max() < n_tiles * 8 and tile_group.shape == (n_tiles,)
    assert (tile_group[dest // 8] == ids).all()  # every row sits in a tile of its own expert
    for expert in range(5):  # an expert's assignments keep their order, packed from its first tile
        rows = dest[ids == expert]
        assert (np.diff(rows) == 1).all() and rows[0] % 8 == 0
    assert set(tile_group[tile_group >= 0].tolist()) == set(range(5))


@pytest.mark.parametrize("m, g, block_m, short", [(300, 8, 64, 0), (37, 5, 16, 9), (200, 4, 128, 200)])
def test_the_layouts_source_map_is_the_inverse_of_its_dest(rng, m, g, block_m, short):
    """The layout is filled by gathering through `layout_sources`: each layout row takes the
    sorted row whose dest it is, and rows no sorted row goes to (empty experts, a last tile's
    tail, rows past the groups' sum: `short` of them with dest -1, all when short = m) take
    none."""
    sizes = np.asarray(_groups(rng, m - short, g, empty=(1, 2))) if short < m else np.zeros(g, np.int32)
    n_tiles = moe_layout.layout_tiles(m, g, block_m)
    dest, _ = moe_layout.padded_layout(jnp.asarray(sizes), m, block_m, n_tiles)
    src = np.asarray(moe_layout.layout_sources(dest, n_tiles * block_m))
    want = np.full(n_tiles * block_m, m)
    dest = np.asarray(dest)
    want[dest[dest >= 0]] = np.arange(m)[dest >= 0]
    np.testing.assert_array_equal(src, want)
    assert np.sum(src < m) == np.sum(sizes)


@pytest.mark.parametrize("m, g, block_m", [(8, 32, 8), (5, 384, 16), (32, 32, 8), (1, 4, 64)])
def test_few_rows_over_many_groups_take_as_many_tiles_as_rows_need_not_as_groups(rng, m, g, block_m):
    """A decode step's few rows over many experts: the layout has cdiv(M + min(G, M) (block_m -
    1), block_m) tiles (not one per expert), and still every row a slot of its own in its
    group's tiles, even when each row sits in a group of its own (the most tiles rows can
    take) or all in one."""
    n_tiles = moe_layout.layout_tiles(m, g, block_m)
    assert n_tiles == -(-(m + min(g, m) * (block_m - 1)) // block_m) <= -(-(m + g * (block_m - 1)) // block_m)
    spread = np.zeros(g, np.int32)
    spread[rng.permutation(g)[:m]] = 1  # each row its own group
    for sizes in (
        spread,
        np.bincount(np.zeros(m, int), minlength=g).astype(np.int32),
        np.bincount(rng.integers(0, g, m), minlength=g).astype(np.int32),
    ):
        dest, tile_group = (np.asarray(a) for a in moe_layout.padded_layout(jnp.asarray(sizes), m, block_m, n_tiles))
        assert dest.min() >= 0 and dest.max() < n_tiles * block_m and len(set(dest.tolist())) == m
        groups = np.repeat(np.arange(g), sizes)
        assert np.array_equal(tile_group[dest // block_m], groups)


@pytest.mark.parametrize("n", [1, 7, 32, 1500])  # 1500: past PAIRWISE_LIMIT, XLA's cumsum
def test_running_sum_is_cumsum(rng, n):
    x = rng.integers(0, 50, n).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(moe_layout.running_sum(jnp.asarray(x))), np.cumsum(x))


def test_grouped_ffn_tiling_must_divide_the_dims():
    from pallas_kernels import moe

    x, ids = jnp.ones((4, 32), jnp.float32), jnp.zeros((4, 2), jnp.int32)
    w_gateup, w_out = jnp.ones((3, 32, 64), jnp.float32), jnp.ones((3, 32, 32), jnp.float32)
    with pytest.raises(ValueError, match="block_n 48"):
        moe.grouped_ffn(x, ids, w_gateup, w_out, act=_silu_glu, tiling=((48, 32, 4, 3), None))


@pytest.mark.parametrize("path", ["pairwise", "onehot", "sort"])
def test_grouped_ffn_gives_an_assignment_to_no_expert_zero_and_leaves_the_rest(rng, monkeypatch, path):
    """Expert id E (a padding token, `LatentMoE(real_bt=)`) is in no group: its output is 0 and
    the other assignments' outputs are what they would be without it."""
    from pallas_kernels import moe

    _rank_path(monkeypatch, path)
    _check_assignments_to_no_expert(rng, moe, n=12, k=2, e=4, rows=[1, 5, 6], slot=(8, 1))


def _check_assignments_to_no_expert(rng, moe, *, n, k, e, rows, slot):
    """grouped_ffn with `rows` (whole tokens) and one `slot` (token, j) routed to expert id E:
    those outputs are 0 and the rest each expert's FFN."""
    l, f = 32, 16
    x = jnp.asarray(rng.standard_normal((n, l)), jnp.float32)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    dropped = ids.copy()
    dropped[rows] = e
    dropped[slot] = e
    w_gateup = jnp.asarray(rng.standard_normal((e, l, 2 * f)) / l**0.5, jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((e, f, l)) / f**0.5, jnp.float32)
    y = np.asarray(moe.grouped_ffn(x, jnp.asarray(dropped), w_gateup, w_out, act=_silu_glu))
    want = _ffn_ref(x, ids, w_gateup, w_out)
    assert (y[dropped == e] == 0).all()
    np.testing.assert_allclose(y[dropped < e], want[dropped < e], atol=1e-4, rtol=1e-4)


def test_a_decode_steps_few_rows_take_narrow_tiles_and_give_the_wide_tiles_answer(rng):
    """`few_rows_tiling`: <= FEW_ROWS bf16 assignments run narrow column tiles (more programs per
    expert); past it, or in fp32, the default.  Both tilings compute the same FFN."""
    from pallas_kernels import moe

    n, k, e, l, f = 8, 4, 6, 256, 64
    assert moe.few_rows_tiling(n * k, l, f, jnp.bfloat16, act=True) == (32, 256, 4, 4)
    assert moe.few_rows_tiling(n * k, f, l, jnp.bfloat16, act=False) == (16, 64, 2, 3)
    assert moe.few_rows_tiling(moe.FEW_ROWS + 1, l, f, jnp.bfloat16, act=True) is None
    assert moe.few_rows_tiling(n * k, l, f, jnp.float32, act=True) is None
    x = jnp.asarray(rng.standard_normal((n, l)), jnp.bfloat16)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    w_gateup = jnp.asarray(rng.standard_normal((e, l, 2 * f)) / l**0.5, jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((e, f, l)) / f**0.5, jnp.bfloat16)
    few = np.asarray(moe.grouped_ffn(x, jnp.asarray(ids), w_gateup, w_out, act=_silu_glu), np.float32)
    wide_tiling = (moe._tiling(l, f, None), moe._tiling(f, l, None))
    wide = np.asarray(
        moe.grouped_ffn(x, jnp.asarray(ids), w_gateup, w_out, act=_silu_glu, tiling=wide_tiling), np.float32
    )
    want = _ffn_ref(x.astype(jnp.float32), ids, w_gateup.astype(jnp.float32), w_out.astype(jnp.float32))
    # bf16 h and y (one rounding each, ~2^-8 relative) on fp32 accumulation in either blocking
    np.testing.assert_allclose(few, want, atol=3e-2, rtol=2e-2)
    np.testing.assert_allclose(few, wide, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("gather", [True, False])
def test_the_gate_up_kernel_reading_the_tokens_rows_equals_the_padded_copy(rng, monkeypatch, gather):
    """<= GATHER_LIMIT assignments (a power of two): the gate/up kernel finds each layout row's
    token from dest and loads its row (no padded copy); past it, the padded copy.  Both give
    each expert's FFN, zeros for assignments to no expert."""
    from pallas_kernels import moe

    monkeypatch.setattr(moe, "GATHER_LIMIT", moe.GATHER_LIMIT_WRITTEN_FOR if gather else 0)
    assert moe._gathers(16 * 2) == gather
    _check_assignments_to_no_expert(rng, moe, n=16, k=2, e=6, rows=[2, 9], slot=(5, 0))
