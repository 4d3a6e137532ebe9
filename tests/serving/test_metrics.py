"""Metrics are defined once: TTFT, TPOT, queue time, cache rate, percentiles."""

import math

from serving.metrics import CompileWatch, RequestRecord, StepProfile, percentiles, summarize


def test_definitions():
    r = RequestRecord(
        arrival_s=10.0,
        token_times_s=[10.5, 10.7, 11.1],
        prompt_tokens=100,
        cached_tokens_gpu=40,
        cached_tokens_host=20,
        admitted_s=10.2,
    )
    assert math.isclose(r.ttft_s, 0.5) and math.isclose(r.tpot_s, 0.3) and math.isclose(r.queue_s, 0.2)
    s = summarize("x", [r, RequestRecord(0.0, [1.0], 100, 0, 0, 0.5)], wall_s=2.0)
    assert s.output_tokens == 4 and math.isclose(s.throughput_tok_s, 2.0)
    assert math.isclose(s.cache_rate, 0.3) and math.isclose(s.cache_rate_host, 0.1)
    assert math.isclose(s.tpot_s["p50"], 0.3)  # single-token requests have no TPOT


def test_tpot_splits_by_whether_the_step_also_ran_prefill():
    r = RequestRecord(0.0, [1.0, 1.1, 1.6, 1.7], 10, 0, 0, token_mixed=[True, False, True, False])
    assert math.isclose(r.tpot_decode_only_s, 0.1) and math.isclose(r.tpot_mixed_s, 0.5)
    s = summarize("x", [r], wall_s=1.0)
    assert math.isclose(s.tpot_decode_only_s["p50"], 0.1) and math.isclose(s.tpot_mixed_s["p50"], 0.5)
    assert RequestRecord(0.0, [1.0, 2.0], 1, 0, 0).tpot_mixed_s is None  # unknown split: none reported


def test_percentiles():
    p = percentiles(list(range(1, 101)))
    assert math.isclose(p["p50"], 50.5) and p["p99"] > 99
    assert math.isnan(percentiles([None])["p50"])


def test_step_profile_reports_mean_host_and_wait_per_step_by_kind():
    p = StepProfile()
    for host_s, wait_s in ((0.001, 0.003), (0.003, 0.001)):
        p.add("chained", host_s, wait_s)
    p.add("mixed", 0.010, 0.0)
    d = p.as_dict()
    assert d["chained"] == {"steps": 2, "host_ms": 2.0, "wait_ms": 2.0}
    assert d["mixed"]["steps"] == 1 and math.isclose(d["mixed"]["host_ms"], 10.0)
    assert p.summary().startswith("chained 2 steps (host 2.00 + wait 2.00 ms a step); mixed 1 steps")


def test_compile_watch_counts_each_program_built_inside_its_block_by_name():
    import jax
    import numpy as np

    @jax.jit
    def shifted_by_seven(x):
        return x + 7

    x = np.arange(5, dtype=np.int32)
    with CompileWatch() as watch:
        shifted_by_seven(x)  # a new program
        shifted_by_seven(x)  # the same one: nothing built
    assert watch.count == 1 and watch.seconds > 0
    assert [name for name in watch.names if "shifted_by_seven" in name] == list(watch.names)
    with CompileWatch() as again:
        shifted_by_seven(x + 1)  # another value, the same program
    shifted_by_seven(np.arange(6, dtype=np.int32))  # a new shape, outside any block: not counted
    assert again.count == 0 and not again.names


def test_the_interval_stats_give_vllms_stats_line():
    """Throughput over the interval since the last line, the queue and KV use as given, and the
    prefix cache's hit rate over the most recent prompts (vLLM's window); a line is active while
    anything happens and for one interval after."""
    from serving.metrics import IntervalStats

    now = [0.0]
    stats = IntervalStats(recent_requests=2, clock=lambda: now[0])
    stats.prefilled(100, 0)
    stats.prefilled(100, 50)
    stats.generated(30)
    now[0] = 10.0
    line, active = stats.line(running=2, waiting=1, kv_use=0.125)
    assert active and line == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 3.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 25.0%"
    )
    stats.prefilled(100, 100)  # the window holds the last two prompts: (100, 50) and (100, 100)
    now[0] = 20.0
    line, active = stats.line(running=0, waiting=0, kv_use=0.0)
    assert active and "Avg prompt throughput: 10.0 tokens/s" in line and "Prefix cache hit rate: 75.0%" in line
    now[0] = 30.0
    assert stats.line(running=0, waiting=0, kv_use=0.0)[1]  # the interval after throughput
    now[0] = 40.0
    line, active = stats.line(running=0, waiting=0, kv_use=0.0)
    assert not active and "Avg generation throughput: 0.0 tokens/s" in line
