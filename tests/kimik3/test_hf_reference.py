"""Kimi-Linear checkpoints against the outside reference: transformers' own
``KimiLinearForCausalLM`` (pure-torch KDA on the CPU, fp32) on small random configs saved with
``save_pretrained``, loaded by `kimik3.hf`.  Logits agree to 1e-4 (fp32: the two
implementations differ only in summation order, ~1e-6 here) at prefill (T = 37 and 130: one
chunk and a ragged tail after two) and at each of 8 cached decode steps, through `generate`, through
the serving engine (paged pools, a second turn from a prefix hit, a P/D handoff) and through the
scanned layout; greedy tokens are equal.  The layer lists are irregular: one ends in an MLA layer,
one has two dense first layers and a q-LoRA.

transformers and torch come with the ``reference`` extra (`./run.sh test` installs it); CI sets
KIMIK3_REQUIRE_REFERENCE=1, so a missing reference fails there instead of skipping."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

if os.environ.get("KIMIK3_REQUIRE_REFERENCE"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from kimik3 import hf, model, stacked  # noqa: E402
from kimik3.generate import generate  # noqa: E402
from tests.serving.test_engine_logprobs import _log_softmax  # noqa: E402

TOL = 1e-4  # fp32 logits of two implementations of the same math
DECODE_STEPS = 8

# (layer kinds, first_k_dense_replace, q_lora_rank): one ending in MLA, one with two dense layers
# and a q-LoRA, one long enough for the scanned periods with an irregular MLA tail (Kimi-Linear's
# own shape: MLA at 4, 8, 12 and 13, 1-based)
CONFIGS = {
    "mla_last": ("kkkmkm", 1, None),
    "two_dense_qlora": ("kkmkk", 2, 24),
    "scanned_tail": ("kkkmkkkmkkkmm", 1, None),
}


def reference_config(kinds: str, dense: int, q_lora: int | None):
    return transformers.KimiLinearConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=len(kinds),
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=32,
        q_lora_rank=q_lora,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        first_k_dense_replace=dense,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config={
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "k"],
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "m"],
            "head_dim": 16,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
        },
    )


def randomize(m, seed: int) -> None:
    """Weights of a trained model's scale, not the init's 0.02: projections N(0, 1/fan_in),
    norms 1 + N(0, 0.1), A_log as fla draws it (log U(1, 16)), dt_bias and the selection bias
    non-zero, so a mis-read axis, eps or rule changes the logits by far more than the tolerance."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif leaf == "A_log":
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g)))
            elif leaf == "dt_bias":
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:  # rows of rms 0.01: the first pre-norm's eps (1e-5) matters
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
            else:
                # the norms' inputs of rms ~0.003 where an eps acts (MLA's latents: 1e-6; KDA's
                # gated output norm: 1e-5), so an eps mixed up between sites moves the logits
                small = any(n in name for n in ("kv_a_proj", "q_a_proj", "v_proj"))
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) * (0.003 if small else 1.0))
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (directory, the transformers model)}: each config saved with save_pretrained."""
    out = {}
    for seed, (name, spec) in enumerate(CONFIGS.items()):
        torch.manual_seed(seed)
        m = transformers.KimiLinearForCausalLM(reference_config(*spec)).float().eval()
        randomize(m, seed)
        directory = str(tmp_path_factory.mktemp(name))
        m.save_pretrained(directory)
        out[name] = (directory, m)
    return out


def reference_logits(m, ids) -> np.ndarray:
    """transformers' logits [T, V] of a whole sequence."""
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].numpy()


def reference_greedy(m, prompt, steps: int):
    """transformers' greedy decode on its own cache: (tokens, logits [steps, V]), row 0 after the prompt."""
    tokens, rows = [], []
    with torch.no_grad():
        out = m(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            row = out.logits[0, -1].numpy()
            rows.append(row)
            tokens.append(int(np.argmax(row)))
            out = m(
                torch.tensor([[tokens[-1]]]),
                cache=out.cache if hasattr(out, "cache") else out.past_key_values,
                use_cache=True,
            )
    return tokens, np.stack(rows)


def _prompt(cfg, n, seed):
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, n).tolist()


