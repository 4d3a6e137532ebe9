"""`kimik3 eagle-ab` (`harness.eagle_ab`): the two-turn workload, the arms and their paired
bootstrap differences."""

import json

import numpy as np
import pytest

from harness import eagle_ab
from kimik3 import config, eagle_train, tokenizer
from serving import cli


def test_the_packaged_questions_are_the_80_two_turn_mt_bench_questions():
    qs = eagle_ab.load_questions()
    assert len(qs) == 80 and all(q1 and q2 for q1, q2 in qs)


def test_turn_two_continues_turn_one_with_its_answer():
    t1 = eagle_ab.turn1_tokens("What is a list?")
    t2 = eagle_ab.turn2_tokens(t1, [65, 66, tokenizer.EOS_ID], "And a tuple?")
    assert t2[: len(t1)] == t1 and t2[len(t1) : len(t1) + 3] == [65, 66, tokenizer.SPECIAL_IDS["<|end_turn|>"]]
    assert tokenizer.decode(t2[len(t1) + 3 :], skip_special=False) == "<|user|>And a tuple?<|end_turn|><|assistant|>"


def _rec(hit, accepted, tpot=1.0):
    return dict(
        hit=hit,
        any_hit=hit,
        cached_tokens=16 * hit,
        dropped_tokens=0,
        tail_recomputed=False,
        accepted=accepted,
        tpot_ms=tpot,
    )


def test_the_paired_bootstrap_brackets_a_known_difference_and_is_zero_for_equal_arms(rng):
    a = [_rec(True, list(rng.integers(0, 4, 20))) for _ in range(40)]
    b = [dict(r, hit=i % 2 == 0) for i, r in enumerate(a)]  # half of a's hits, the same drafts
    d = eagle_ab.paired_bootstrap(a, b, 3, 500, 0)
    assert d["hits"]["value"] == 20 and d["hits"]["ci_low"] <= 20 <= d["hits"]["ci_high"]
    assert d["hits"]["ci_low"] > 0  # paired: the resample keeps each question's pair together
    assert d["acceptance"] == dict(value=0.0, ci_low=0.0, ci_high=0.0)


def _plain_paired_bootstrap(a, b, k, n, seed):
    """The paired percentile bootstrap written out: n index resamples, a's minus b's metric on
    each, the 2.5 and 97.5 percentiles."""
    rng = np.random.default_rng(seed)
    diffs = {key: [] for key in eagle_ab.DIFF_KEYS}
    for _ in range(n):
        idx = rng.integers(0, len(a), len(a))
        ma, mb = eagle_ab._metrics([a[i] for i in idx], k), eagle_ab._metrics([b[i] for i in idx], k)
        for key in eagle_ab.DIFF_KEYS:
            diffs[key].append(ma[key] - mb[key])
    return {key: np.percentile(d, [2.5, 97.5]) for key, d in diffs.items()}


def _arms(rng, m=40):
    a = [_rec(True, list(rng.integers(0, 4, 20)), tpot=float(rng.uniform(5, 15))) for _ in range(m)]
    b = [_rec(i % 3 > 0, list(rng.integers(0, 4, 20)), tpot=float(rng.uniform(5, 15))) for i in range(m)]
    return a, b


def test_scipys_paired_bootstrap_gives_the_interval_of_the_plain_one(rng):
    """`scipy.stats.bootstrap(paired=True, method="percentile")` on a fixed sample: the 95%
    interval of every metric within 10% of its width of the written-out bootstrap's."""
    a, b = _arms(rng)
    got = eagle_ab.paired_bootstrap(a, b, 3, 1000, 0)
    want = _plain_paired_bootstrap(a, b, 3, 1000, 0)
    for key in eagle_ab.DIFF_KEYS:
        lo, hi = want[key]
        assert hi > lo, key  # a sample whose metrics vary
        assert abs(got[key]["ci_low"] - lo) <= 0.1 * (hi - lo) and abs(got[key]["ci_high"] - hi) <= 0.1 * (hi - lo), (
            key,
            got[key],
            (lo, hi),
        )
        assert got[key]["ci_low"] <= got[key]["value"] <= got[key]["ci_high"]


def test_identical_arms_give_intervals_that_contain_zero(rng):
    a, _ = _arms(rng)
    d = eagle_ab.paired_bootstrap(a, [dict(r) for r in a], 3, 500, 1)
    for key in eagle_ab.DIFF_KEYS:
        assert d[key]["value"] == 0 and d[key]["ci_low"] <= 0 <= d[key]["ci_high"], (key, d[key])


