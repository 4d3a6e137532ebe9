"""The model's kernel dispatch on the GPU it serves on, and the serving path in bf16 and fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import config, generate, model, ops
from serving.engine import Engine, EngineConfig
from tests.gpu.conftest import sm90


@pytest.mark.skipif(not sm90(), reason="sm_90 dispatch")
def test_small_dispatches_its_mla_to_the_hopper_kernels():
    cc = ops.device_compute_capability()
    cfg = config.small()
    assert ops.mla_prefill_impl(jnp.bfloat16, cfg.mla_qk_dim, cfg.v_head_dim, cc) == "hopper"
    # decode: 16 heads x 1 token fill no 64-row tile; long tables take the Hopper kernel anyway
    assert ops.mla_decode_impl(jnp.bfloat16, cfg.kv_lora_rank, cfg.qk_rope_dim, 128, 16, 2048, cc) == "triton"
    assert ops.mla_decode_impl(jnp.bfloat16, cfg.kv_lora_rank, cfg.qk_rope_dim, 128, 16, 16384, cc) == "hopper"
    assert ops.mla_decode_impl(jnp.bfloat16, cfg.kv_lora_rank, cfg.qk_rope_dim, 128, 96, 2048, cc) == "hopper"


def _oracle(params, cfg, prompt, n):
    return generate.generate(params, cfg, prompt, n, use_cache=False).tokens


def _bf16_engine(params, cfg):
    return Engine(
        params,
        cfg,
        EngineConfig(
            num_pages=64,
            num_slots=4,
            num_snapshots=16,
            page_tokens=16,
            kda_block_tokens=64,
            max_pages_per_request=16,
            prefill_chunk_tokens=64,
        ),
    )


def test_a_bf16_engine_with_ragged_batches_and_padded_rows_gives_each_request_its_own_tokens():
    """tiny in bf16 through the Pallas kernels: three ragged prompts share decode batches padded
    to a power of two (scratch rows) and padded prefill chunks; each request's greedy tokens equal
    those it gets alone in the same engine.  A failure here means rows leak into each other (a
    padded row, a shared slot) or the GPU's GEMMs are not batch-invariant: either is a finding."""
    cfg = config.tiny().replace(dtype="bfloat16")
    params = model.init_params(cfg, jax.random.PRNGKey(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (37, 130, 5)]
    eng = _bf16_engine(params, cfg)
    reqs = [eng.submit(p, 6) for p in prompts]
    eng.run(max_steps=200)
    for req, p in zip(reqs, prompts):
        alone = _bf16_engine(params, cfg)
        want = alone.submit(p, 6)
        alone.run(max_steps=200)
        assert req.output == want.output, req.request_id


@pytest.mark.parametrize("kernels", ["pallas", "reference"])
def test_small_fp32_cached_generate_gives_the_oracles_tokens(kernels):
    """`small` with fp32 params at the highest matmul precision: the cached path (Pallas or
    reference kernels) gives the no-cache fp32 oracle's greedy tokens."""
    cfg = config.small().replace(dtype="float32")
    params = model.init_params(cfg, jax.random.PRNGKey(0), "float32")
    prompt = np.random.default_rng(1).integers(0, 256, 300).tolist()
    with jax.default_matmul_precision("highest"):
        want = _oracle(params, cfg, prompt, 4)
        got = generate.generate(params, cfg, prompt, 4, use_cache=True, kernels=kernels).tokens
    np.testing.assert_array_equal(got, want)


def test_speculative_rounds_on_the_pallas_kernels_give_the_oracles_tokens():
    """tiny in fp32 (highest matmul precision) with an EAGLE-3 draft, k = 3: the verify pass runs
    KDA as the recurrent kernel exporting every token's state, MLA decode over 4 query tokens,
    rounds chained on the device (the next round dispatched before the host reads this one);
    every request's greedy tokens equal the no-cache oracle's, and the kept drafts are counted."""
    from kimik3 import eagle

    cfg = config.tiny().replace(dtype="float32")
    params = model.init_params(cfg, jax.random.PRNGKey(5), "float32")
    ecfg = eagle.default_config(cfg)
    draft = eagle.init_draft(jax.random.PRNGKey(6), cfg, ecfg, params)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(32, 127, n).tolist() for n in (21, 70)]
    with jax.default_matmul_precision("highest"):
        want = [_oracle(params, cfg, p, 20) for p in prompts]
        eng = Engine(
            params,
            cfg,
            EngineConfig(
                num_pages=64,
                num_slots=2,
                num_snapshots=16,
                page_tokens=16,
                kda_block_tokens=64,
                max_pages_per_request=16,
                prefill_chunk_tokens=64,
                draft_tokens=3,
            ),
            draft=(draft, ecfg),
        )
        reqs = [eng.submit(p, 20) for p in prompts]
        eng.run(max_steps=200)
    for req, w in zip(reqs, want):
        assert req.output == list(np.asarray(w).tolist()), req.request_id
    s = eng.spec.stats
    assert s.rounds > 0 and s.drafted == 3 * s.rounds and s.chained > 0


