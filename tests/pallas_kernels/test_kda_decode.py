"""KDA's fused decode kernel (Pallas, interpret mode here): equals its jnp reference and the KDA
layer's unfused path on the same pools, touches only its rows' slots, and leaves idle rows' slots
as they were."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3.caches import KDASlots
from kimik3.layers.kda import KDA
from pallas_kernels.kda_decode import kda_decode, kda_decode_ref

H, K, W = 2, 16, 4
BETA_COL = 3 * H * K + 5  # the projection's output holds other columns between q | k | v and beta


def decode_inputs(rng, b, n_slots, dtype=jnp.float32):
    r = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, dtype)
    return dict(
        x_in=r(b, BETA_COL + H + 3),
        fg=r(b, 2 * H * K),  # f | x_gate
        conv_pool=r(n_slots, W - 1, 3, H * K),
        state_pool=jnp.asarray(rng.standard_normal((n_slots, H, K, K)) * 0.3, jnp.float32),
    ), dict(
        w_conv=tuple(r(W, H * K, scale=0.5) for _ in "qkv"),
        a_log=jnp.log(jnp.asarray([2.0, 9.0])),
        dt_bias=r(H, K, scale=0.1),
        o_norm=r(K, scale=0.2) + 1.0,
        lower_bound=-5.0,
        eps=1e-6,
        beta_col=BETA_COL,
    )


def run(fn, arrays, params, slots, valid):
    a = dict(arrays)
    return fn(
        a["x_in"],
        a["fg"],
        a["conv_pool"],
        a["state_pool"],
        jnp.asarray(slots, jnp.int32),
        None if valid is None else jnp.asarray(valid, jnp.int32),
        **params,
    )


def test_kernel_equals_reference_over_non_contiguous_slots(rng):
    arrays, params = decode_inputs(rng, 3, 7)
    before = jax.tree.map(np.asarray, arrays)
    slots = [5, 0, 3]
    o_ref, conv_ref, state_ref = run(kda_decode_ref, arrays, params, slots, None)
    o, conv, state = run(kda_decode, arrays, params, slots, None)  # donates the pools
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(state, state_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(conv, conv_ref)  # rows shift: exact
    untouched = [i for i in range(7) if i not in slots]
    np.testing.assert_array_equal(np.asarray(state)[untouched], before["state_pool"][untouched])
    np.testing.assert_array_equal(np.asarray(conv)[untouched], before["conv_pool"][untouched])
    # the new conv rows are the last W-1 inputs: two old rows, then this token's
    np.testing.assert_array_equal(np.asarray(conv)[5, :2], before["conv_pool"][5, 1:])
    np.testing.assert_array_equal(np.asarray(conv)[5, 2].reshape(-1), before["x_in"][0, : 3 * H * K])


def test_idle_rows_change_nothing_and_give_zero(rng):
    arrays, params = decode_inputs(rng, 4, 6)
    before = jax.tree.map(np.asarray, arrays)
    slots, valid = [2, 5, 5, 1], [1, 0, 0, 1]  # rows 1 and 2: idle, sharing scratch slot 5
    o_ref, _, state_ref = run(kda_decode_ref, arrays, params, slots, valid)
    o, conv, state = run(kda_decode, arrays, params, slots, valid)  # donates the pools
    np.testing.assert_array_equal(np.asarray(o)[1:3], 0.0)
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
    for slot in (5, 0, 3, 4):
        np.testing.assert_array_equal(np.asarray(state)[slot], before["state_pool"][slot])
        np.testing.assert_array_equal(np.asarray(conv)[slot], before["conv_pool"][slot])
    np.testing.assert_allclose(np.asarray(state)[[2, 1]], np.asarray(state_ref)[[2, 1]], atol=2e-5, rtol=2e-5)


def test_v_in_several_blocks_per_program(rng):
    """block_v < V: a program walks its state in V blocks (small's 128 in two of 64); the output
    norm spans every block."""
    arrays, params = decode_inputs(rng, 2, 4)
    o_ref, conv_ref, state_ref = run(kda_decode_ref, arrays, params, [3, 1], [1, 1])
    o, conv, state = run(lambda *a, **kw: kda_decode(*a, **kw, block_v=K // 2), arrays, params, [3, 1], [1, 1])
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(state, state_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(conv, conv_ref)


def test_bf16_inputs_keep_fp32_math(rng):
    arrays, params = decode_inputs(rng, 2, 3, jnp.bfloat16)
    o_ref, conv_ref, state_ref = run(kda_decode_ref, arrays, params, [2, 0], None)
    o, conv, state = run(kda_decode, arrays, params, [2, 0], None)
    assert o.dtype == jnp.bfloat16 and conv.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(state, state_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(conv_ref, np.float32))


def test_bad_shapes_are_named_before_any_launch(rng):
    arrays, params = decode_inputs(rng, 2, 3)
    with pytest.raises(ValueError, match="state_pool must be float32"):
        run(kda_decode, dict(arrays, state_pool=arrays["state_pool"].astype(jnp.bfloat16)), params, [0, 1], None)
    with pytest.raises(ValueError, match="fg"):
        run(kda_decode, dict(arrays, fg=arrays["fg"][:, :-8]), params, [0, 1], None)
    with pytest.raises(ValueError, match="slots and valid"):
        run(kda_decode, arrays, params, [0, 1, 2], None)


def fuse_in_projections(params):
    """The serving layout's KDA params (`kimik3.fused`): the six input projections as one matrix."""
    p = dict(params["params"])
    names = ("w_q_dhk", "w_k_dhk", "w_v_dhv", "w_fa_dr", "w_beta_dh", "w_ga_dr")
    p["w_in_dx"] = jnp.concatenate([p.pop(n).reshape(p["w_o_hvd"].shape[-1], -1) for n in names], axis=-1)
    p["w_fg_srn"] = jnp.stack([p.pop(n).reshape(p["w_o_hvd"].shape[1], -1) for n in ("w_fb_rhk", "w_gb_rhv")])
    return {"params": p}


@pytest.mark.parametrize("layout", ["checkpoint", "serving"])
def test_layer_decode_fused_equals_the_unfused_path(rng, tiny_cfg, layout):
    """The KDA layer on pools: kernels="pallas" takes the fused kernel, "reference" the unfused
    convs, gates and recurrence; same outputs, same pools, in either params layout."""
    b, n_slots = 3, 5
    h, d, w = tiny_cfg.kda_heads, tiny_cfg.kda_head_dim, tiny_cfg.kda_conv_size
    x = jnp.asarray(rng.standard_normal((b, 1, tiny_cfg.d_model)), jnp.float32)
    params = KDA(tiny_cfg).init(jax.random.PRNGKey(3), x)
    params = jax.tree.map(lambda p: p + 0.1 * jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    if layout == "serving":
        params = fuse_in_projections(params)
    cache = KDASlots(
        jnp.asarray(rng.standard_normal((n_slots, h, d, d)) * 0.3, jnp.float32),
        jnp.asarray(rng.standard_normal((n_slots, w - 1, 3, h * d)), jnp.float32),
        jnp.asarray([4, 1, 2], jnp.int32),
    )
    valid = jnp.asarray([1, 1, 0], jnp.int32)
    y_ref, new_ref, _ = KDA(tiny_cfg, "reference").apply(params, x, cache, valid_b=valid)
    y, new, exports = KDA(tiny_cfg, "pallas").apply(params, x, cache, valid_b=valid)
    np.testing.assert_allclose(y, y_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(new.state, new_ref.state, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(new.conv, new_ref.conv)
    assert isinstance(new, KDASlots) and isinstance(new_ref, KDASlots) and exports is None
    np.testing.assert_array_equal(new.slots, cache.slots)


def test_the_unbounded_softplus_gate_equals_its_reference_far_below_the_bounded_range(rng):
    """Kimi-Linear's gate -exp(A_log) * softplus(f + dt_bias) has no lower bound: with f around
    +8 and exp(A_log) = 9 a token's log-decay reaches about -70 per channel (the bounded gate
    stops at -5); the kernel's softplus stays finite and equals the jnp reference's."""
    arrays, params = decode_inputs(rng, 3, 5)
    arrays["fg"] = arrays["fg"].at[:, : H * K].add(8.0)
    params = dict(params, lower_bound=None, eps=1e-5)
    o_ref, _, state_ref = run(kda_decode_ref, arrays, params, [4, 0, 2], None)
    o, _, state = run(kda_decode, arrays, params, [4, 0, 2], None)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(state)).all()
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(state, state_ref, atol=2e-5, rtol=2e-5)


def test_the_softplus_gate_is_the_written_formula():
    from pallas_kernels.kda_decode import log_decay

    f = jnp.asarray([-30.0, -1.0, 0.0, 0.5, 19.0, 25.0, 80.0])
    want = -3.0 * np.where(np.asarray(f) > 20, np.asarray(f), np.log1p(np.exp(np.asarray(f, np.float64))))
    np.testing.assert_allclose(log_decay(3.0, f, None), want, rtol=1e-6)
    np.testing.assert_allclose(
        log_decay(3.0, f, -5.0), -5.0 / (1 + np.exp(-3.0 * np.asarray(f, np.float64))), rtol=1e-6, atol=1e-30
    )
