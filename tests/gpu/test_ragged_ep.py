"""The GPU's expert dispatch (`ragged_all_to_all`) on two GPUs: TP2/EP2 prefill and DP2/EP2 decode
with dispatch="ragged" equal the single-device model (every CPU sharding test pins "dense",
the only dispatch XLA:CPU has).

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 -m pytest -q tests/gpu/test_ragged_ep.py   # two GPUs

fp32 at the highest matmul precision, so the sharded and single-device programs differ only by
summation order (1e-4 on O(1) logits), and greedy tokens must match exactly."""

import jax
import numpy as np
import pytest

from kimik3 import model
from kimik3.generate import generate
from sharding.decode import ShardedDecode
from sharding.mesh import decode_mesh, prefill_mesh
from sharding.prefill import ShardedPrefill

pytestmark = pytest.mark.skipif(
    len([d for d in jax.devices() if d.platform == "gpu"]) < 2 if jax.default_backend() == "gpu" else True,
    reason="needs 2 GPUs",
)
BATCH, PROMPT, MAX_LEN, STEPS = 4, 24, 64, 4
TOL = dict(rtol=1e-4, atol=1e-4)


def test_ragged_prefill_then_ragged_decode_equal_the_single_device_model(tiny_cfg, tiny_params):
    cfg, devices = tiny_cfg, jax.devices()[:2]
    prompts = np.random.default_rng(11).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        sp = ShardedPrefill(cfg, prefill_mesh(2, 2, devices=devices, cfg=cfg), dispatch="ragged")
        logits, cache = sp(sp.place_params(tiny_params), prompts, sp.place_cache(model.init_cache(cfg, BATCH, MAX_LEN)))
        ref_logits, ref_cache = model.forward(tiny_params, cfg, prompts, cache=model.init_cache(cfg, BATCH, MAX_LEN))
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), err_msg="prefill", **TOL)
        sd = ShardedDecode(cfg, decode_mesh(2, 2, devices=devices, cfg=cfg), dispatch="ragged")
        params, cache = sd.place_params(tiny_params), sd.place_cache(cache)
        nxt = np.asarray(logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
        tokens = [nxt[:, 0]]
        for i in range(STEPS):
            logits, cache = sd(params, nxt, cache)
            ref_logits, ref_cache = model.forward(tiny_params, cfg, nxt, cache=ref_cache)
            np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), err_msg=f"decode step {i}", **TOL)
            nxt = np.asarray(logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
            tokens.append(nxt[:, 0])
        oracle = generate(tiny_params, cfg, prompts[0], STEPS + 1).tokens
    assert [int(t[0]) for t in tokens] == [int(t) for t in oracle]
