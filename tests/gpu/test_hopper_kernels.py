"""The Hopper MLA kernels compiled for the GPU at the model's dims, against their references on
fresh random inputs, several times over (a synchronization bug shows as run-to-run scatter: the
interpreter's body, which tests/pallas_kernels checks, cannot show it)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import mla_decode_ref, mla_prefill_ref
from pallas_kernels.mla_hopper import mla_decode_hopper, mla_prefill_hopper
from tests.gpu.conftest import sm90

O_ATOL = 2e-2  # bf16 outputs of O(1), P rounded to bf16 before P @ V
LSE_ATOL = 1e-3
REPEATS = 5

pytestmark = pytest.mark.skipif(not sm90(), reason="Hopper (sm_90) kernels")


@pytest.mark.parametrize("heads", [16, 96])
def test_decode_at_the_models_latent_dims_every_repeat(heads):
    """kv_lora 512 + rope 64, pages of 128, `small`'s 16 heads and full scale's 96."""
    r, p, page, n_pages, b = 512, 64, 128, 40, 4
    for seed in range(REPEATS):
        rng = np.random.default_rng(seed)
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
        pages = f(n_pages, page, r + p)
        table = jnp.asarray(rng.permutation(n_pages)[:b * 8].reshape(b, 8), jnp.int32)
        lens = jnp.asarray(rng.integers(1, 8 * page, b), jnp.int32)
        q_latent, q_pe = f(b, 1, heads, r), f(b, 1, heads, p)
        o, lse = mla_decode_hopper(q_latent, q_pe, pages, table, lens, scale=192 ** -0.5)
        up = lambda x: x.astype(jnp.float32)
        o_ref, lse_ref = mla_decode_ref(up(q_latent), up(q_pe), up(pages), table, lens, scale=192 ** -0.5)
        np.testing.assert_allclose(up(o), o_ref, atol=O_ATOL, rtol=0, err_msg=f"repeat {seed}")
        np.testing.assert_allclose(lse, lse_ref, atol=LSE_ATOL, rtol=0, err_msg=f"repeat {seed}")


@pytest.mark.parametrize("heads", [16, 96])
def test_prefill_at_the_models_head_dims_every_repeat(heads):
    """qk 192 (nope 128 + rope 64), v 128, two ragged sequences."""
    for seed in range(REPEATS):
        rng = np.random.default_rng(100 + seed)
        lens = [300, 77]
        t = sum(lens)
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
        q, k, v = f(t, heads, 192), f(t, heads, 192), f(t, heads, 128)
        cu = np.concatenate([[0], np.cumsum(lens)])
        o, lse = mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=192 ** -0.5)
        up = lambda x: x.astype(jnp.float32)
        o_ref, lse_ref = mla_prefill_ref(up(q), up(k), up(v), cu_seqlens=cu, scale=192 ** -0.5)
        np.testing.assert_allclose(up(o), o_ref, atol=O_ATOL, rtol=0, err_msg=f"repeat {seed}")
        np.testing.assert_allclose(lse, lse_ref, atol=LSE_ATOL, rtol=0, err_msg=f"repeat {seed}")
