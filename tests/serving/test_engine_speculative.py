"""EAGLE-3 speculative decoding in the engine (`serving.spec_decode`): the greedy tokens
are the oracle's for every k, batched and from prefix hits under each tail rule; sampling keeps
the target's distribution; the draft's rows of a hit are the ones a fresh prefill writes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from cache.host_tier import EmbeddedHostKVTier
from kimik3 import config, eagle_train, tokenizer
from kimik3.generate import generate
from serving.disagg import DisaggregatedServer
from serving.engine import Engine, EngineConfig
from serving.sampling import SamplingParams

PAGE = 16
PROMPTS = [
    "Permission is hereby granted",
    "The licence grants you the right to",
    "This program is free software; you can redistribute it and/or modify",
]  # the last: two chunks


@pytest.fixture(scope="module")
def target(trained_draft):
    params, _, _, out = trained_draft
    cfg = config.tiny()
    return params, cfg, eagle_train.load_draft(out + "/draft", cfg, params)


def _engine(target, k=3, **kw):
    params, cfg, draft = target
    kw = dict(
        dict(
            num_pages=64,
            num_slots=4,
            num_snapshots=16,
            page_tokens=PAGE,
            kda_block_tokens=4 * PAGE,
            max_pages_per_request=16,
            prefill_chunk_tokens=40,
            kernels="reference",
            draft_tokens=k,
        ),
        **kw,
    )
    return Engine(params, cfg, draft=draft, **kw)


def _oracle(target, prompt, n):
    params, cfg, _ = target
    return generate(params, cfg, prompt, n).tokens.tolist()


@pytest.fixture(scope="module")
def oracle(target):
    return {p: _oracle(target, tokenizer.encode(p), 24) for p in PROMPTS}


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_speculative_decoding_in_the_engine_emits_the_oracles_tokens(target, oracle, k):
    eng = _engine(target, k)
    reqs = [eng.submit(tokenizer.encode(p), 24) for p in PROMPTS]  # one batch of three rows
    eng.run(max_steps=300)
    for req, p in zip(reqs, PROMPTS):
        assert req.error is None and req.output == oracle[p]
    kept = [a for r in reqs for a in r.accepted]
    assert sum(kept) > 0 and max(kept) <= k  # drafts were kept: the commit of a partial prefix ran
    s = eng.spec.stats
    assert s.rounds == len(kept) and 1.0 < s.accept_length <= k + 1 and 0.0 < s.acceptance <= 1.0
    # rounds went out before the one before them was read, on rows the device advanced: the
    # host wrote rows only for some rounds (new pages, the batch changing), not for every one
    assert s.chained > 0 and eng.spec.overwrites < len(s.round_s)


# A branching prefix: P is one KDA block (a snapshot boundary), and the page that ends it ends
# where A and B part, so its last draft slot read A's next token, not B's.
P = tokenizer.encode("Permission is hereby granted, free of charge, to any person obtaining ")[: 4 * PAGE]
A = P + tokenizer.encode("a copy of this software")[1:]
B = P + tokenizer.encode("the right to use, copy")[1:]


@pytest.mark.parametrize("tail", ["drop", "no_drop", "exact"])
def test_a_prefix_hit_keeps_the_oracles_tokens_under_each_tail_rule(target, tail):
    assert len(P) == 4 * PAGE and A[len(P)] != B[len(P)]
    eng = _engine(target, eagle_tail=tail)
    eng.submit(A, 6)
    eng.run(max_steps=100)
    b = eng.submit(B, 16)
    eng.run(max_steps=100)
    assert b.output == _oracle(target, B, 16)
    if tail == "drop":  # the matched page is dropped and A kept no snapshot before it: no hit
        assert (b.cached_tokens, b.tail_dropped_tokens) == (0, len(P))
    else:
        assert (b.cached_tokens, b.tail_dropped_tokens) == (len(P), 0)
    assert b.tail_recomputed == (tail == "exact")


def test_after_warmup_a_speculative_engine_serves_without_compiling(target, oracle):
    eng = _engine(target, k=2, num_slots=2)
    assert eng.warmup(threads=2) > 0
    reqs = [eng.submit(tokenizer.encode(p), 24) for p in PROMPTS[:2]]
    eng.run(max_steps=200)
    assert eng.compiles == 0 and [r.output for r in reqs] == [oracle[p] for p in PROMPTS[:2]]


@pytest.mark.parametrize("handoff", ["direct", "store"])
def test_prefill_decode_disaggregation_keeps_the_oracles_tokens(target, oracle, handoff):
    """The prefill engine writes the draft's rows with the target's pages; the decode engine
    verifies from them (direct: the pages, the state and the last slot's feature handed over;
    store: through the shared host tier, the tail prefilled again on the decode side)."""
    host = EmbeddedHostKVTier(1 << 26) if handoff == "store" else None
    server = DisaggregatedServer(
        _engine(target, role="prefill", host=host, publish_to_host=host is not None),
        _engine(target, role="decode", host=host),
        handoff=handoff,
    )
    reqs = [server.submit(tokenizer.encode(p), 24) for p in PROMPTS]
    server.run(max_steps=400)
    for req, p in zip(reqs, PROMPTS):
        got = server.requests[req.request_id]
        assert got.error is None and got.output == oracle[p]
    assert sum(a for r in server.decode.finished for a in r.accepted) > 0


def test_a_preempted_speculative_request_resumes_by_recompute_with_the_oracles_tokens(target):
    """9 pages (8 usable) and two prompts that grow past half of them each: one is preempted
    (with a host tier too: its draft features are not offloaded, so it recomputes)."""
    prompts = [tokenizer.encode(PROMPTS[2]) + tokenizer.encode(" and")[1:], tokenizer.encode(PROMPTS[1])]
    eng = _engine(target, num_pages=9, host=EmbeddedHostKVTier(1 << 24))
    reqs = [eng.submit(p, 48) for p in prompts]
    eng.run(max_steps=400)
    assert eng.preemptions >= 1 and eng.offloaded_resumes == 0 and eng.recomputed_tokens > 0
    for r, p in zip(reqs, prompts):
        assert r.error is None and r.output == _oracle(target, p, 48)


def _tail_row(eng, prompt):
    """The draft's row of slot len(P) - 1 for `prompt`, once its prefill has run."""
    req = eng.submit(prompt, 4)
    while not req.output:
        eng.step()
    page = eng.spec.draft_table(eng, req)[len(P) // PAGE - 1]
    row = np.asarray(eng.kv.dpools["pages"][page, PAGE - 1])
    eng.run(max_steps=50)
    return row


def test_the_exact_rule_recomputes_the_tail_slot_as_a_fresh_prefill_writes_it(target):
    fresh = _tail_row(_engine(target, prefix_caching=False), B)
    rows = {}
    for tail in ("no_drop", "exact"):
        eng = _engine(target, eagle_tail=tail)
        eng.submit(A, 2)
        eng.run(max_steps=50)
        rows[tail] = _tail_row(eng, B)
    np.testing.assert_allclose(rows["exact"], fresh, rtol=1e-5, atol=1e-5)
    assert not np.allclose(rows["no_drop"], fresh, atol=1e-3)  # A's row: it read A's next token


def test_a_hit_from_the_host_tier_carries_the_draft_rows(target):
    host = EmbeddedHostKVTier(1 << 26)
    turn1 = tokenizer.encode(PROMPTS[2])
    first = _engine(target, host=host, publish_to_host=True)
    r1 = first.submit(turn1, 6)
    first.run(max_steps=100)
    turn2 = turn1 + r1.output + tokenizer.encode(" more")[1:]
    second = _engine(target, host=host, eagle_tail="no_drop")
    r2 = second.submit(turn2, 12)
    second.run(max_steps=100)
    assert r2.cached_tokens_host > 0 and r2.output == _oracle(target, turn2, 12)
    assert sum(r2.accepted) > 0
    # an engine without the draft keys its blocks apart: it never reads rows laid out for one
    params, cfg, _ = target
    plain = Engine(
        params,
        cfg,
        num_pages=64,
        num_slots=4,
        num_snapshots=16,
        page_tokens=PAGE,
        kda_block_tokens=4 * PAGE,
        max_pages_per_request=16,
        prefill_chunk_tokens=40,
        kernels="reference",
        host=host,
    )
    r3 = plain.submit(turn2, 2)
    plain.run(max_steps=50)
    assert r3.cached_tokens == 0


def test_sampling_through_the_engine_keeps_the_targets_distribution(target):
    """The second and third sampled tokens (drafted, then accepted or corrected) against the plain
    engine's, over 200 seeds: a chi-square test of homogeneity.  The first token is the
    prefill's, the same draw in both engines."""
    params, cfg, _ = target
    prompt = tokenizer.encode("The licence")
    n = 200

    def draws(eng):
        reqs = [eng.submit(prompt, 3, sampling=SamplingParams(temperature=1.0, seed=s)) for s in range(n)]
        eng.run(max_steps=10_000)
        return np.asarray([r.output for r in reqs])

    kw = dict(num_pages=96, num_slots=8, num_snapshots=24, page_tokens=PAGE, kernels="reference")
    spec = draws(_engine(target, k=2, **kw))
    plain = draws(Engine(params, cfg, **kw))
    np.testing.assert_array_equal(spec[:, 0], plain[:, 0])
    for col in (1, 2):
        tokens, counts = np.unique(np.concatenate([spec[:, col], plain[:, col]]), return_counts=True)
        common = tokens[counts >= 10]  # rarer tokens pooled into one bin
        table = [
            [np.sum(x[:, col] == t) for t in common] + [np.sum(~np.isin(x[:, col], common))] for x in (spec, plain)
        ]
        table = np.asarray(table)[:, np.asarray(table).sum(0) > 0]
        assert stats.chi2_contingency(table)[1] > 1e-3, table


def test_bad_speculative_setups_get_clear_errors(target):
    params, cfg, (draft, ecfg) = target
    kw = dict(num_pages=16, page_tokens=PAGE, kernels="reference")
    with pytest.raises(ValueError, match="both a draft"):
        Engine(params, cfg, draft=(draft, ecfg), **kw)  # no draft_tokens
    with pytest.raises(ValueError, match="both a draft"):
        Engine(params, cfg, draft_tokens=2, **kw)
    with pytest.raises(ValueError, match=r"draft_tokens must be in \[0, 8\]"):
        EngineConfig(num_pages=16, draft_tokens=9)
    with pytest.raises(ValueError, match="eagle_tail"):
        EngineConfig(num_pages=16, eagle_tail="sometimes")
    wrong = dict(draft, fc_fd=jnp.zeros((3 * cfg.d_model, cfg.d_model + 8)))
    with pytest.raises(ValueError, match="does not fit target"):
        Engine(params, cfg, draft=(wrong, ecfg), draft_tokens=2, **kw)
    with pytest.raises(ValueError, match="same draft"):  # P/D where only one side drafts
        DisaggregatedServer(Engine(params, cfg, role="prefill", **kw), _engine(target, role="decode"))
    with pytest.raises(ValueError, match="needs a decode engine with the same draft"):  # and the other way
        Engine(params, cfg, role="decode", **kw).adopt(
            A,
            1,
            4,
            [np.zeros((2, PAGE, cfg.mla_latent_dim))] * 5,
            np.zeros(1),
            request_id="y",
            arrival_s=0.0,
            draft_feature=np.zeros(cfg.d_model),
        )
    with pytest.raises(ValueError, match="draft feature"):  # a handoff from an engine without the draft
        _engine(target, role="decode").adopt(
            A, 1, 4, [np.zeros((3, PAGE, cfg.mla_latent_dim))] * 5, np.zeros(1), request_id="x", arrival_s=0.0
        )
    eng = _engine(target)
    with pytest.raises(ValueError, match="top_p"):
        eng.submit(A, 4, sampling=SamplingParams(temperature=0.7, top_p=0.9))
    with pytest.raises(ValueError, match="exceeds the context limit"):
        eng.submit(A, 16 * PAGE - len(A) - 1)  # fits without the verify pass's k drafts, not with them


def test_a_worker_serves_speculatively_from_its_flags_and_refuses_half_a_setup(trained_tiny, trained_draft):
    import argparse

    from serving import worker

    tc, _, _ = trained_tiny
    out = trained_draft[3]
    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    # the geometry of `_engine(target, eagle_tail="no_drop")`: its programs, from the run's compile cache
    base = [
        "--port",
        "1",
        "--num-pages",
        "64",
        "--num-slots",
        "4",
        "--num-snapshots",
        "16",
        "--page-tokens",
        str(PAGE),
        "--kda-block-tokens",
        str(4 * PAGE),
        "--max-pages-per-request",
        "16",
        "--prefill-chunk-tokens",
        "40",
        "--kernels",
        "reference",
        "--checkpoint",
        tc.out + "/checkpoint",
    ]
    eng, _, info = worker.build_engine(
        parser.parse_args(
            base
            + [
                "--speculative",
                "eagle3",
                "--draft-checkpoint",
                out + "/draft",
                "--draft-tokens",
                "3",
                "--eagle-no-drop",
            ]
        )
    )
    assert eng.spec is not None and info["speculative"] == {
        "method": "eagle3",
        "draft_tokens": 3,
        "eagle_tail": "no_drop",
    }
    req = eng.submit(tokenizer.encode(PROMPTS[0]), 8)
    eng.run(max_steps=50)
    assert req.output == _oracle((eng.params, eng.cfg, None), tokenizer.encode(PROMPTS[0]), 8)
    with pytest.raises(ValueError, match="needs the draft"):
        worker.build_engine(parser.parse_args(base + ["--speculative", "eagle3"]))
    with pytest.raises(ValueError, match="add --speculative eagle3"):
        worker.build_engine(parser.parse_args(base + ["--draft-checkpoint", out + "/draft"]))
    with pytest.raises(ValueError, match="other tiny weights"):  # a draft trained for another target
        worker.build_engine(_other_weights(parser, out))


def _other_weights(parser, out):
    """Worker args whose target is fresh random tiny weights saved as a checkpoint, with the trained draft."""
    import tempfile

    import jax

    from kimik3 import checkpoint, model

    cfg = config.tiny()
    path = tempfile.mkdtemp() + "/ckpt"
    checkpoint.save(path, model.init_params(cfg, jax.random.PRNGKey(7), "float32"), cfg)
    return parser.parse_args(
        [
            "--port",
            "1",
            "--num-pages",
            "32",
            "--speculative",
            "eagle3",
            "--checkpoint",
            path,
            "--draft-checkpoint",
            out + "/draft",
        ]
    )


def test_acceptance_on_the_device_is_the_reference_rule(rng):
    """`accept_on_device` against `kimik3.speculative.accept`: greedy rows exactly; sampled rows
    by the distribution of the first emitted token (the target's p_0 whatever q proposes)."""
    import jax

    from kimik3 import speculative
    from serving.spec_programs import accept_on_device

    k, v, n = 3, 6, 20000
    logits = rng.normal(size=(64, k + 1, v)).astype(np.float32)
    drafts = rng.integers(0, v, (64, k)).astype(np.int32)
    drafts[::2, 0] = logits[::2, 0].argmax(-1)  # half the rows agree at least once
    keys = jax.random.split(jax.random.PRNGKey(0), 64)
    a, nxt = accept_on_device(
        jnp.asarray(logits), jnp.asarray(drafts), jnp.zeros((64, k, v)), jnp.zeros(64), keys, keys
    )
    want = [speculative.accept(logits[i], drafts[i]) for i in range(64)]
    assert [(int(x), int(y)) for x, y in zip(a, nxt)] == want and int(np.asarray(a).max()) > 0
    p = rng.dirichlet(np.ones(v), size=k + 1)
    q = rng.dirichlet(0.3 * np.ones(v), size=k)
    d = np.stack([rng.choice(v, n, p=q[j]) for j in range(k)], axis=1).astype(np.int32)
    keys_u, keys_r = jax.random.split(jax.random.PRNGKey(1), 2 * n).reshape(2, n, 2)
    a, nxt = accept_on_device(
        jnp.log(jnp.asarray(p, jnp.float32))[None].repeat(n, 0),
        jnp.asarray(d),
        jnp.asarray(q, jnp.float32)[None].repeat(n, 0),
        jnp.ones(n),
        keys_u,
        keys_r,
    )
    first = np.where(np.asarray(a) > 0, d[:, 0], np.asarray(nxt))
    counts = np.bincount(first, minlength=v)
    assert stats.chisquare(counts, p[0] * n).pvalue > 1e-3
    assert stats.chisquare(counts, q[0] * n).pvalue < 1e-6  # the drafts unverified: refused


def test_a_memory_budget_counts_the_drafts_rows_and_pending_features(target):
    """With a draft every page also holds its rows and its last slot's feature, every slot its
    pending features: `from_memory_budget` sizes the pools to the budget with them counted, and
    `capacity` reports what the arrays hold."""
    params, cfg, draft = target
    page = Engine.bytes_per_page(cfg, PAGE, np.float32, draft=True)
    assert page > Engine.bytes_per_page(cfg, PAGE, np.float32)
    budget = 40 * page + 25 * Engine.bytes_per_state(cfg, np.float32)
    eng = Engine.from_memory_budget(
        params,
        cfg,
        budget_bytes=budget,
        page_tokens=PAGE,
        num_slots=4,
        snapshots_per_slot=4,
        max_pages_per_request=16,
        kda_block_tokens=4 * PAGE,
        kernels="reference",
        draft=draft,
        draft_tokens=3,
    )
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves((eng.kv.pools, eng.kv.dpools))) + eng.snapshots.data.nbytes
    assert budget - page < held <= budget
    assert eng.capacity()["pool_bytes"] == held