@pytest.mark.skipif(not sm90(), reason="the Hopper chunk kernel")
def test_small_bf16_chunks_over_a_cache_on_the_hopper_kernel_are_as_close_to_fp32_as_on_the_triton_one(monkeypatch):
    """`small`'s dims in bf16 (four layers: one MLA, the compiles of six forwards kept short; at
    16 layers the test outran 150 s on an H100): 256 tokens prefilled, then 100 more over that
    cache (the expanded form, a chunk continuing a cache).  The chunk's logits with the Hopper
    chunk kernel and with the Triton one, each against the same model in fp32 on the reference
    kernels: the Hopper kernel's error is no larger than the Triton kernel's (x 1.25, bf16's spread between two
    kernels summing in different orders), and the two agree with each other as closely.  (Token
    equality between two bf16 kernels is no test on random weights: their logits are nearly
    flat, so a near-tie flips on either kernel's rounding.)"""
    from pallas_kernels import mla_hopper

    cfg = config.small().replace(n_layers=4)
    params = model.init_params(cfg, jax.random.PRNGKey(4))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (1, 356)), jnp.int32)
    calls = []
    real = mla_hopper.mla_prefill_chunk_hopper
    monkeypatch.setattr(mla_hopper, "mla_prefill_chunk_hopper", lambda *a, **kw: calls.append(kw) or real(*a, **kw))

    def chunk_logits(p, c, kernels):
        cache = model.init_cache(c, 1, 512)
        _, cache = model.forward(p, c, tokens[:, :256], cache=cache, kernels=kernels)
        return np.asarray(model.forward(p, c, tokens[:, 256:], cache=cache, kernels=kernels)[0], np.float32)

    fcfg = cfg.replace(dtype="float32")
    with jax.default_matmul_precision("highest"):
        want = chunk_logits(model.cast_params(params, jnp.float32), fcfg, "reference")
    got = {}
    for choice in ("triton", "hopper"):
        monkeypatch.setenv("KIMIK3_MLA_CHUNK", choice)
        jax.clear_caches()  # the forward programs are traced once per (cfg, kernels)
        got[choice] = chunk_logits(params, cfg, "pallas")
        assert bool(calls) == (choice == "hopper"), choice
    err = {c: float(np.abs(g - want).mean()) for c, g in got.items()}
    assert err["hopper"] <= 1.25 * err["triton"], err
    assert float(np.abs(got["hopper"] - got["triton"]).mean()) <= 1.25 * err["triton"], err


@pytest.mark.skipif(not sm90(), reason="the Hopper MXFP4 kernel")
def test_small_mxfp4_experts_in_the_hopper_layout_are_as_close_to_fp32_as_the_triton_ones_and_serve(monkeypatch):
    """`small`'s dims in bf16 (four layers), quantized under `fp8_attn` (MXFP4 routed experts) and
    laid out as the model runner lays them out: with the experts moved into the Hopper MXFP4
    layout (`KIMIK3_MOE_MXFP4=auto`) the logits of a 200-token prefill and a decode step over
    its cache are as close to the fp32 model on the same quantized weights (reference kernels)
    as with the Triton MXFP4 kernels (x 1.25), and the two agree with each other as closely.
    Then an engine under `auto` holds the moved experts and serves two requests to the end."""
    from kimik3 import stacked
    from kimik3 import quant_store as store
    from pallas_kernels import moe_mxfp4_hopper

    cfg = config.small().replace(n_layers=4)
    params = store.quantize_params(model.init_params(cfg, jax.random.PRNGKey(7), "float32"), cfg, "fp8_attn")
    served = stacked.serving_layout(params, cfg, scan=False)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (1, 201)), jnp.int32)
    is_moved = lambda tree: any(
        isinstance(x, moe_mxfp4_hopper.HopperMXFP4)
        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, moe_mxfp4_hopper.HopperMXFP4))
    )

    def logits(p, c, kernels):
        cache = model.init_cache(c, 1, 256)
        first, cache = model.forward(p, c, tokens[:, :200], cache=cache, kernels=kernels)
        step = model.forward(p, c, tokens[:, 200:], cache=cache, kernels=kernels)[0]
        return np.concatenate([np.asarray(first, np.float32)[:, -8:], np.asarray(step, np.float32)], axis=1)

    with jax.default_matmul_precision("highest"):
        want = logits(model.cast_params(served, jnp.float32), cfg.replace(dtype="float32"), "reference")
    got = {}
    for choice in ("triton", "auto"):
        monkeypatch.setenv("KIMIK3_MOE_MXFP4", choice)
        jax.clear_caches()
        tree = ops.hopper_mxfp4_experts(served, cfg.dtype)
        assert is_moved(tree) == (choice == "auto"), choice
        got[choice] = logits(tree, cfg, "pallas")
    err = {c: float(np.abs(g - want).mean()) for c, g in got.items()}
    assert err["auto"] <= 1.25 * err["triton"], err
    assert float(np.abs(got["auto"] - got["triton"]).mean()) <= 1.25 * err["triton"], err

    eng = _bf16_engine(params, cfg)
    assert is_moved(eng.runner.params)
    rng = np.random.default_rng(6)
    reqs = [eng.submit(rng.integers(0, 256, n).tolist(), 5) for n in (90, 17)]
    eng.run(max_steps=200)
    assert [len(r.output) for r in reqs] == [5, 5]
