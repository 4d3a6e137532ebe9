"""`kimik3.eagle`, `kimik3.eagle_train`, `kimik3.speculative`: the EAGLE-3 draft head trains what
it will be asked at inference, and speculative decoding never changes the target's answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from kimik3 import config, eagle, eagle_train, model, speculative, tokenizer
from kimik3.generate import generate


def test_ttt_step_j_at_slot_i_is_the_chain_started_at_slot_i(tiny_cfg, tiny_params):
    """Training-time test computes, for every slot at once, what the chained draft computes one
    slot at a time: step 0 on the target's features, step j on the draft's own step j - 1."""
    ecfg = eagle.EagleConfig(taps=(1, 2, 3), ffn_dim=96, ttt_steps=4)
    draft = eagle.init_draft(jax.random.PRNGKey(3), tiny_cfg, ecfg, tiny_params)
    toks = jax.random.randint(jax.random.PRNGKey(4), (2, 20), 0, 256)
    _, taps = model.forward_taps(tiny_params, tiny_cfg, toks, ecfg.taps, kernels="reference")
    ttt = jax.jit(eagle.ttt_logits, static_argnums=(1, 2))(draft, tiny_cfg, ecfg, tiny_params["embed_vd"], taps, toks)
    chain_fn = jax.jit(eagle.draft_chain, static_argnums=(1, 5))
    assert ttt.shape == (4, 2, 20, tiny_cfg.vocab_size)
    for b, i in [(0, 0), (1, 13)]:
        n = i + 2  # the chain's first slot i reads (h_i, x_{i+1})
        chain = chain_fn(
            draft, tiny_cfg, tiny_params["embed_vd"], taps[b], toks[b, :n], 4, greedy_tokens=toks[b, n : n + 3]
        )
        np.testing.assert_allclose(np.asarray(chain), np.asarray(ttt[:, b, i]), rtol=1e-5, atol=1e-5)


def test_the_drafts_own_kv_cache_gives_the_no_cache_chain(tiny_cfg, tiny_params):
    """The draft's MLA latent rows cached as the target's are (a contiguous cache here; the paged
    form is the MLA layer's own, tested there): the committed slots prefilled in one call, then
    one slot per drafted token, equal the no-cache chain."""
    from kimik3.layers.mla import init_mla_cache

    ecfg = eagle.default_config(tiny_cfg)
    draft = eagle.init_draft(jax.random.PRNGKey(5), tiny_cfg, ecfg, tiny_params)
    embed = tiny_params["embed_vd"]
    toks = jax.random.randint(jax.random.PRNGKey(6), (1, 14), 0, 256)
    _, taps = model.forward_taps(tiny_params, tiny_cfg, toks, ecfg.taps, kernels="reference")
    n, k = 11, 3
    want = jax.jit(eagle.draft_chain, static_argnums=(1, 5))(
        draft, tiny_cfg, embed, taps[0], toks[0, :n], k, greedy_tokens=toks[0, n : n + k - 1]
    )
    step = jax.jit(lambda feat, tok, pos, cache: eagle.draft_layer(draft, tiny_cfg, feat, embed[tok], pos, cache))
    cache = init_mla_cache(tiny_cfg, 1, 32, jnp.float32)
    feat = eagle.fuse(draft, taps[:, : n - 1])
    hidden, cache = step(feat, toks[:, 1:n], jnp.arange(n - 1)[None], cache)
    got = [eagle.draft_logits(draft, tiny_cfg, hidden[:, -1:])[0, 0]]
    for s in range(1, k):
        hidden, cache = step(hidden[:, -1:], toks[:, n + s - 1 : n + s], jnp.full((1, 1), n - 2 + s), cache)
        got.append(eagle.draft_logits(draft, tiny_cfg, hidden)[0, 0])
    np.testing.assert_allclose(np.stack(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# `trained_draft` (tests/conftest.py): the draft of `trained_tiny`, shared with tests/serving/test_engine_speculative.py


def test_training_on_the_targets_continuations_teaches_the_draft_to_agree_with_it(trained_draft):
    _, result, _, _ = trained_draft
    before, after = result["held_out_before"], result["held_out_after"]
    assert len(after["acc"]) == 3
    # a fresh draft agrees with the target's top-1 by chance (~1/288); 60 steps get past 30% at every depth
    assert max(before["acc"]) < 0.05 and min(after["acc"]) > 0.3, (before, after)
    assert all(a < b for a, b in zip(after["ce"], before["ce"]))


@pytest.fixture(scope="session")
def oracle_tokens(trained_draft):
    params = trained_draft[0]
    prompt = tokenizer.encode("Permission is hereby granted")
    return prompt, generate(params, config.tiny(), prompt, 32).tokens


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cached"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_speculative_decoding_emits_the_oracles_tokens(trained_draft, oracle_tokens, k, use_cache):
    params, _, _, out = trained_draft
    cfg = config.tiny()
    draft, ecfg = eagle_train.load_draft(out + "/draft", cfg, params)
    prompt, want = oracle_tokens
    got = speculative.speculative_generate(params, cfg, draft, ecfg, prompt, 32, k, use_cache=use_cache)
    np.testing.assert_array_equal(got.tokens, want)
    assert sum(got.accepted) > 0 and max(got.accepted) <= k  # drafts were kept: the accept path ran
    assert 1.0 < got.accept_length <= k + 1 and 0.0 < got.acceptance <= 1.0


def test_sampling_with_a_draft_is_reproducible_and_stops_at_max_tokens(trained_draft):
    params, _, draft, out = trained_draft
    cfg = config.tiny()
    _, ecfg = eagle_train.load_draft(out + "/draft", cfg, params)
    prompt = tokenizer.encode("The licence")
    a = speculative.speculative_generate(params, cfg, draft, ecfg, prompt, 20, 3, temperature=0.8, seed=5)
    b = speculative.speculative_generate(params, cfg, draft, ecfg, prompt, 20, 3, temperature=0.8, seed=5)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    c = speculative.speculative_generate(
        params, cfg, draft, ecfg, prompt, 20, 3, temperature=0.8, seed=5, use_cache=True
    )  # the same logits (to fp32 rounding), the same draws
    np.testing.assert_array_equal(c.tokens, a.tokens)
    assert a.tokens.shape == (20,) and ((0 <= a.tokens) & (a.tokens < cfg.vocab_size)).all()


@pytest.mark.parametrize("keep", [1, 3, 5])
def test_a_verify_pass_committed_to_its_first_tokens_is_the_cache_of_those_tokens_alone(tiny_cfg, tiny_params, keep):
    """The cached target's verify pass over T = 5 tokens, then `commit` of the first `keep`: KDA
    state and conv rows, lengths and the MLA rows they cover equal a pass over those tokens only,
    and the next token's logits from either cache agree."""
    rng = np.random.default_rng(keep)
    prompt = jnp.asarray(rng.integers(1, tiny_cfg.vocab_size, (1, 11)), jnp.int32)
    new = jnp.asarray(rng.integers(1, tiny_cfg.vocab_size, (1, 5)), jnp.int32)
    taps = (0, 1, 2)
    run = lambda toks, cache, per_token: speculative._cached_pass(
        tiny_params, toks, cache, cfg=tiny_cfg, layers=taps, per_token=per_token
    )
    _, _, cache0, _ = run(prompt, model.init_cache(tiny_cfg, 1, 32, jnp.float32), False)
    _, _, after, exports = run(new, cache0, True)
    got = speculative.commit(cache0, after, exports, jnp.asarray([keep], jnp.int32), cfg=tiny_cfg)
    _, _, want, _ = run(new[:, :keep], cache0, False)
    assert int(got["lengths"][0]) == int(want["lengths"][0]) == 11 + keep
    # fp32 both, but the verify pass runs KDA one token a chunk and `want` in one chunk: sums in
    # another order (~1e-6 relative a layer)
    tol = dict(rtol=1e-4, atol=1e-5)
    for kind, g, w in zip(tiny_cfg.mixer_kinds, got["layers"], want["layers"]):
        if kind == "kda":
            for name in ("state", "conv"):
                np.testing.assert_allclose(np.asarray(getattr(g, name)), np.asarray(getattr(w, name)), **tol)
        else:
            np.testing.assert_allclose(
                np.asarray(g.latent[:, : 11 + keep]), np.asarray(w.latent[:, : 11 + keep]), **tol
            )
    nxt = jnp.asarray([[7]], jnp.int32)
    # the logits sum those rows' differences through every layer: tests/kimik3/test_model.py's fp32
    # tolerance for logits of caches built in other orders (O(1) logits, ~2e-5 seen)
    np.testing.assert_allclose(
        np.asarray(run(nxt, got, False)[0]), np.asarray(run(nxt, want, False)[0]), rtol=0, atol=2e-4
    )


def _markov_two_tokens(target, draft, k, n, seed):
    """Sample the first two tokens after token 0 with speculative sampling, where the target is the
    Markov chain `target` [V, V] (row x: p(next | x)) and the draft the chain `draft`."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(target.shape, np.int64)
    logit = lambda p: np.log(np.maximum(p, 1e-300))
    for _ in range(n):
        out, last = [], 0
        t0 = int(rng.choice(target.shape[0], p=target[last]))
        while len(out) < 2:
            out.append(t0)
            ds, qs, x = [], [], t0
            for _ in range(k):
                qs.append(draft[x])
                x = int(rng.choice(draft.shape[0], p=draft[x]))
                ds.append(x)
            target_logits = logit(target[[t0] + ds])  # p after t0, d_1 .. d_k
            a, t0 = speculative.accept(target_logits, ds, np.stack(qs), temperature=1.0, rng=rng)
            out.extend(ds[:a])
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_sampling_keeps_the_targets_distribution(k):
    """Chi-square on the joint of the first two emitted tokens: rejection sampling emits the
    target's distribution whatever the draft proposes (here a draft far from the target); the
    draft's own chain, sampled the same way, is refused by the same test."""
    v = 4
    rng = np.random.default_rng(0)
    target = rng.dirichlet(np.ones(v), size=v)
    draft = rng.dirichlet(np.ones(v) * 0.3, size=v)
    exact = target[0][:, None] * target  # p(x1 = a) p(x2 = b | a)
    n = 6000
    counts = _markov_two_tokens(target, draft, k, n, seed=k)
    assert stats.chisquare(counts.ravel(), exact.ravel() * n).pvalue > 1e-3
    wrong = draft[0][:, None] * draft  # what emitting the drafts unverified would give
    assert stats.chisquare(counts.ravel(), wrong.ravel() * n).pvalue < 1e-6


def test_greedy_accept_keeps_the_agreeing_prefix_and_takes_the_targets_next():
    logits = np.full((4, 5), -1.0)
    logits[[0, 1, 2, 3], [2, 4, 1, 3]] = 1.0  # the target's argmax after t0, d1, d2, d3
    assert speculative.accept(logits, [2, 4, 0]) == (2, 1)
    assert speculative.accept(logits, [2, 4, 1]) == (3, 3)
    assert speculative.accept(logits, [0, 4, 1]) == (0, 2)


def test_bad_draft_requests_get_clear_errors(tiny_cfg, tiny_params, tmp_path):
    ecfg = eagle.default_config(tiny_cfg)
    draft = eagle.init_draft(jax.random.PRNGKey(0), tiny_cfg, ecfg, tiny_params)
    for k in (0, speculative.MAX_DRAFT_TOKENS + 1):
        with pytest.raises(ValueError, match="draft tokens k"):
            speculative.speculative_generate(tiny_params, tiny_cfg, draft, ecfg, [1, 2], 4, k)
    other = config.mini()
    with pytest.raises(ValueError, match="does not fit target mini"):
        speculative.check_draft(other, eagle.default_config(other), draft, 2)
    with pytest.raises(ValueError, match="taps"):
        eagle.EagleConfig(taps=(1, 2), ffn_dim=8)
    with pytest.raises(ValueError, match="must lie in"):
        eagle.init_draft(jax.random.PRNGKey(0), tiny_cfg, eagle.EagleConfig(taps=(1, 2, 9), ffn_dim=8), tiny_params)
    eagle_train.save_draft(tmp_path / "d", draft, ecfg, tiny_cfg, tiny_params)
    restored, ecfg2 = eagle_train.load_draft(tmp_path / "d", tiny_cfg, tiny_params)
    assert ecfg2 == ecfg
    jax.tree.map(np.testing.assert_array_equal, restored, jax.tree.map(np.asarray, draft))
    other_weights = jax.tree.map(lambda x: x, tiny_params)
    other_weights["lm_head_dv"] = tiny_params["lm_head_dv"] * 2
    with pytest.raises(ValueError, match="other tiny weights"):
        eagle_train.load_draft(tmp_path / "d", tiny_cfg, other_weights)
    with pytest.raises(ValueError, match="another config"):
        eagle_train.load_draft(tmp_path / "d", other, tiny_params)
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        eagle_train.load_draft(tmp_path, tiny_cfg, tiny_params)
    with pytest.raises(ValueError, match="data"):
        eagle_train.DraftTrainConfig(data="web")


@pytest.mark.slow  # KIMIK3_SLOW=1: 30 s (the suite must stay under 20 min on 2 cores); the draft's training
# and speculative decoding run in the fast tests above, this adds the CLI's wiring
def test_the_cli_trains_a_draft_and_decodes_with_it(trained_tiny, trained_draft, tmp_path, capsys):
    from serving import cli

    target = trained_tiny[1]["checkpoint"]
    out = str(tmp_path / "e")
    assert (
        cli.main(
            [
                "train-eagle",
                "--checkpoint",
                target,
                "--out",
                out,
                "--steps",
                "3",
                "--batch",
                "4",
                "--seq-len",
                "32",
                "--prompt-len",
                "8",
                "--pool",
                "4",
                "--data",
                "text",
                "--corpus",
                "licenses",
            ]
        )
        == 0
    )
    assert "held-out top-1 agreement" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "generate",
                "--checkpoint",
                target,
                "--draft-checkpoint",
                trained_draft[3] + "/draft",
                "--draft-tokens",
                "2",
                "--prompt",
                "Hi",
                "--max-new-tokens",
                "6",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "draft acceptance" in text and "k=2" in text and "cached" in text
    # a draft without its target, and a draft of other weights: refused before any decoding
    assert cli.main(["generate", "--config", "tiny", "--draft-checkpoint", out + "/draft"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
