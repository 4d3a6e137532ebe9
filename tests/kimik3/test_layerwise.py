"""The forward run layer by layer (`kimik3.layerwise`): one program per mixer kind and per FFN
kind, whatever the depth, with the whole program's numbers bit for bit on the CPU; `forward`
takes it only where it can and pays; and the block's two halves keep the block's math,
including the pad tokens' routing to no expert."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import config, fused, layerwise, model, stacked, tokenizer
from kimik3.layers import moe
from tests.conftest import perturb_identity_leaves


@pytest.fixture(scope="module")
def deep_cfg():
    """tiny with 8 layers: the dense period and one more (2 mixer kinds, 2 FFN kinds)."""
    return dataclasses.replace(config.tiny(), n_layers=8)


@pytest.fixture(scope="module")
def deep_params(deep_cfg):
    return perturb_identity_leaves(model.init_params(deep_cfg, jax.random.PRNGKey(11), "float32"), seed=2)


def _tokens(rng, b, n):
    return rng.integers(0, tokenizer.N_BYTES, size=(b, n)).astype(np.int32)


def _assert_same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("layout", ["checkpoint", "fused"])
def test_layerwise_gives_the_whole_programs_numbers(rng, deep_cfg, deep_params, layout):
    """No cache, a contiguous cache's prefill and the decode step after it: logits and every
    cache entry equal to the whole program's (fp32 on the CPU: the same ops, fused apart)."""
    params = deep_params if layout == "checkpoint" else fused.fuse_projections(deep_params, deep_cfg)
    toks = _tokens(rng, 2, 11)
    _assert_same(
        model.forward(params, deep_cfg, toks, programs="layerwise"),
        model.forward(params, deep_cfg, toks, programs="whole"),
    )
    outs = {}
    for programs in ("layerwise", "whole"):
        cache = model.init_cache(deep_cfg, 2, 32, jnp.float32)
        prefill = model.forward(params, deep_cfg, toks, cache=cache, programs=programs)
        step = model.forward(params, deep_cfg, toks[:, :1], cache=prefill[1], programs=programs)
        outs[programs] = (prefill, step)
    _assert_same(outs["layerwise"], outs["whole"])


def test_images_ride_the_embedding_program(rng, deep_cfg, deep_params):
    v = deep_cfg.vit
    toks = _tokens(rng, 1, 4 + v.tokens_per_image)
    toks[0, 2 : 2 + v.tokens_per_image] = tokenizer.IMAGE_ID
    images = rng.random((1, v.image_size, v.image_size, v.channels)).astype(np.float32)
    _assert_same(
        model.forward(deep_params, deep_cfg, toks, images=images, programs="layerwise"),
        model.forward(deep_params, deep_cfg, toks, images=images, programs="whole"),
    )


def test_each_kind_compiles_once_whatever_the_depth(rng, deep_cfg, deep_params):
    """A new shape compiles one mixer program per mixer kind and one FFN program per FFN kind
    (2 + 2 for every preset), not one per layer."""
    before = layerwise.programs_compiled()
    model.forward(deep_params, deep_cfg, _tokens(rng, 1, 13), programs="layerwise")  # T=13: no other test's shape
    after = layerwise.programs_compiled()
    grew = {k: after[k] - before[k] for k in after}
    assert grew == {
        "embed": 1,
        "mixer": len(set(deep_cfg.mixer_kinds)),
        "ffn": len({deep_cfg.ffn_kind(i) for i in range(deep_cfg.n_layers)}),
        "head": 1,
    }
    assert deep_cfg.n_layers == 8 and grew["mixer"] == 2 and grew["ffn"] == 2


def test_auto_takes_it_where_it_can_and_pays(deep_cfg, deep_params, tiny_cfg, tiny_params):
    use = layerwise.use_layerwise
    assert use("auto", deep_params, deep_cfg, None)  # 8 layers of 3 block kinds, on the CPU
    assert not use("auto", tiny_params, tiny_cfg, None)  # 4 layers of 3 kinds: the whole program compiles less
    assert not use("whole", deep_params, deep_cfg, None)
    pools = model.init_paged_cache(deep_cfg, num_pages=4, num_slots=2, page_tokens=16, dtype=jnp.float32)
    view = model.paged_view(pools, np.zeros((1, 2), np.int32), [0], [0])
    assert not use("auto", deep_params, deep_cfg, view)
    with pytest.raises(ValueError, match="paged cache"):
        use("layerwise", deep_params, deep_cfg, view)
    with pytest.raises(ValueError, match="scanned layout"):
        use("layerwise", dict(deep_params, **{stacked.PERIODS: {}}), deep_cfg, None)
    with pytest.raises(ValueError, match="programs must be one of"):
        use("per-layer", deep_params, deep_cfg, None)
    seen = []
    jax.jit(lambda p: seen.append(use("auto", p, deep_cfg, None)) or 0)(deep_params)
    assert seen == [False]  # traced: already one program


def test_pad_tokens_reach_no_expert(rng, deep_cfg, deep_params, monkeypatch):
    """A block given valid_b routes its rows' pad tokens to expert id E (no expert
    weights read; every expert path gives 0), as the mixer's padded write does; real tokens
    route as before."""
    seen = []
    real_path = moe.EXPERT_PATHS["grouped"]
    monkeypatch.setitem(
        moe.EXPERT_PATHS, "grouped", lambda x, ids, *a: seen.append(np.asarray(ids)) or real_path(x, ids, *a)
    )
    pools = model.init_paged_cache(deep_cfg, num_pages=8, num_slots=3, page_tokens=16, dtype=jnp.float32)
    toks = _tokens(rng, 2, 8)
    view = model.paged_view(pools, np.array([[1], [2]], np.int32), [0, 1], [0, 0])
    positions = np.broadcast_to(np.arange(8, dtype=np.int32), (2, 8))
    model.forward_paged(
        deep_params,
        jnp.asarray(toks),
        jnp.asarray(positions),
        view,
        None,
        cfg=deep_cfg,
        expert_path="grouped",
        kernels="reference",
        valid_b=[8, 5],
    )
    e = deep_cfg.n_routed_experts
    moe_layers = sum(deep_cfg.ffn_kind(i) == "moe" for i in range(deep_cfg.n_layers))
    assert len(seen) == moe_layers
    for ids in seen:
        ids = ids.reshape(2, 8, -1)
        assert (ids[1, 5:] == e).all()  # row 1's 3 pad tokens
        assert (ids[0] < e).all() and (ids[1, :5] < e).all()
