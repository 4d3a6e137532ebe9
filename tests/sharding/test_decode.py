"""DP/EP decode == the single-device model; prefill on one mesh, decode on another (the P/D handoff)."""

import collections

import numpy as np
import pytest

from kimik3 import model
from kimik3.generate import generate
from sharding import plan
from sharding.decode import ShardedDecode
from sharding.mesh import MeshShape, decode_mesh, prefill_mesh
from sharding.prefill import ShardedPrefill
from tests.sharding.conftest import hlo_bytes, hlo_collectives

BATCH, PROMPT, MAX_LEN, STEPS = 8, 8, 32, 3


@pytest.fixture(scope="session")
def prompts():
    return np.random.default_rng(7).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)


# (4, 2) and (2, 2) run through the serving engine's DP decode (tests/sharding/test_engine_ranks.py)
@pytest.fixture(scope="session", params=[(8, 8)], ids=lambda c: f"dp{c[0]}-ep{c[1]}")
def pd_run(request, tiny_cfg, tiny_params, prompts, devices):
    """Prefill on a tp2,ep2 mesh of devices 0-1, hand the cache to a decode mesh, decode STEPS greedy
    tokens there; the single-device model runs the same steps beside it."""
    dp, ep = request.param
    cfg = tiny_cfg
    sp = ShardedPrefill(cfg, prefill_mesh(2, 2, devices=devices[:2], cfg=cfg), dispatch="dense")
    logits, cache = sp(sp.place_params(tiny_params), prompts, sp.place_cache(model.init_cache(cfg, BATCH, MAX_LEN)))
    sd = ShardedDecode(cfg, decode_mesh(dp, ep, devices=devices[-dp:], cfg=cfg), dispatch="dense")
    params = sd.place_params(tiny_params)
    cache = sd.place_cache(cache)  # reshard: heads-split (prefill) -> requests-split (decode)
    ref_logits, ref_cache = model.forward(tiny_params, cfg, prompts, cache=model.init_cache(cfg, BATCH, MAX_LEN))
    steps = []
    nxt = np.asarray(logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
    ref_nxt = np.asarray(ref_logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
    for _ in range(STEPS):
        logits, cache = sd(params, nxt, cache)
        ref_logits, ref_cache = model.forward(tiny_params, cfg, ref_nxt, cache=ref_cache)
        steps.append((nxt, np.asarray(logits), ref_nxt, np.asarray(ref_logits)))
        nxt = np.asarray(logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
        ref_nxt = np.asarray(ref_logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
    hlo = sd.lower(params, nxt, cache).compile().as_text()
    return dict(dp=dp, ep=ep, steps=steps, cache=cache, ref_cache=ref_cache, hlo=hlo, last=nxt)


def test_decode_equals_single_device(pd_run):
    for i, (tok, got, ref_tok, want) in enumerate(pd_run["steps"]):
        np.testing.assert_array_equal(tok, ref_tok, err_msg=f"step {i} input tokens")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {i}")


def test_cache_lives_on_its_owner(pd_run, tiny_cfg):
    """Each rank holds only its requests' KV and KDA state, and they equal the model's."""
    dp = pd_run["dp"]
    for i, (g, w) in enumerate(zip(pd_run["cache"]["layers"], pd_run["ref_cache"]["layers"])):
        assert type(g) is type(w), i
        for key, want in vars(w).items():
            shards = getattr(g, key).addressable_shards
            assert {s.data.shape[0] for s in shards} == {BATCH // dp}, (i, key)
            assert len({s.index for s in shards}) == dp, (i, key)  # no two ranks hold the same rows
            np.testing.assert_allclose(np.asarray(getattr(g, key)), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal_the_oracle(pd_run, tiny_cfg, tiny_params, prompts):
    """Row 0's tokens (prompt's greedy continuation) equal the no-cache fp32 oracle's."""
    oracle = generate(tiny_params, tiny_cfg, prompts[0], STEPS + 1)
    got = [int(s[0][0, 0]) for s in pd_run["steps"]] + [int(pd_run["last"][0, 0])]
    assert got == [int(t) for t in oracle.tokens]


def test_hlo_only_expert_all_to_all(pd_run, tiny_cfg):
    """Attention is data-parallel: the only collectives are the MoE all-to-alls, sized as planned."""
    found = hlo_collectives(pd_run["hlo"])
    assert {k for k, _, _ in found} == {"all-to-all"}
    shape = MeshShape("decode", pd_run["dp"], pd_run["ep"])
    planned = plan.collectives(tiny_cfg, shape, BATCH, 1, "float32", "dense")
    assert collections.Counter((c.kind, c.bytes, c.group) for c in planned) == collections.Counter(
        (k, hlo_bytes(k, s, g), g) for k, s, g in found
    )


def test_batch_not_multiple_of_dp_raises(tiny_cfg, tiny_params, devices):
    sd = ShardedDecode(tiny_cfg, decode_mesh(4, 2, devices=devices[:4]))
    with pytest.raises(ValueError, match="not a multiple of dp=4"):
        sd(tiny_params, np.zeros((2, 1), np.int32), model.init_cache(tiny_cfg, 2, 16))


def test_the_kimi_linear_variant_decodes_as_the_single_device_model(kl8_cfg, kl8_params, prompts, devices):
    """Its irregular layer list, unbounded gate, gate-less MLA and latent-free SwiGLU MoE through
    the prefill mesh, the handoff and the DP/EP decode mesh."""
    cfg, params = kl8_cfg, kl8_params
    sp = ShardedPrefill(cfg, prefill_mesh(2, 2, devices=devices[:2], cfg=cfg), dispatch="dense")
    logits, cache = sp(sp.place_params(params), prompts, sp.place_cache(model.init_cache(cfg, BATCH, MAX_LEN)))
    sd = ShardedDecode(cfg, decode_mesh(4, 4, devices=devices[-4:], cfg=cfg), dispatch="dense")
    p_sd, cache = sd.place_params(params), sd.place_cache(cache)
    ref_logits, ref_cache = model.forward(params, cfg, prompts, cache=model.init_cache(cfg, BATCH, MAX_LEN))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-4, atol=1e-4)
    nxt = np.asarray(ref_logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
    for _ in range(2):
        logits, cache = sd(p_sd, nxt, cache)
        ref_logits, ref_cache = model.forward(params, cfg, nxt, cache=ref_cache)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-4, atol=1e-4)
        nxt = np.asarray(ref_logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
