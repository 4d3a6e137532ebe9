"""The serving layout (`kimik3.fused`): one GEMM per shared input computes what the checkpoint
layout computes, on every path the engine runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import fused, model

ATOL = 1e-4  # fp32 through 4 layers: the fused GEMMs sum the same products, blocked differently (2e-5 seen)


@pytest.fixture(autouse=True)
def _fp32_dots():
    """The tolerance is fp32's: a GPU's default precision runs fp32 dots in TF32 (2.6e-3 seen on an H200)."""
    with jax.default_matmul_precision("highest"):
        yield


def test_fusing_keeps_every_other_leaf_and_is_idempotent(tiny_cfg, tiny_params):
    f = fused.fuse_projections(tiny_params, tiny_cfg)
    assert fused.is_fused(f) and not fused.is_fused(tiny_params)
    assert fused.fuse_projections(f, tiny_cfg) is f
    assert "w_q_dhk" not in f["layer_0"]["kda"] and "w_gate_elf" not in f["layer_1"]["moe"]
    count = lambda t: sum(x.size for x in jax.tree_util.tree_leaves(t))
    assert count(f) == count(tiny_params)  # the same numbers, rearranged
    kda = tiny_params["layer_0"]["kda"]
    np.testing.assert_array_equal(f["layer_0"]["kda"]["w_fg_srn"][0].reshape(kda["w_fb_rhk"].shape), kda["w_fb_rhk"])
    np.testing.assert_array_equal(f["layer_0"]["kda"]["w_fg_srn"][1].reshape(kda["w_gb_rhv"].shape), kda["w_gb_rhv"])
    np.testing.assert_array_equal(f["layer_1"]["moe"]["w_router_de"], tiny_params["layer_1"]["moe"]["w_router_de"])


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_fused_params_give_the_same_logits_and_cache(rng, tiny_cfg, tiny_params, kernels):
    f = fused.fuse_projections(tiny_params, tiny_cfg)
    toks = rng.integers(0, 256, (2, 40)).astype(np.int32)
    cache = model.init_cache(tiny_cfg, 2, 64, jnp.float32)
    want, want_cache = model.forward(tiny_params, tiny_cfg, toks, cache=cache, kernels=kernels)
    got, got_cache = model.forward(f, tiny_cfg, toks, cache=cache, kernels=kernels)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=ATOL, rtol=0), got_cache, want_cache)
    step = toks[:, :1]
    want, _ = model.forward(tiny_params, tiny_cfg, step, cache=want_cache, kernels=kernels)  # decode
    got, _ = model.forward(f, tiny_cfg, step, cache=got_cache, kernels=kernels)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_the_dense_expert_reference_reads_the_fused_layout(rng, tiny_cfg, tiny_params):
    f = fused.fuse_projections(tiny_params, tiny_cfg)
    toks = rng.integers(0, 256, (1, 12)).astype(np.int32)
    want, _ = model.forward(tiny_params, tiny_cfg, toks, expert_path="dense")
    got, _ = model.forward(f, tiny_cfg, toks, expert_path="dense")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
