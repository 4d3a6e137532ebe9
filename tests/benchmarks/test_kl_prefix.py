"""kl_prefix's workload and its three modes on the tiny model (fp32): in-pass snapshots and vLLM's
align mode keep the same snapshots and hit the same prefixes; without prefix caching nothing hits;
all three give the same first tokens."""

import numpy as np
import pytest

from benchmarks import kimi_linear as kl
from benchmarks import kl_prefix, registry
from benchmarks.serving_bench import serving_params
from kimik3 import config


def test_each_turn_extends_the_previous_prompt_up_to_the_last_context():
    cfg = config.get_config("tiny")
    sessions = kl_prefix.session_prompts(cfg, 3, 4, 100, 400, seed=0)
    assert len(sessions) == 3 and all(len(s) == 4 for s in sessions)
    for turns in sessions:
        assert [len(p) for p in turns] == [100, 200, 300, 400]
        for a, b in zip(turns, turns[1:]):
            np.testing.assert_array_equal(b[: len(a)], a)
    assert not np.array_equal(sessions[0][0], sessions[1][0])  # sessions share nothing


@pytest.fixture(scope="module")
def modes():
    cfg = config.get_config("tiny")
    assert cfg.dtype == "float32"
    ctx = registry.Context(registry.by_name()["kl_prefix"], shapes="ci")
    s = kl._setting(ctx)
    ec = kl_prefix.engine_config(cfg, s, 2, 208, 64, ci=True)
    prompts = kl_prefix.session_prompts(cfg, 2, 3, 80, 208, seed=0)
    params = serving_params("tiny")
    return ec, {m: kl_prefix.run_mode(params, cfg, ec, m, prompts, "t") for m in kl_prefix.MODES}


def test_align_mode_keeps_the_in_pass_snapshots_and_hits(modes):
    ec, res = modes
    assert ec.prefill_chunk_tokens > ec.kda_block_tokens  # in_pass exports inside a chunk; align cuts it
    inp, align, none = (res[m] for m in kl_prefix.MODES)
    assert inp["snapshots"] == align["snapshots"] > 0
    assert inp["summary"].cache_rate == align["summary"].cache_rate > 0.3
    assert none["summary"].cache_rate == 0


def test_reuse_never_changes_the_first_tokens_in_fp32(modes):
    _, res = modes
    firsts = {m: r["firsts"] for m, r in res.items()}
    assert len(firsts["in_pass"]) == 6
    assert firsts["in_pass"] == firsts["align"] == firsts["none"]


def test_the_engine_config_holds_every_sessions_context_twice():
    cfg = config.get_config("tiny")
    s = kl._setting(registry.Context(registry.by_name()["kl_prefix"], shapes="ci"))
    ec = kl_prefix.engine_config(cfg, s, 4, 1000, 64, ci=True)
    assert ec.num_slots == 4 and ec.kda_block_tokens % ec.page_tokens == 0
    assert ec.num_pages >= 2 * 4 * (1000 // ec.page_tokens)