@pytest.mark.parametrize("name", ["mla_last", "two_dense_qlora"])
@pytest.mark.parametrize("t", [37, 130])
def test_prefill_logits_equal_transformers(checkpoints, name, t):
    directory, m = checkpoints[name]
    params, cfg = hf.load(directory, dtype="float32")
    assert cfg.mixer_kinds == tuple({"k": "kda", "m": "mla"}[k] for k in CONFIGS[name][0])
    ids = _prompt(cfg, t, t)
    ours, _ = model.forward(params, cfg, np.asarray([ids]), kernels="reference")
    np.testing.assert_allclose(np.asarray(ours[0]), reference_logits(m, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["mla_last", "two_dense_qlora"])
def test_cached_decode_steps_and_greedy_tokens_equal_transformers(checkpoints, name):
    directory, m = checkpoints[name]
    params, cfg = hf.load(directory, dtype="float32")
    prompt = _prompt(cfg, 70, 5)
    want_tokens, want_logits = reference_greedy(m, prompt, DECODE_STEPS)
    for use_cache in (True, False):  # the cached path and the no-cache oracle
        got = generate(params, cfg, prompt, DECODE_STEPS, use_cache=use_cache, kernels="reference")
        assert got.tokens.tolist() == want_tokens
        np.testing.assert_allclose(got.logits, want_logits, atol=TOL, rtol=0)


def test_the_scanned_layout_with_an_irregular_tail_equals_transformers(checkpoints):
    directory, m = checkpoints["scanned_tail"]
    params, cfg = hf.load(directory, dtype="float32")
    assert stacked.scan_layout(cfg) == (4, 2)  # layers 4..11 scanned, 12 (MLA) unrolled after them
    ids = _prompt(cfg, 37, 11)
    ours, _ = model.forward(
        stacked.serving_layout(params, cfg), cfg, np.asarray([ids]), kernels="reference", programs="whole"
    )
    np.testing.assert_allclose(np.asarray(ours[0]), reference_logits(m, ids), atol=TOL, rtol=0)


def _check_request(req, m, prompt, n):
    tokens, logits = reference_greedy(m, prompt, n)
    assert req.error is None and req.output == tokens
    for tok, entry, row in zip(req.output, req.logprobs, logits):
        assert entry.logprob == pytest.approx(_log_softmax(row)[tok], abs=TOL)


def test_the_engine_serves_transformers_tokens_from_a_prefix_hit_and_a_pd_handoff(checkpoints):
    from serving.disagg import DisaggregatedServer
    from serving.sampling import SamplingParams
    from tests.serving.test_engine import _engine

    directory, m = checkpoints["mla_last"]
    params, cfg = hf.load(directory, dtype="float32")
    sp = SamplingParams(logprobs=1)
    eng = _engine(params, cfg)
    turn1 = _prompt(cfg, 100, 1)
    r1 = eng.submit(turn1, DECODE_STEPS, sampling=sp)
    eng.run(max_steps=200)
    turn2 = turn1 + r1.output + _prompt(cfg, 9, 2)
    r2 = eng.submit(turn2, DECODE_STEPS, sampling=sp)
    eng.run(max_steps=200)
    assert r2.cached_tokens >= 64  # the KDA state at the 64-token block boundary came from the cache
    _check_request(r1, m, turn1, DECODE_STEPS)
    _check_request(r2, m, turn2, DECODE_STEPS)

    server = DisaggregatedServer(
        _engine(params, cfg, role="prefill"), _engine(params, cfg, role="decode"), handoff="direct"
    )
    pd = server.submit(turn1, DECODE_STEPS, sampling=sp)
    server.run(max_steps=200)
    _check_request(server.requests[pd.request_id], m, turn1, DECODE_STEPS)


def test_the_remote_codes_biased_top_k_weights_against_a_reference_with_that_rule(checkpoints, monkeypatch):
    """The checkpoint's own modeling code weights the chosen experts by scores + correction bias
    (transformers and vLLM: by the scores): `moe_biased_weights` reproduces it, and the two rules
    give different logits."""
    directory, m = checkpoints["mla_last"]
    router_cls = type(m.model.layers[1].mlp.gate)

    def biased_forward(self, hidden_states):
        x = hidden_states.view(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        choice = logits.sigmoid() + self.e_score_correction_bias
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = choice.gather(1, ids)
        return logits, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor, ids

    ids = _prompt(m.config, 37, 3)
    unbiased = reference_logits(m, ids)
    monkeypatch.setattr(router_cls, "forward", biased_forward)
    want = reference_logits(m, ids)
    params, cfg = hf.load(directory, dtype="float32", biased_weights=True)
    assert cfg.moe_biased_weights
    ours, _ = model.forward(params, cfg, np.asarray([ids]), kernels="reference")
    np.testing.assert_allclose(np.asarray(ours[0]), want, atol=TOL, rtol=0)
    assert np.abs(want - unbiased).max() > 100 * TOL