def test_a_prefill_engine_writes_its_last_prompt_slot_once_it_has_the_token_after_it(target):
    """A page-aligned prompt's last slot ends its last page.  A colocated engine writes that row in
    its first round; a P/D prefill engine, which decodes nothing, writes the same row when it
    samples the first token, so the page it caches is whole (and its tail feature known)."""
    prompt = tokenizer.encode(PROMPTS[2])[: 2 * PAGE]
    colocated = _engine(target)
    req = colocated.submit(prompt, 8)
    while len(req.output) < 2:  # the first round wrote slot 2 * PAGE - 1
        colocated.step()
    want = np.asarray(colocated.kv.dpools["pages"][colocated.spec.draft_table(colocated, req)[1], PAGE - 1])
    colocated.run(max_steps=50)
    seen = {}

    def handed_over(eng, r):  # while the prefill engine still holds the request
        page = eng.spec.draft_table(eng, r)[1]
        seen.update(row=np.asarray(eng.kv.dpools["pages"][page, PAGE - 1]), known=bool(eng.kv.tail_known[page]))

    prefill = _engine(target, role="prefill", on_prefilled=handed_over)
    prefill.submit(prompt, 8)
    prefill.run(max_steps=20)
    assert seen["known"]
    np.testing.assert_allclose(seen["row"], want, rtol=1e-5, atol=1e-5)
