"""`model.forward_taps`: the residual stream after chosen layers, what EAGLE-3's draft head reads."""

import dataclasses

import jax
import numpy as np
import pytest

from kimik3 import model, stacked
from kimik3.layers.primitives import rms_norm


def test_the_last_layers_tap_is_what_the_head_reads_and_the_logits_are_forwards(rng, tiny_cfg, tiny_params):
    toks = rng.integers(0, 256, (2, 12)).astype(np.int32)
    last = tiny_cfg.n_layers - 1
    logits, hidden = model.forward_taps(tiny_params, tiny_cfg, toks, (0, 2, last))
    assert hidden.shape == (2, 12, 3, tiny_cfg.d_model)
    want, _ = model.forward(tiny_params, tiny_cfg, toks)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
    head = rms_norm(hidden[:, :, 2], tiny_params["final_norm"]["scale"], tiny_cfg.norm_eps) @ tiny_params["lm_head_dv"]
    np.testing.assert_allclose(np.asarray(head), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_a_middle_tap_is_the_output_of_the_model_cut_after_that_layer(rng, tiny_cfg, tiny_params):
    toks = rng.integers(0, 256, (1, 9)).astype(np.int32)
    _, hidden = model.forward_taps(tiny_params, tiny_cfg, toks, (1,))
    cut = dataclasses.replace(tiny_cfg, n_layers=2)
    cut_params = {k: v for k, v in tiny_params.items() if not k.startswith("layer_") or int(k[6:]) < 2}
    _, cut_hidden = model.forward_taps(cut_params, cut, toks, (1,))
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(cut_hidden))
    _, other = model.forward_taps(tiny_params, tiny_cfg, toks, (2,))
    assert not np.allclose(np.asarray(other), np.asarray(hidden))  # a different layer, a different stream


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
