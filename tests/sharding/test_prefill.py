"""Sharded prefill (TP attention, SP between layers, EP MoE) == the single-device model."""

import collections

import numpy as np
import pytest

from kimik3 import model
from sharding import plan
from sharding.mesh import MeshShape, prefill_mesh
from sharding.prefill import ShardedPrefill
from tests.sharding.conftest import hlo_bytes, hlo_collectives

BATCH, SEQ, MAX_LEN = 2, 16, 32
# (config fixture, tp, ep): tp == ep, tp > ep (expert replica groups), the full 8 ranks, and the
# Kimi-Linear variant (its own layer list, gate, FFNs and MoE without a latent).
CASES = [("tiny", 2, 2), ("tiny8", 4, 2), ("tiny8", 8, 8), ("kl8", 4, 4)]


def _setup(request, name):
    return request.getfixturevalue(f"{name}_cfg"), request.getfixturevalue(f"{name}_params")


@pytest.fixture(scope="session", params=CASES, ids=lambda c: f"{c[0]}-tp{c[1]}-ep{c[2]}")
def prefilled(request, devices):
    """Compile once per case; run the compiled program; keep its HLO text."""
    name, tp, ep = request.param
    cfg, params = _setup(request, name)
    tokens = np.random.default_rng(tp * 10 + ep).integers(0, 256, (BATCH, SEQ)).astype(np.int32)
    cache = model.init_cache(cfg, BATCH, MAX_LEN)
    sp = ShardedPrefill(cfg, prefill_mesh(tp, ep, devices=devices[:tp], cfg=cfg), dispatch="dense")
    p_sh, c_sh = sp.place_params(params), sp.place_cache(cache)
    compiled = sp.lower(p_sh, tokens, c_sh).compile()
    logits, new_cache = compiled(p_sh, tokens, c_sh, None)  # (params, tokens, cache, images)
    ref_logits, ref_cache = model.forward(params, cfg, tokens, cache=cache)
    return dict(
        cfg=cfg,
        tp=tp,
        ep=ep,
        tokens=tokens,
        logits=logits,
        cache=new_cache,
        ref_logits=ref_logits,
        ref_cache=ref_cache,
        hlo=compiled.as_text(),
        sp=sp,
        p_sh=p_sh,
    )


def test_logits_equal_single_device(prefilled):
    got, want = np.asarray(prefilled["logits"]), np.asarray(prefilled["ref_logits"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_cache_equal_single_device(prefilled):
    """KDA state/conv (split over heads) and MLA latent rows (replicated) equal the model's cache."""
    got, want = prefilled["cache"], prefilled["ref_cache"]
    np.testing.assert_array_equal(np.asarray(got["lengths"]), np.asarray(want["lengths"]))
    for i, (g, w) in enumerate(zip(got["layers"], want["layers"])):
        assert type(g) is type(w), i
        for key, want_rows in vars(w).items():
            np.testing.assert_allclose(
                np.asarray(getattr(g, key)), np.asarray(want_rows), rtol=1e-4, atol=1e-4, err_msg=f"layer {i} {key}"
            )


def test_hlo_has_the_planned_collectives(prefilled):
    """reduce-scatter, all-to-all and all-gather are in the compiled program, exactly as many and as large
    as `sharding.plan.collectives` says; no all-reduce."""
    cfg, tp, ep = prefilled["cfg"], prefilled["tp"], prefilled["ep"]
    found = hlo_collectives(prefilled["hlo"])
    kinds = collections.Counter(k for k, _, _ in found)
    assert kinds["reduce-scatter"] == cfg.n_layers
    assert kinds["all-gather"] == cfg.n_layers
    n_moe = sum(cfg.ffn_kind(i) == "moe" for i in range(cfg.n_layers))
    assert kinds["all-to-all"] == 3 * n_moe  # ids + rows there, rows back, per MoE layer
    assert kinds.keys() <= {"reduce-scatter", "all-gather", "all-to-all"}
    planned = plan.collectives(cfg, MeshShape("prefill", tp, ep), BATCH, SEQ, "float32", "dense")
    assert collections.Counter((c.kind, c.bytes, c.group) for c in planned) == collections.Counter(
        (k, hlo_bytes(k, s, g), g) for k, s, g in found
    )


def test_no_all_gather_of_expert_weights(prefilled):
    """Every all-gather gathers the activations [B, T, D]; expert weights are never gathered."""
    cfg = prefilled["cfg"]
    gathered = {
        tuple(dims) for k, shapes, _ in hlo_collectives(prefilled["hlo"]) if k == "all-gather" for _, dims in shapes
    }
    assert gathered == {(BATCH, SEQ, cfg.d_model)}
    # and each device holds only its experts
    w = prefilled["p_sh"][f"layer_{cfg.dense_layers}"]["moe"]["w_gate_elf"]
    assert {s.data.shape[0] for s in w.addressable_shards} == {cfg.n_routed_experts // prefilled["ep"]}


def test_images_and_no_cache(tiny_cfg, tiny_params, devices):
    """Prefill without a cache, with an image spliced in (the model's ViT runs replicated)."""
    from kimik3 import tokenizer

    cfg = tiny_cfg
    n_img = cfg.vit.tokens_per_image
    tokens = np.random.default_rng(5).integers(0, 256, (1, 16)).astype(np.int32)
    tokens[0, 2 : 2 + n_img] = tokenizer.IMAGE_ID
    images = np.random.default_rng(6).random((1, 16, 16, 3)).astype(np.float32)
    sp = ShardedPrefill(cfg, prefill_mesh(2, 2, devices=devices[2:4], cfg=cfg), dispatch="dense")
    logits, cache = sp(sp.place_params(tiny_params), tokens, images=images)
    want, _ = model.forward(tiny_params, cfg, tokens, images=images)
    assert cache is None
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_span_not_multiple_of_tp_raises(tiny_cfg, tiny_params, devices):
    sp = ShardedPrefill(tiny_cfg, prefill_mesh(2, 2, devices=devices[:2]))
    with pytest.raises(ValueError, match="not a multiple of tp=2"):
        sp(tiny_params, np.zeros((1, 7), np.int32))
