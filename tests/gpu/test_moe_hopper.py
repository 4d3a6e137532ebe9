"""The Hopper grouped expert GEMM (`pallas_kernels.moe_hopper`) compiled for the GPU: its
real body (the CPU tests run Mosaic GPU's interpreter) against the fp32 reference at the
model's prefill shapes, every tiling the benchmark sweeps, and the grouped FFN against the
Triton kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.moe import hopper_tilings
from kimik3.layers.moe import _SituGLU
from pallas_kernels import moe, moe_hopper
from tests.gpu.conftest import sm90

pytestmark = pytest.mark.skipif(not sm90(), reason="Mosaic GPU wgmma kernels need compute capability 9.x")
ACT = _SituGLU((8.0, 8.0))
BF16_ULP = 2.0**-8


def _case(seed, m, k, n, g):
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(m - m // 16, np.ones(g) / g).astype(np.int32)  # the last rows in no group
    sizes[1] = 0
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / k**0.5, jnp.bfloat16)
    return x, w, jnp.asarray(sizes)


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("m, k, n, g", [(8192, 768, 768, 32), (16384, 1024, 2048, 24), (1000, 768, 1536, 32)])
def test_grouped_matmul_at_prefill_shapes(m, k, n, g, layout):
    x, w, sizes = _case(m, m, k, n, g)
    ref = np.asarray(jax.jit(moe.grouped_matmul_ref)(x.astype(jnp.float32), w.astype(jnp.float32), sizes))
    for t in hopper_tilings(m, n, False, quick=False):
        got = np.asarray(
            jax.jit(lambda a, b, s: moe_hopper.grouped_matmul(a, b, s, layout=layout, block_m=t.tile_m, tiling=t))(
                x, w, sizes
            ).astype(jnp.float32)
        )
        np.testing.assert_allclose(got, ref, rtol=2 * BF16_ULP, atol=1e-5, err_msg=t.label)
        assert np.mean(got == np.asarray(jnp.asarray(ref).astype(jnp.bfloat16).astype(jnp.float32))) > 0.98, t.label
        assert not np.any(got[int(np.sum(np.asarray(sizes))) :]), t.label


@pytest.mark.parametrize("t, l, f, e", [(2048, 768, 768, 32), (4096, 1024, 1024, 24)])
def test_grouped_ffn_hopper_against_triton(t, l, f, e):
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.standard_normal((t, l)), jnp.bfloat16)
    w_gu = jnp.asarray(rng.standard_normal((e, l, 2 * f)) / l**0.5, jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((e, f, l)) / f**0.5, jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :4], jnp.int32)
    ids = ids.at[:7, 0].set(e)  # a few assignments to no expert
    got = np.asarray(moe.grouped_ffn(x, ids, w_gu, w_out, act=ACT, impl="hopper").astype(jnp.float32))
    want = np.asarray(moe.grouped_ffn(x, ids, w_gu, w_out, act=ACT).astype(jnp.float32))
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=4 * BF16_ULP, atol=4 * BF16_ULP * scale)
    assert np.mean(got == want) > 0.95
    assert not np.any(got[:7, 0])


def test_smalls_bf16_prefill_takes_the_hopper_experts_by_default_and_agrees_with_triton(monkeypatch):
    """`KIMIK3_MOE_GMM` unset ("auto"): a 512-token prefill of `small` in bf16 (2048 expert
    assignments) runs the routed experts on the Hopper kernels inside the jitted model, and its
    last-position logits agree with the Triton kernels' to bf16 accuracy through every layer."""
    from kimik3 import config, model, ops

    cfg = config.small()  # bf16 serving dtype
    w_gu = jnp.zeros((cfg.n_routed_experts, cfg.moe_latent_dim, 2 * cfg.moe_expert_dim), jnp.bfloat16)
    assert (
        ops.moe_gmm_impl(jnp.bfloat16, ((w_gu, True),), 512 * cfg.n_active_experts, ops.device_compute_capability())
        == "hopper"
    )
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 512)), jnp.int32)
    positions = jnp.arange(512, dtype=jnp.int32)[None]

    def logits():
        module = model.KimiK3(cfg, "grouped", ops.resolve("auto"))
        fn = jax.jit(lambda p, t, pos: module.apply({"params": p}, t, pos, logits_tail=8)[0])
        return np.asarray(fn(params, tokens, positions))

    monkeypatch.delenv("KIMIK3_MOE_GMM", raising=False)
    hopper = logits()
    monkeypatch.setenv("KIMIK3_MOE_GMM", "triton")
    triton = logits()
    assert np.all(np.isfinite(hopper))
    rel = np.linalg.norm(hopper - triton) / np.linalg.norm(triton)
    assert rel < 0.05, rel  # bf16 rounding through every layer, not a wrong expert
    assert np.mean(hopper.argmax(-1) == triton.argmax(-1)) >= 0.75
