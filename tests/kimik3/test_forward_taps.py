"""`model.forward_taps`: the residual stream after chosen layers, what EAGLE-3's draft head reads."""

import dataclasses

import jax
import numpy as np
import pytest

from kimik3 import model, stacked
from kimik3.layers.primitives import rms_norm


@pytest.fixture(scope="module")
def tapped(tiny_cfg, tiny_params):
    toks = np.random.default_rng(3).integers(0, 256, (2, 12)).astype(np.int32)
    logits, hidden = model.forward_taps(tiny_params, tiny_cfg, toks, tuple(range(tiny_cfg.n_layers)))
    return toks, np.asarray(logits), np.asarray(hidden)


def test_the_last_layers_tap_is_what_the_head_reads_and_the_logits_are_forwards(tapped, tiny_cfg, tiny_params):
    toks, logits, hidden = tapped
    assert hidden.shape == (2, 12, tiny_cfg.n_layers, tiny_cfg.d_model)
    want, _ = model.forward(tiny_params, tiny_cfg, toks)
    np.testing.assert_array_equal(logits, np.asarray(want))
    head = rms_norm(hidden[:, :, -1], tiny_params["final_norm"]["scale"], tiny_cfg.norm_eps) @ tiny_params["lm_head_dv"]
    np.testing.assert_allclose(np.asarray(head), logits, atol=1e-4, rtol=1e-4)
    for i in range(1, tiny_cfg.n_layers):  # each tap its own layer's stream
        assert not np.allclose(hidden[:, :, i], hidden[:, :, i - 1])


def test_a_middle_tap_is_the_output_of_the_model_cut_after_that_layer(tapped, tiny_cfg, tiny_params):
    toks, _, hidden = tapped
    cut = dataclasses.replace(tiny_cfg, n_layers=2)
    cut_params = {k: v for k, v in tiny_params.items() if not k.startswith("layer_") or int(k[6:]) < 2}
    _, cut_hidden = model.forward_taps(cut_params, cut, toks, (1,))
    np.testing.assert_array_equal(hidden[:, :, 1], np.asarray(cut_hidden)[:, :, 0])


def test_bad_taps_are_refused_before_any_launch(tiny_cfg, tiny_params):
    toks = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="non-empty tuple"):
        model.forward_taps(tiny_params, tiny_cfg, toks, (tiny_cfg.n_layers,))
    with pytest.raises(ValueError, match="non-empty tuple"):
        model.forward_taps(tiny_params, tiny_cfg, toks, ())
    deep = dataclasses.replace(tiny_cfg, n_layers=12)  # layers 4..11 scan in the stacked layout
    tap_in_scan = lambda p: model.forward_taps(stacked.stack_periods(p, deep), deep, toks, (5,))
    with pytest.raises(ValueError, match=r"taps \[5\] are scanned layers"):
        jax.eval_shape(tap_in_scan, model.abstract_params(deep))  # traced only: nothing compiles
