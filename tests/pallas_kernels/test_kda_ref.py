"""KDA references: the chunked (WY/UT) form equals the token recurrence."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kda_chunked_ref, kda_recurrent_ref

# fp32 throughout; the two forms sum in different orders.
ATOL, RTOL = 2e-5, 2e-5


def kda_inputs(rng, b, t, h, dk, dv, dtype=np.float32):
    """Fresh random inputs shaped like the layer's: unit-norm q/k, gates in [-5, 0]."""
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((b, t, h, dk)))
    k = unit(rng.standard_normal((b, t, h, dk)))
    v = rng.standard_normal((b, t, h, dv))
    g = -5.0 / (1 + np.exp(-rng.standard_normal((b, t, h, dk))))
    beta = 1 / (1 + np.exp(-rng.standard_normal((b, t, h))))
    return [jnp.asarray(x, dtype) for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("t", [1, 37, 64, 150])
def test_chunked_equals_recurrent_with_initial_state(rng, t):
    q, k, v, g, beta = kda_inputs(rng, 2, t, 3, 16, 8)
    s0 = jnp.asarray(rng.standard_normal((2, 3, 16, 8)), jnp.float32)
    o_r, s_r = kda_recurrent_ref(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = kda_chunked_ref(q, k, v, g, beta, initial_state=s0)
    np.testing.assert_allclose(o_c, o_r, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(s_c, s_r, atol=ATOL, rtol=RTOL)
    assert s_c.dtype == jnp.float32


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_state_carried_across_two_calls_equals_one_call(rng, chunk_size):
    q, k, v, g, beta = kda_inputs(rng, 1, 130, 2, 16, 16)
    o_all, s_all = kda_chunked_ref(q, k, v, g, beta, chunk_size=chunk_size)
    split = 77
    first = [x[:, :split] for x in (q, k, v, g, beta)]
    rest = [x[:, split:] for x in (q, k, v, g, beta)]
    o1, s1 = kda_chunked_ref(*first, chunk_size=chunk_size)
    o2, s2 = kda_chunked_ref(*rest, initial_state=s1, chunk_size=chunk_size)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), o_all, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(s2, s_all, atol=ATOL, rtol=RTOL)


def test_strong_decay_does_not_overflow(rng):
    """Gates at the -5 bound for a whole chunk: cumulative decay exp(-320) underflows safely."""
    q, k, v, g, beta = kda_inputs(rng, 1, 128, 1, 8, 8)
    g = jnp.full_like(g, -5.0)
    o_c, s_c = kda_chunked_ref(q, k, v, g, beta)
    o_r, s_r = kda_recurrent_ref(q, k, v, g, beta)
    assert np.isfinite(o_c).all() and np.isfinite(s_c).all()
    np.testing.assert_allclose(o_c, o_r, atol=ATOL, rtol=RTOL)


def test_bf16_inputs_give_bf16_output_and_fp32_state(rng):
    q, k, v, g, beta = kda_inputs(rng, 1, 70, 2, 16, 16, dtype=jnp.bfloat16)
    o, s = kda_chunked_ref(q, k, v, g, beta)
    o32, s32 = kda_recurrent_ref(*[x.astype(jnp.float32) for x in (q, k, v, g, beta)])
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    np.testing.assert_allclose(o.astype(jnp.float32), o32, atol=2e-2, rtol=2e-2)  # bf16 output rounding


def test_matches_the_definition_on_one_token():
    """o = S^T(scale q) after S <- exp(g) S; S += beta k (v - S^T k)^T, by hand."""
    rng = np.random.default_rng(0)
    q, k, v, g, beta = kda_inputs(rng, 1, 1, 1, 4, 3)
    s0 = rng.standard_normal((1, 1, 4, 3)).astype(np.float32)
    s = np.exp(np.asarray(g[0, 0, 0]))[:, None] * s0[0, 0]
    kk, vv = np.asarray(k[0, 0, 0]), np.asarray(v[0, 0, 0])
    s = s + float(beta[0, 0, 0]) * np.outer(kk, vv - s.T @ kk)
    o_expected = s.T @ (np.asarray(q[0, 0, 0]) * 4**-0.5)
    o, s_final = kda_recurrent_ref(q, k, v, g, beta, initial_state=jnp.asarray(s0))
    np.testing.assert_allclose(o[0, 0, 0], o_expected, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(s_final[0, 0], s, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fn", [kda_recurrent_ref, kda_chunked_ref])
def test_bad_shapes_and_state_dtype_raise(rng, fn):
    q, k, v, g, beta = kda_inputs(rng, 1, 8, 2, 4, 4)
    with pytest.raises(ValueError, match="beta"):
        fn(q, k, v, g, beta[:, :4])
    with pytest.raises(ValueError, match="v must be"):
        fn(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="float32"):
        fn(q, k, v, g, beta, initial_state=jnp.zeros((1, 2, 4, 4), jnp.bfloat16))