def test_an_undefined_metric_has_no_interval_and_one_question_has_its_value_as_interval():
    a = [_rec(True, [1, 2], tpot=None), _rec(False, [0, 3], tpot=None)]
    d = eagle_ab.paired_bootstrap(a, [dict(r, hit=False) for r in a], 3, 200, 0)
    assert d["tpot_ms_p50"] == dict(value=None, ci_low=None, ci_high=None)
    assert d["hits"]["value"] == 1 and d["hits"]["ci_low"] <= 1 <= d["hits"]["ci_high"]
    one = eagle_ab.paired_bootstrap(a[:1], [dict(a[0], hit=False)], 3, 200, 0)
    assert one["hits"] == dict(value=1.0, ci_low=1.0, ci_high=1.0)


@pytest.fixture(scope="module")
def ab(trained_draft):
    params, _, _, out = trained_draft
    cfg = config.tiny()
    draft = eagle_train.load_draft(out + "/draft", cfg, params)
    return eagle_ab.run(params, cfg, draft, eagle_ab.ABConfig.quick(questions=3, bootstrap=200, kernels="reference"))


def test_the_arms_keep_the_tokens_and_differ_only_in_what_they_reuse(ab):
    arms = ab["arms"]
    assert set(arms) == set(eagle_ab.ARMS) and all(m["questions"] == 3 for m in arms.values())
    # 16-token pages: every turn 1 has pages, and its last full page ends before its last token
    assert arms["no_drop"]["hits"] == arms["exact"]["hits"] == 3 and arms["drop"]["hits"] == 0
    assert arms["drop"]["cached_tokens_mean"] < arms["no_drop"]["cached_tokens_mean"]
    # a second turn repeats the token after turn 1's tail slot: the kept rows are a fresh prefill's
    assert arms["exact"]["acceptance"] == arms["no_drop"]["acceptance"] > 0
    for name, d in ab["differences"].items():
        for key, v in d.items():
            if v["value"] is not None:
                assert v["ci_low"] <= v["value"] <= v["ci_high"], (name, key, v)
    assert ab["differences"]["no_drop-drop"]["hits"]["value"] == 3


def test_the_cli_writes_the_arms_and_the_differences(trained_tiny, trained_draft, tmp_path, capsys):
    tc, _, _ = trained_tiny
    _, _, _, out = trained_draft
    path = tmp_path / "ab.json"
    assert (
        cli.main(
            [
                "eagle-ab",
                "--checkpoint",
                tc.out + "/checkpoint",
                "--draft-checkpoint",
                out + "/draft",
                "--quick",
                "--questions",
                "2",
                "--bootstrap",
                "50",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    assert "tail-block hits" in capsys.readouterr().out
    got = json.loads(path.read_text())
    for arm in ("drop", "no_drop", "exact"):
        assert {"hits", "questions", "acceptance", "accept_length"} <= set(got["arms"][arm])
    assert {"ci_low", "ci_high"} <= set(got["differences"]["no_drop-drop"]["acceptance"])
    assert np.isfinite(got["arms"]["drop"]["accept_length"])


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_arms_that_emit_different_tokens_fail_in_fp32_and_are_named_below_it(monkeypatch, dtype):
    """A token difference between arms is a bug in fp32 (the run stops); in bf16 a prefix hit and
    its recompute may round a near-tie apart: the run keeps its metrics and names the questions."""
    import jax.numpy as jnp

    def fake_arm(params, cfg, draft, arm, questions, ac, progress=None):
        rec = lambda out: dict(
            turn1_tokens=10,
            turn2_tokens=20,
            any_hit=True,
            hit=True,
            cached_tokens=16,
            dropped_tokens=0,
            tail_recomputed=False,
            accepted=[1, 2],
            accepted_turn1=[0],
            tpot_ms=1.0,
            output=out,
        )
        return [rec(([1], [2])), rec(([1], [3] if arm == "exact" else [2]))]

    monkeypatch.setattr(eagle_ab, "run_arm", fake_arm)
    params = {"embed_vd": jnp.zeros((4, 2), jnp.dtype(dtype))}
    ac = eagle_ab.ABConfig(questions=2, bootstrap=50)
    if np.dtype(jnp.dtype(dtype)) == np.float32:
        with pytest.raises(RuntimeError, match=r"questions \[1\]"):
            eagle_ab.run(params, config.tiny(), None, ac)
    else:
        result = eagle_ab.run(params, config.tiny(), None, ac)
        assert result["token_mismatches"] == [1] and result["arms"]["exact"]["accept_length"] == 2.5
        assert "questions [1]" in eagle_ab.report(result)
