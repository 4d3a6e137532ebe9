"""OpenAI's logprobs and presence / frequency penalties in the engine: the oracle's numbers, on
every path a token takes (the prefill's first token, the device decode step, steps chained on
the device, a preemption's recompute, a P/D handoff, a slot reused by another request)."""

import numpy as np
import pytest

from kimik3.generate import generate
from serving.disagg import DisaggregatedServer
from serving.sampling import SamplingParams
from tests.serving.test_engine import _engine


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def penalized_greedy(presence: float, frequency: float):
    """The oracle's choice with vLLM's penalties, written out on the host: logits minus
    frequency * count minus presence * (count > 0), the counts over the output so far."""

    def choose(logits, output):
        counts = np.bincount(np.asarray(output, np.int64), minlength=len(logits))[: len(logits)]
        return int(np.argmax(logits - frequency * counts - presence * (counts > 0)))

    return choose


def test_logprobs_are_the_models_log_softmax_on_every_path(rng, tiny_cfg, tiny_params):
    prompts = [rng.integers(0, 256, n).tolist() for n in (37, 9)]
    sp = SamplingParams(logprobs=3)
    oracle = [generate(tiny_params, tiny_cfg, p, 10) for p in prompts]
    eng = _engine(tiny_params, tiny_cfg)
    reqs = [eng.submit(p, 10, sampling=sp) for p in prompts] + [eng.submit(prompts[0], 10)]
    eng.run(max_steps=200)
    assert reqs[2].logprobs == []  # a request that asked for none gets none
    server = DisaggregatedServer(
        _engine(tiny_params, tiny_cfg, role="prefill"), _engine(tiny_params, tiny_cfg, role="decode"), handoff="direct"
    )
    pd = server.submit(prompts[0], 10, sampling=sp)
    server.run(max_steps=200)
    for req, want in [(reqs[0], oracle[0]), (reqs[1], oracle[1]), (server.requests[pd.request_id], oracle[0])]:
        assert req.output == want.tokens.tolist() and len(req.logprobs) == 10
        for tok, entry, logits in zip(req.output, req.logprobs, want.logits):
            ref = _log_softmax(logits)
            assert entry.logprob == pytest.approx(ref[tok], abs=1e-4)
            assert [i for i, _ in entry.top] == np.argsort(-ref)[:3].tolist()  # most probable first
            np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(ref)[::-1][:3], atol=1e-4)
            assert entry.top[0][0] == tok and sum(np.exp(lp) for _, lp in entry.top) <= 1 + 1e-6


def test_penalties_follow_vllms_formula_through_slot_reuse_preemption_and_handoff(rng, tiny_cfg, tiny_params):
    """Greedy rows with penalties beside a row without: each gets the oracle's tokens under its own
    rule.  Two slots for four requests, so later requests take slots whose counts another request
    left; a 9-page pool preempts (recompute); the handoff moves a penalized request mid-stream."""
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 12, 45, 20)]
    params = [
        SamplingParams(frequency_penalty=1.5),
        SamplingParams(presence_penalty=2.0),
        SamplingParams(),
        SamplingParams(presence_penalty=-0.5, frequency_penalty=0.75, logprobs=0),
    ]
    want = [
        generate(
            tiny_params, tiny_cfg, p, 24, choose=penalized_greedy(s.presence_penalty, s.frequency_penalty)
        ).tokens.tolist()
        for p, s in zip(prompts, params)
    ]
    assert want[0] != generate(tiny_params, tiny_cfg, prompts[0], 24).tokens.tolist()  # the penalty changed it
    eng = _engine(tiny_params, tiny_cfg, num_slots=2)
    got = [eng.submit(p, 24, sampling=s) for p, s in zip(prompts, params)]
    eng.run(max_steps=400)
    assert [r.output for r in got] == want
    assert eng.runner.decode.count_writes >= 3  # each penalized request's first step wrote its slot's row
    # a continuation elsewhere (a failover): the earlier output, now the prompt's tail, still counts
    rest = eng.submit(prompts[0] + want[0][:10], 14, sampling=params[0], prior_output=10)
    eng.run(max_steps=200)
    assert rest.output == want[0][10:]
    with pytest.raises(ValueError, match="prior_output"):
        eng.submit(prompts[0], 4, prior_output=len(prompts[0]))
    long = [rng.integers(0, 256, 60).tolist() for _ in range(2)]  # 100 tokens each: 7 pages of 9
    roomy = _engine(tiny_params, tiny_cfg)  # the oracle's tokens (shown above), without preemption
    want_long = [roomy.submit(p, 40, sampling=s) for p, s in zip(long, params)]
    roomy.run(max_steps=400)
    want_long = [r.output for r in want_long]
    assert roomy.preemptions == 0
    tight = _engine(tiny_params, tiny_cfg, num_pages=9)
    got = [tight.submit(p, 40, sampling=s) for p, s in zip(long, params)]
    tight.run(max_steps=400)
    assert tight.preemptions >= 1 and [r.output for r in got] == want_long
    server = DisaggregatedServer(
        _engine(tiny_params, tiny_cfg, role="prefill"), _engine(tiny_params, tiny_cfg, role="decode"), handoff="direct"
    )
    pd = server.submit(prompts[3], 24, sampling=params[3])
    server.run(max_steps=400)
    assert server.requests[pd.request_id].output == want[3]


def test_sampled_rows_with_penalties_draw_from_the_penalized_distribution(tiny_cfg, tiny_params):
    """At temperature 1 a penalty as large as 2 per occurrence pushes repeated tokens down: the
    engine's draws equal `choose_token` on the oracle's logits with the output's counts (the host
    path of the same function), so a sampled row is reproducible across the device and the host."""
    from serving.sampling import choose_token

    prompt = list(range(40, 80))
    sp = SamplingParams(temperature=1.0, seed=5, frequency_penalty=2.0, top_k=20)
    want = generate(
        tiny_params,
        tiny_cfg,
        prompt,
        16,
        choose=lambda logits, out: choose_token(logits, sp, len(prompt) + len(out), out),
    ).tokens.tolist()
    eng = _engine(tiny_params, tiny_cfg)
    req = eng.submit(prompt, 16, sampling=sp)
    eng.run(max_steps=200)
    assert req.output == want


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=True), "logprobs"),
    ],
)
def test_out_of_range_penalties_and_logprobs_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_a_continuation_whose_output_holds_a_generated_image_token_is_text(rng, tiny_cfg, tiny_params):
    """A model may sample <|image|> (temperature 1 over the whole vocabulary).  Continued
    elsewhere (a failover, a P/D handoff through the store), that token is in the prompt's output
    tail: it is text, as the oracle embedded it, not an image slot without its image (which would be a
    400 for the client)."""
    from kimik3 import tokenizer

    prompt = rng.integers(0, 256, 21).tolist()
    forced = lambda logits, out: tokenizer.IMAGE_ID if len(out) == 2 else int(np.argmax(logits))
    want = generate(tiny_params, tiny_cfg, prompt, 10, choose=forced).tokens.tolist()
    assert want[2] == tokenizer.IMAGE_ID
    eng = _engine(tiny_params, tiny_cfg)
    rest = eng.submit(prompt + want[:5], 5, prior_output=5)
    eng.run(max_steps=100)
    assert rest.output == want[5:]
    with pytest.raises(ValueError, match="placeholders but no images"):  # in the prompt itself it is a slot
        eng.submit(prompt + want[:5], 5, prior_output=2)
