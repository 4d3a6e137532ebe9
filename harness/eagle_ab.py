"""`kimik3 eagle-ab`: the EAGLE-3 tail-block A/B on two-turn MT-Bench.

Each arm is one speculative engine (`serving.spec_decode`) with one tail rule ("drop",
"no_drop", "exact"), the same target, draft, k and greedy decoding.  A conversation's turn 1 is
its first question in the chat template; turn 2 (sent once turn 1's answer is complete, as the
benchmark does) is turn 1, the answer's tokens, the end of the assistant's turn and the second
question: its prefix hit is turn 1's prompt pages (only prompt pages are hashed), so what the
tail rule does to the last matched page decides the hit.  Conversations run `num_slots` at a
time (turn 1 of the group, then its turn 2), in the same order in every arm.

Per arm, over the second turns: hits (tail-block hits: requests whose prefix hit reaches the end
of turn 1's last full page, out of the questions; `any_hits` counts any hit), mean cached tokens, draft acceptance (kept / drafted), accept length (tokens per verify pass,
EAGLE's tau), acceptance at each draft position (P(a >= j)), TPOT.  Differences between arms
come with paired bootstrap 95% CIs (`scipy.stats.bootstrap`, paired: questions resampled with
replacement, the same resample for both arms of a difference).  Tokens are checked: every arm must emit the same tokens (greedy
speculative decoding emits the target's greedy tokens whatever its draft rows); in exact fp32
arithmetic a difference is an error, below it (bf16 weights, TF32 matmuls: a prefix hit and its
recompute round differently) the questions are named in `token_mismatches`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import warnings

import numpy as np

from kimik3 import arithmetic, tokenizer
from serving.bench_data import PACKAGED_MT_BENCH
from serving.engine import Engine

log = logging.getLogger(__name__)

ARMS = ("drop", "no_drop", "exact")
PAIRS = (("no_drop", "drop"), ("exact", "drop"), ("exact", "no_drop"))
QUESTIONS = PACKAGED_MT_BENCH  # the 80 two-turn MT-Bench questions shipped in serving/data/


@dataclasses.dataclass(frozen=True)
class ABConfig:
    questions: int = 80
    max_new_tokens: int = 128  # per turn
    draft_tokens: int = 3
    page_tokens: int = 128
    kda_block_tokens: int = 1536
    num_slots: int = 8
    prefill_chunk_tokens: int = 512
    bootstrap: int = 2000
    seed: int = 0
    kernels: str = "auto"

    @classmethod
    def quick(cls, **kw) -> "ABConfig":
        """A CPU run: a few questions, short answers, 16-token pages (so short prompts have pages)."""
        return cls(
            **dict(
                dict(
                    questions=4,
                    max_new_tokens=24,
                    page_tokens=16,
                    kda_block_tokens=64,
                    num_slots=4,
                    prefill_chunk_tokens=256,
                    bootstrap=500,
                ),
                **kw,
            )
        )


def load_questions(path: str | None = None, n: int | None = None) -> list[tuple[str, str]]:
    """(turn 1, turn 2) of the first n MT-Bench questions."""
    with open(path or QUESTIONS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    bad = [r.get("question_id") for r in rows if len(r.get("turns", ())) < 2]
    if bad:
        raise ValueError(f"{path or QUESTIONS}: questions {bad} do not have two turns")
    return [(r["turns"][0], r["turns"][1]) for r in rows[:n]]


def turn1_tokens(q1: str) -> list[int]:
    return tokenizer.apply_chat_template([tokenizer.Message("user", q1)])


def turn2_tokens(turn1: list[int], answer: list[int], q2: str) -> list[int]:
    """Turn 1, the answer's tokens (its EOS dropped), the end of the assistant's turn, question 2."""
    answer = [t for t in answer if t != tokenizer.EOS_ID]
    end_turn = tokenizer.SPECIAL_IDS["<|end_turn|>"]
    return turn1 + answer + [end_turn] + tokenizer.apply_chat_template([tokenizer.Message("user", q2)])[1:]


def _engine(params, cfg, draft, arm: str, ac: ABConfig):
    # a group's conversations whole (turn 1's pages must outlive its answer until turn 2 hits them),
    # twice over: the free list is LRU, so the previous group's cached pages are what goes first
    pages = 2 * ac.num_slots * -(-min(cfg.max_seq_len, 4096) // ac.page_tokens) + 8
    return Engine(
        params,
        cfg,
        num_pages=pages,
        num_slots=ac.num_slots,
        num_snapshots=8 * ac.num_slots,
        page_tokens=ac.page_tokens,
        kda_block_tokens=ac.kda_block_tokens,
        prefill_chunk_tokens=ac.prefill_chunk_tokens,
        kernels=ac.kernels,
        draft=draft,
        draft_tokens=ac.draft_tokens,
        eagle_tail=arm,
    )


def _tpot_ms(req) -> float | None:
    t = req.token_times_s
    return 1e3 * (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def run_arm(params, cfg, draft, arm: str, questions, ac: ABConfig, progress=None) -> list[dict]:
    """One arm over the questions: a record per conversation (its turn 2's numbers, both turns' tokens)."""
    eng = _engine(params, cfg, draft, arm, ac)
    limit = min(cfg.max_seq_len, eng.max_pages * ac.page_tokens) - 2 * (ac.max_new_tokens + ac.draft_tokens) - 8
    out = []
    for g in range(0, len(questions), ac.num_slots):
        group = questions[g : g + ac.num_slots]
        t1 = [turn1_tokens(q1)[: limit // 2] for q1, _ in group]
        r1 = [eng.submit(t, ac.max_new_tokens, stop_at_eos=True) for t in t1]
        eng.run()
        t2 = [turn2_tokens(t, r.output, q2)[:limit] for t, r, (_, q2) in zip(t1, r1, group)]
        r2 = [eng.submit(t, ac.max_new_tokens, stop_at_eos=True) for t in t2]
        eng.run()
        for a, b, p1, p2 in zip(r1, r2, t1, t2):
            if a.error or b.error:
                raise RuntimeError(f"arm {arm}: a request failed ({a.error or b.error})")
            tail = len(p1) // ac.page_tokens * ac.page_tokens  # turn 1's last full page ends here
            out.append(
                dict(
                    turn1_tokens=len(p1),
                    turn2_tokens=len(p2),
                    any_hit=b.cached_tokens > 0,
                    hit=0 < tail <= b.cached_tokens,
                    cached_tokens=b.cached_tokens,
                    dropped_tokens=b.tail_dropped_tokens,
                    tail_recomputed=b.tail_recomputed,
                    accepted=list(b.accepted),
                    accepted_turn1=list(a.accepted),
                    tpot_ms=_tpot_ms(b),
                    output=(list(a.output), list(b.output)),
                )
            )
        if progress is not None:
            progress(arm, len(out))
    return out


def _metrics(recs: list[dict], k: int) -> dict:
    acc = [a for r in recs for a in r["accepted"]]
    tp = [r["tpot_ms"] for r in recs if r["tpot_ms"] is not None]
    return dict(
        hits=sum(r["hit"] for r in recs),
        any_hits=sum(r["any_hit"] for r in recs),
        questions=len(recs),
        cached_tokens_mean=float(np.mean([r["cached_tokens"] for r in recs])) if recs else 0.0,
        acceptance=sum(acc) / (k * len(acc)) if acc else 0.0,
        accept_length=float(np.mean([a + 1 for a in acc])) if acc else 0.0,
        acceptance_by_position=[float(np.mean([a >= j for a in acc])) if acc else 0.0 for j in range(1, k + 1)],
        tpot_ms_p50=statistics.median(tp) if tp else None,
        tail_recomputed=sum(r["tail_recomputed"] for r in recs),
        dropped_tokens_mean=float(np.mean([r["dropped_tokens"] for r in recs])) if recs else 0.0,
    )


DIFF_KEYS = ("hits", "acceptance", "accept_length", "tpot_ms_p50")


CONFIDENCE = 0.95


def paired_bootstrap(a: list[dict], b: list[dict], k: int, n: int, seed: int) -> dict:
    """Per metric of `DIFF_KEYS`: a's minus b's on the same questions (``value``), with the 95%
    percentile interval (``ci_low``, ``ci_high``) of `scipy.stats.bootstrap` over `n` paired
    resamples (questions drawn with replacement, each question's records of a and b together),
    drawn by ``np.random.default_rng(seed)``.  None where the metric is undefined (a TPOT without
    one answer of two tokens or more); an interval is None also where some resample leaves it
    undefined, and where `n` is 0.  Under two questions every resample is the sample: the
    interval is the value."""
    from scipy import stats  # scipy.stats (~1 s) loads where intervals are drawn

    point = {key: _diff(_metrics(a, k), _metrics(b, k), key) for key in DIFF_KEYS}

    def statistic(ia, ib):
        ma, mb = _metrics([a[i] for i in ia], k), _metrics([b[i] for i in ib], k)
        return np.array([np.nan if (d := _diff(ma, mb, key)) is None else d for key in DIFF_KEYS])

    if len(a) != len(b):
        raise ValueError(f"paired arms of {len(a)} and {len(b)} questions")
    if n <= 0:
        ci = [(None, None)] * len(DIFF_KEYS)
    elif len(a) < 2:  # every resample is the sample itself
        ci = [(point[key], point[key]) for key in DIFF_KEYS]
    else:
        rows = np.arange(len(a))
        with warnings.catch_warnings():  # an undefined resample is a NaN: the interval is None below
            warnings.simplefilter("ignore", stats.DegenerateDataWarning)
            res = stats.bootstrap(
                (rows, rows),
                statistic,
                n_resamples=n,
                paired=True,
                vectorized=False,
                confidence_level=CONFIDENCE,
                method="percentile",
                rng=np.random.default_rng(seed),
            )
        lows, highs = res.confidence_interval
        ci = [(None, None) if np.isnan(lo) or np.isnan(hi) else (float(lo), float(hi)) for lo, hi in zip(lows, highs)]
    return {key: dict(value=point[key], ci_low=lo, ci_high=hi) for key, (lo, hi) in zip(DIFF_KEYS, ci)}


def _diff(ma: dict, mb: dict, key: str):
    if ma[key] is None or mb[key] is None:
        return None
    return float(ma[key] - mb[key])


def run(params, cfg, draft, ac: ABConfig, *, questions_path: str | None = None, arms=ARMS, progress=None) -> dict:
    """Every arm on the same questions; the record `--json` writes (see the module docstring)."""
    questions = load_questions(questions_path, ac.questions)
    per_arm = {arm: run_arm(params, cfg, draft, arm, questions, ac, progress) for arm in arms}
    first = per_arm[arms[0]]
    mismatched = sorted({i for arm in arms for i, r in enumerate(per_arm[arm]) if r["output"] != first[i]["output"]})
    if mismatched:  # greedy speculative decoding emits the target's tokens in every arm
        if arithmetic.exact_arithmetic(params):
            raise RuntimeError(f"arms emitted different tokens for questions {mismatched}")
        # below fp32 (bf16 weights, or TF32 matmuls on a GPU) a recomputed page and a hit round
        # differently: near-tied argmaxes can flip; the arms' metrics are kept and the questions named
        log.warning(
            "arms emitted different tokens for questions %s (%s weights, matmul precision %s: a prefix "
            "hit and its recompute round differently)",
            mismatched,
            params["embed_vd"].dtype,
            arithmetic.matmul_precision(),
        )
    k = ac.draft_tokens
    result = dict(
        workload=dict(
            dataclasses.asdict(ac),
            questions_file=questions_path or QUESTIONS,
            config=cfg.name,
            turn2_prompt_tokens_mean=float(np.mean([r["turn2_tokens"] for r in first])),
        ),
        token_mismatches=mismatched,
        arms={arm: _metrics(per_arm[arm], k) for arm in arms},
        differences={
            f"{x}-{y}": paired_bootstrap(per_arm[x], per_arm[y], k, ac.bootstrap, ac.seed)
            for x, y in PAIRS
            if x in per_arm and y in per_arm
        },
        per_question={
            arm: [{key: v for key, v in r.items() if key != "output"} for r in recs] for arm, recs in per_arm.items()
        },
    )
    return result


def report(result: dict) -> str:
    """The arms and the differences as two markdown tables."""
    lines = [
        "| arm | tail-block hits | any hit | cached tokens (mean) | acceptance | accept length | acceptance by position | TPOT p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, m in result["arms"].items():
        tp = "-" if m["tpot_ms_p50"] is None else f"{m['tpot_ms_p50']:.1f}"
        lines.append(
            f"| {arm} | {m['hits']}/{m['questions']} | {m['any_hits']} | {m['cached_tokens_mean']:.1f} | {m['acceptance']:.4f} | "
            f"{m['accept_length']:.3f} | {' '.join(f'{p:.3f}' for p in m['acceptance_by_position'])} | {tp} |"
        )
    lines += ["", "| difference | hits | acceptance | accept length | TPOT p50 ms |", "| --- | --- | --- | --- | --- |"]
    fmt = lambda d: "-" if d["value"] is None else f"{d['value']:+.4g} [{d['ci_low']:+.4g}, {d['ci_high']:+.4g}]"
    for name, d in result["differences"].items():
        lines.append(f"| {name} | " + " | ".join(fmt(d[key]) for key in DIFF_KEYS) + " |")
    if result.get("token_mismatches"):
        lines += ["", f"tokens differ between arms for questions {result['token_mismatches']} (below fp32)"]
    return "\n".join(lines)
