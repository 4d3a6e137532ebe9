"""Random params drawn straight into the served layout (`kimik3.quant_store.init_served_params`):
leaf for leaf what quantizing and fusing the whole drawn model gives, block by block, and the
serving engine takes them and decodes the oracle's tokens."""

import jax
import numpy as np
import pytest

from kimik3 import config, fused, model
from kimik3.generate import generate
from kimik3 import quant_store as store
from kimik3.quant import formats
from serving.engine import Engine


def _leaves(tree):
    flat = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, formats.QTensor))
    return {jax.tree_util.keystr(p, simple=True, separator="/"): leaf for p, leaf in flat}


def _arrays(leaf):
    """A leaf's arrays as (dtype, numpy array) pairs (fp8 / e8m0 types compare by their bits)."""
    parts = (leaf.values, leaf.scales) if isinstance(leaf, formats.QTensor) else (leaf,)
    as_np = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, np.uint8) if a.dtype.itemsize == 1 else a)
    return [(str(a.dtype), as_np(a)) for a in parts]


@pytest.mark.parametrize("manifest", ["bf16", "kimi_k3_mxfp4"])
def test_served_init_equals_quantizing_and_fusing_the_drawn_model(tiny_cfg, manifest):
    key = jax.random.PRNGKey(5)
    got = _leaves(store.init_served_params(tiny_cfg, key, manifest))
    want = _leaves(store.quantize_params(model.init_params(tiny_cfg, key), tiny_cfg, manifest))
    assert got.keys() == want.keys()
    assert any(isinstance(x, formats.QTensor) for x in got.values()) == (manifest != "bf16")
    assert "layer_1/moe/w_gateup_elf" in got  # the served layout: fused
    for path in want:
        a, b = got[path], want[path]
        assert type(a) is type(b) and a.shape == b.shape, path
        if isinstance(a, formats.QTensor):
            assert a.fmt == b.fmt, path
        for (dtype_a, x), (dtype_b, y) in zip(_arrays(a), _arrays(b)):
            assert dtype_a == dtype_b, path
            np.testing.assert_array_equal(x, y, err_msg=path)


def test_each_block_is_handed_over_served_before_the_next_is_drawn(tiny_cfg):
    seen = []

    def on_layer(i, block):
        seen.append(i)
        assert fused.is_fused({f"layer_{i}": block})
        return block

    store.init_served_params(tiny_cfg, jax.random.PRNGKey(0), "bf16", on_layer=on_layer)
    assert seen == list(range(tiny_cfg.n_layers))
    with pytest.raises(ValueError, match="unknown manifest"):
        store.init_served_params(tiny_cfg, jax.random.PRNGKey(0), "int3")


def test_fuse_layer_is_fuse_projections_block_by_block(tiny_cfg, tiny_params):
    whole = fused.fuse_projections(tiny_params, tiny_cfg)
    for i in range(tiny_cfg.n_layers):
        block = fused.fuse_layer(tiny_params[f"layer_{i}"])
        jax.tree.map(np.testing.assert_array_equal, block, whole[f"layer_{i}"])
        assert fused.fuse_layer(block) is block  # a fused block comes back as it is


def test_the_engine_serves_the_served_init_and_decodes_the_oracles_tokens(rng):
    cfg = config.tiny()
    params = store.init_served_params(cfg, jax.random.PRNGKey(2), "kimi_k3_mxfp4")
    eng = Engine(
        params,
        cfg,
        num_pages=24,
        num_slots=2,
        num_snapshots=4,
        page_tokens=16,
        kda_block_tokens=64,
        max_pages_per_request=8,
        prefill_chunk_tokens=32,
        kernels="reference",
    )
    prompt = rng.integers(0, 256, 21).tolist()
    req = eng.submit(prompt, 4)
    eng.run(max_steps=50)
    assert req.done and req.error is None and len(req.output) == 4
    assert req.output == generate(params, cfg, prompt, 4).tokens.tolist()
