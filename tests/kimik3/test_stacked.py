"""The scanned layout (`kimik3.stacked`): the repeated periods as one scan step give the unrolled
layers' answer bit for bit (same math per layer), over contiguous and paged caches, and the
paged pools are written in place by offset whether a layer is scanned or not."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import config, fused, model, stacked, tokenizer
from tests.conftest import perturb_identity_leaves

PAGE = 16


@pytest.fixture(scope="module")
def deep_cfg():
    """tiny with 12 layers: the dense period, then two identical periods to scan."""
    return dataclasses.replace(config.tiny(), n_layers=12)


@pytest.fixture(scope="module")
def deep_params(deep_cfg):
    return perturb_identity_leaves(model.init_params(deep_cfg, jax.random.PRNGKey(3), "float32"), seed=5)


def _tokens(rng, b, n):
    return rng.integers(0, tokenizer.N_BYTES, size=(b, n)).astype(np.int32)


def test_layout_names_what_is_scanned(deep_cfg, tiny_cfg, deep_params):
    assert stacked.scan_layout(deep_cfg) == (4, 2) and list(stacked.scanned_layers(deep_cfg)) == list(range(4, 12))
    assert stacked.scan_layout(tiny_cfg)[1] == 0  # one period: nothing worth a scan
    assert stacked.scan_layout(config.small()) == (4, 3)
    s = stacked.stack_periods(deep_params, deep_cfg)
    assert stacked.is_stacked(s) and sorted(k for k in s if k.startswith("layer_")) == [f"layer_{i}" for i in range(4)]
    leaf = s["periods"]["layer_3"]["mla"]["w_o_hvd"]
    assert leaf.shape == (2,) + deep_params["layer_7"]["mla"]["w_o_hvd"].shape
    np.testing.assert_array_equal(leaf[1], deep_params["layer_11"]["mla"]["w_o_hvd"])
    assert stacked.stack_periods(s, deep_cfg) is s
    back = stacked.unstack_periods(s, deep_cfg)
    assert jax.tree.structure(back) == jax.tree.structure(deep_params)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, deep_params)))
    served = stacked.serving_layout(deep_params, deep_cfg)
    assert stacked.is_stacked(served) and fused.is_fused(served)
    assert not stacked.is_stacked(stacked.serving_layout(served, deep_cfg, scan=False))


def test_contiguous_cache_scanned_equals_unrolled(rng, deep_cfg, deep_params):
    s = stacked.stack_periods(deep_params, deep_cfg)
    toks = _tokens(rng, 2, 17)
    caches = [model.init_cache(deep_cfg, 2, 32, jnp.float32)] * 2
    # prefill, a continuation over the cache (the same chunk length: one compile for both), decode
    for lo, hi in ((0, 8), (8, 16), (16, 17)):
        (want, caches[0]), (got, caches[1]) = (
            model.forward(p, deep_cfg, toks[:, lo:hi], cache=c, kernels="reference")
            for p, c in ((deep_params, caches[0]), (s, caches[1]))
        )
        np.testing.assert_array_equal(got, want)
    jax.tree.map(np.testing.assert_array_equal, caches[1], caches[0])


# The Pallas case (~30 s of the 2-core suite: every kernel interpreted over a deep model) runs with
# the slow tests; the kernels' own interpreter tests and tests/gpu check them on every run.
@pytest.mark.parametrize("kernels", ["reference", pytest.param("pallas", marks=pytest.mark.slow)])
def test_paged_scanned_equals_unrolled_with_exports_and_padding(rng, deep_cfg, deep_params, kernels):
    """A padded prefill chunk exporting KDA states, then a decode step (the in-place kernel on the
    Pallas path, slots offset per layer): logits, every pool row and every export agree."""
    s = stacked.stack_periods(deep_params, deep_cfg)
    tables = np.array([[3, 6, 9, 12], [5, 1, 8, 2]], np.int32)
    slots, valid, t = np.array([2, 0], np.int32), [40, 29], 64
    toks = _tokens(rng, 2, t)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (2, t))
    pools = model.init_paged_cache(deep_cfg, num_pages=16, num_slots=3, page_tokens=PAGE, dtype=jnp.float32)
    pools = jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), pools)  # nonzero rows
    outs = []
    for p in (deep_params, s):
        view = model.paged_view(pools, tables, slots, [0, 0])
        logits, out, exports = model.paged_step(
            p,
            toks,
            positions,
            jax.tree.map(jnp.copy, view),
            None,
            cfg=deep_cfg,
            expert_path="grouped",
            kernels=kernels,
            logits_tail=1,
            export_at=np.asarray([32, -1], np.int32),
            valid_b=np.asarray(valid, np.int32),
        )
        view = model.paged_view(model.pools_of(out), tables, slots, out["lengths"])
        step, after, _ = model.paged_step(
            p,
            toks[:, -1:],
            np.asarray(out["lengths"])[:, None],
            view,
            None,
            cfg=deep_cfg,
            expert_path="grouped",
            kernels=kernels,
            logits_tail=1,
        )
        outs.append((logits, exports, step, model.pools_of(after)))
    (want_logits, want_exports, want_step, want_pools), *scanned = outs
    for logits, exports, step, got_pools in scanned:
        assert len(exports) == deep_cfg.mixer_kinds.count("kda")
        np.testing.assert_array_equal(logits, want_logits)
        np.testing.assert_array_equal(step, want_step)
        jax.tree.map(np.testing.assert_array_equal, exports, want_exports)
        jax.tree.map(np.testing.assert_array_equal, got_pools, want_pools)
    # and the rows moved: every KDA layer's slots and every MLA layer's first pages were written
    for i, layer in enumerate(model.pool_layers(deep_cfg, got_pools)):
        before = model.pool_layers(deep_cfg, pools)[i]
        changed = layer["state"][slots] if "state" in layer else layer["pages"][tables[:, 0]]
        unchanged = before["state"][slots] if "state" in layer else before["pages"][tables[:, 0]]
        assert not np.array_equal(changed, unchanged), f"layer {i} wrote nothing"
