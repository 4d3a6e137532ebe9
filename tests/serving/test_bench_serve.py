"""`kimik3 bench serve` (`serving.bench_serve`): vLLM's metric arithmetic on hand-computed
timestamps, the seeded arrival schedule, the three request sets, the step-profile reading, and
runs against a real `kimik3 serve tiny` on loopback (test_serve's deployment) with each dataset:
counts that add up, TTFT <= E2E, vLLM's JSON keys, the schedule kept, a multiturn session's
turns in order and hitting the prefix cache, warm-ups sent but not counted."""

import json
import math

import httpx
import numpy as np
import pytest

from serving import bench_data, bench_serve, cli
from serving.bench_metrics import RequestResult, calculate_metrics, format_report, read_step_counters, step_profile

from .test_serve import KEY, served  # noqa: F401  (the module's deployment: kimik3 serve tiny)


# ---- metric arithmetic ---------------------------------------------------------------------------------
def _results():
    return [
        RequestResult(True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
        RequestResult(True, prompt_len=20, output_tokens=2, ttft=0.3, itl=[0.1], latency=0.4, cached_tokens=16),
        RequestResult(False, error="HTTP 400: no", prompt_len=99, output_tokens=7, ttft=9.0, latency=9.0),
        RequestResult(True, prompt_len=5, output_tokens=1, ttft=0.05, itl=[], latency=0.05),
    ]


def test_metrics_are_vllms_definitions_on_hand_computed_timestamps():
    m = calculate_metrics(_results(), duration_s=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 35, 7)
    assert m["total_cached_tokens"] == 16
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(21.0)
    # TTFT of the successes: 100, 300, 50 ms; numpy's linear percentiles over [50, 100, 300]
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["p90_ttft_ms"] == pytest.approx(100 + 0.8 * 200)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.98 * 200)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 300, 50]))
    # TPOT = (E2EL - TTFT) / (output - 1) where output > 1: 100/3 and 100 ms
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert m["p90_tpot_ms"] == pytest.approx(100 / 3 + 0.9 * (100 - 100 / 3))
    # ITL: every gap of every success, pooled: 20, 30, 50, 100 ms
    assert m["mean_itl_ms"] == pytest.approx(50.0)
    assert m["median_itl_ms"] == pytest.approx(40.0)
    assert m["p90_itl_ms"] == pytest.approx(50 + 0.7 * 50)
    assert m["p99_itl_ms"] == pytest.approx(50 + 0.97 * 50)
    # E2EL: 200, 400, 50 ms
    assert m["mean_e2el_ms"] == pytest.approx(650 / 3)
    assert m["median_e2el_ms"] == pytest.approx(200.0)
    assert m["p99_e2el_ms"] == pytest.approx(200 + 0.98 * 200)


def test_requested_percentiles_are_named_as_vllm_names_them():
    m = calculate_metrics(_results(), 1.0, percentiles=(50.0, 99.9))
    assert m["p50_ttft_ms"] == m["median_ttft_ms"] and "p99.9_e2el_ms" in m and "p90_ttft_ms" not in m


def test_a_run_without_a_success_reads_zero_latencies_as_vllm_writes_them():
    m = calculate_metrics([RequestResult(False, error="x")], 1.0)
    assert (m["completed"], m["failed"], m["request_throughput"]) == (0, 1, 0.0)
    assert m["mean_ttft_ms"] == m["p99_itl_ms"] == m["median_tpot_ms"] == 0.0


def test_the_report_prints_vllms_lines_and_says_when_no_step_profile_is_exported():
    result = {**calculate_metrics(_results(), 2.0), "max_concurrency": 4, "request_rate": 2.5}
    text = format_report({**result, "engine_step_profile": None})
    for line in (
        "Successful requests:                     3",
        "Failed requests:                         1",
        "Maximum request concurrency:             4",
        "Request rate configured (RPS):           2.50",
        "Request throughput (req/s):              1.50",
        "Output token throughput (tok/s):         3.50",
        "Median TTFT (ms):                        100.00",
        "P90 TPOT (ms):",
        "P99 ITL (ms):",
        "Mean E2EL (ms):                          216.67",
        "not exported by this server",
    ):
        assert line in text, line
    profile = {"chained": {"steps": 9, "host_ms": 1.5, "wait_ms": 4.25}}
    line = format_report({**result, "engine_step_profile": profile}).splitlines()[-2]
    assert line.startswith("chained (9 steps), ms a step:") and line.endswith(" 1.50 + 4.25")


# ---- the engine's step profile from /metrics -------------------------------------------------------------
def _metrics_text(steps: float, host: float, wait: float) -> str:
    lines = []
    for worker, share in (("http://w0", 1.0), ("http://w1", 0.5)):
        for name, value in (
            ("kimik3_worker_engine_steps_total", steps),
            ("kimik3_worker_engine_step_host_seconds_total", host),
            ("kimik3_worker_engine_step_wait_seconds_total", wait),
        ):
            lines.append(f"# TYPE {name.removesuffix('_total')} counter")
            lines.append(f'{name}{{kind="chained",worker="{worker}"}} {value * share}')
    return "\n".join(lines) + "\nvllm:num_requests_running 0\n"


def test_the_step_profile_is_the_steps_between_two_readings_summed_over_workers():
    before, after = read_step_counters(_metrics_text(10, 1.0, 2.0)), read_step_counters(_metrics_text(30, 1.3, 2.6))
    assert before["chained"] == {"steps": 15.0, "host_s": 1.5, "wait_s": 3.0}
    profile = step_profile(before, after)
    assert profile["chained"]["steps"] == 30
    assert profile["chained"]["host_ms"] == pytest.approx(1e3 * 0.45 / 30)
    assert profile["chained"]["wait_ms"] == pytest.approx(1e3 * 0.9 / 30)
    assert read_step_counters("vllm:num_requests_running 0\n") is None
    assert step_profile(None, after) is None and step_profile(after, after) == {}


# ---- arrivals ------------------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_and_the_last_lands_at_n_over_rate():
    a = bench_serve.arrival_times(40, 4.0, seed=3)
    assert a == bench_serve.arrival_times(40, 4.0, seed=3) and a != bench_serve.arrival_times(40, 4.0, seed=4)
    assert all(x <= y for x, y in zip(a, a[1:])) and a[0] > 0
    assert a[-1] == pytest.approx(40 / 4.0)
    assert bench_serve.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert bench_serve.arrival_times(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError, match="must be > 0"):
        bench_serve.arrival_times(3, 0.0)


def test_arrival_gaps_are_exponential_at_burstiness_one_and_steadier_above():
    """Gamma gaps of shape k have a coefficient of variation of 1 / sqrt(k)."""
    for k in (1.0, 4.0):
        gaps = np.diff([0.0, *bench_serve.arrival_times(20000, 10.0, burstiness=k, seed=0)])
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(k), rel=0.05)


# ---- request sets --------------------------------------------------------------------------------------
def test_random_prompts_hold_the_drawn_token_counts_of_printable_text_ids():
    reqs = bench_data.random_requests(50, 40, 10, range_ratio=0.5, seed=1)
    assert reqs == bench_data.random_requests(50, 40, 10, range_ratio=0.5, seed=1)
    assert all(len(r.prompt) == r.prompt_len and 20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(32 <= t < 127 for r in reqs for t in r.prompt) and len({r.session for r in reqs}) == 50
    chat = bench_data.random_requests(50, 40, 10, endpoint=bench_data.CHAT, range_ratio=0.5, seed=1)
    assert [c.prompt for c in chat] == [[{"role": "user", "content": bytes(r.prompt).decode()}] for r in reqs]


def test_multiturn_turns_extend_their_sessions_history_and_stop_before_the_context():
    reqs = bench_data.multiturn_requests(None, sessions=3, turns=(2, 4), scale=32, seed=0)
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 3
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for a, b in zip(turns, turns[1:]):
            assert b.prompt[: len(a.prompt)] == a.prompt  # the history is the next prompt's prefix
    first = [t.prompt[:32] for t in reqs if t.turn == 0]
    assert all(p == first[0] for p in first)  # the shared system prompt
    capped = bench_data.multiturn_requests(None, sessions=3, turns=(2, 4), scale=32, max_model_len=300, seed=0)
    assert capped and all(len(r.prompt) + r.output_len <= 300 for r in capped) and len(capped) < len(reqs)
    assert len(bench_data.multiturn_requests(4, sessions=3, turns=(2, 4), scale=32, seed=0)) == 4
    with pytest.raises(ValueError, match="token-id prompts"):
        bench_data.multiturn_requests(None, sessions=1, turns=(1, 1), scale=32, endpoint=bench_data.CHAT)


def test_mt_bench_reads_the_shared_questions_and_repeats_past_them(tmp_path):
    assert bench_data.default_mt_bench_path() in (bench_data.SHARED_MT_BENCH, bench_data.PACKAGED_MT_BENCH)
    path = tmp_path / "q.jsonl"
    path.write_text(
        "".join(json.dumps({"question_id": i, "turns": [f"question {i}", "again"]}) + "\n" for i in range(3))
    )
    reqs = bench_data.mt_bench_requests(7, str(path), 16, seed=0)
    texts = [r.prompt[0]["content"] for r in reqs]
    assert sorted(texts[:3]) == ["question 0", "question 1", "question 2"] and sorted(texts[3:6]) == sorted(texts[:3])
    assert all(r.output_len == 16 for r in reqs)
    assert bench_data.mt_bench_requests(1, str(path), 16, endpoint=bench_data.COMPLETIONS)[0].prompt.startswith("q")
    with pytest.raises(ValueError, match="no question"):
        (tmp_path / "empty.jsonl").write_text("{}\n")
        bench_data.load_mt_bench(str(tmp_path / "empty.jsonl"))


def test_a_key_written_on_the_command_line_is_refused(monkeypatch):
    monkeypatch.setenv("KIMIK3_API_KEY", "sk-env")
    assert bench_serve.api_key(None) == "sk-env"
    with pytest.raises(ValueError, match="takes @FILE"):
        bench_serve.api_key("sk-in-argv")


# ---- against kimik3 serve tiny -------------------------------------------------------------------------
# The checks run in order inside one test, so that xdist cannot split them over two processes and
# start the deployment twice.
def _submitted(deployment) -> int:
    """Requests the deployment's worker has taken (its /health's load counters)."""
    return httpx.get(deployment.state["decode"][0] + "/health", timeout=10).json()["load"]["submitted"]


def check_random_poisson_counts_add_up_and_arrivals_keep_the_schedule(deployment, key, tmp, monkeypatch, capsys):
    """Through `kimik3 bench serve`: six prompts
    at a seeded Poisson rate after two warm-ups that reach the server but are not counted; every
    count adds up, TTFT <= E2E, and each request started no earlier than its arrival time."""
    out = tmp / "random.json"
    argv = ["bench", "serve", "--base-url", deployment.base + "/v1", "--api-key", f"@{key}"]
    argv += ["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8"]
    argv += ["--random-range-ratio", "0.5", "--num-prompts", "6", "--request-rate", "30", "--seed", "3"]
    argv += ["--ignore-eos", "--num-warmups", "2", "--result-file", str(out)]
    before = _submitted(deployment)
    assert cli.main(argv) == 0
    assert _submitted(deployment) - before == 6 + 2
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Request rate configured (RPS):           30.00" in text
    r = json.loads(out.read_text())
    sent = bench_data.random_requests(6, 32, 8, range_ratio=0.5, seed=3)
    assert (r["completed"], r["failed"], r["num_prompts"], r["request_rate"]) == (6, 0, 6, 30.0)
    assert r["input_lens"] == [s.prompt_len for s in sent]  # ids are sent as given: the server counts the same
    assert r["output_lens"] == [s.output_len for s in sent]  # ignore_eos: every requested token
    assert r["total_output_tokens"] == sum(r["output_lens"]) and r["errors"] == [""] * 6
    assert r["request_throughput"] == pytest.approx(6 / r["duration"])
    for ttft, e2e, itl, n in zip(r["ttfts"], r["latencies"], r["itls"], r["output_lens"]):
        assert 0 < ttft <= e2e and n - 1 <= len(itl) <= n and all(g >= 0 for g in itl)
    for start, due in zip(r["start_times"], bench_serve.arrival_times(6, 30.0, seed=3)):
        assert due - 1e-3 <= start <= due + 2.0
    for key_ in ("mean", "median", "std", "p90", "p99"):
        assert all(f"{key_}_{m}_ms" in r for m in ("ttft", "tpot", "itl", "e2el"))
    assert r["median_ttft_ms"] <= r["median_e2el_ms"]
    # the worker's step counters, federated by the router: the steps the six requests took
    profile = r["engine_step_profile"]
    assert profile and {"prefill", "mixed"} & set(profile) and sum(v["steps"] for v in profile.values()) >= 8
    assert all(v["host_ms"] > 0 and v["wait_ms"] >= 0 for v in profile.values())
    assert "ms a step:" in text


def check_multiturn_sends_each_sessions_turns_in_order_onto_its_cached_prefix(deployment, key, tmp):
    out = tmp / "multiturn.json"
    argv = ["serve", "--base-url", deployment.base, "--api-key", f"@{key}", "--dataset-name", "multiturn"]
    argv += ["--multiturn-sessions", "2", "--multiturn-min-turns", "2", "--multiturn-max-turns", "2"]
    argv += ["--multiturn-scale", "32", "--max-concurrency", "2", "--num-warmups", "0", "--result-file", str(out)]
    assert bench_serve.main(argv) == 0
    r = json.loads(out.read_text())
    sent = bench_data.multiturn_requests(100, sessions=2, turns=(2, 2), scale=32, max_model_len=1024)
    assert (r["completed"], r["failed"], len(sent)) == (4, 0, 4)
    assert r["input_lens"] == [s.prompt_len for s in sent]
    turns = {}
    for s, start, e2e, cached in zip(sent, r["start_times"], r["latencies"], r["cached_lens"]):
        turns.setdefault(s.session, []).append((start, e2e, cached, s))
    for chain in turns.values():
        for (start, e2e, _, _), (next_start, _, cached, s) in zip(chain, chain[1:]):
            assert next_start >= start + e2e  # the next turn waits for this one
            assert 0 < cached < s.prompt_len  # and finds its history cached
    assert r["total_cached_tokens"] == sum(r["cached_lens"]) > 0


def check_mt_bench_questions_go_over_chat_and_a_refused_key_is_one_line(deployment, key, tmp, capsys):
    questions = tmp / "questions.jsonl"
    questions.write_text(
        "".join(json.dumps({"turns": [q, "And then?"]}) + "\n" for q in ("Name a color.", "Count to 3."))
    )
    out = tmp / "mt_bench.json"
    argv = ["serve", "--base-url", deployment.base, "--api-key", f"@{key}", "--dataset-name", "mt-bench"]
    argv += ["--dataset-path", str(questions), "--num-prompts", "2", "--mt-bench-output-len", "6"]
    argv += ["--max-concurrency", "2", "--temperature", "0", "--result-file", str(out)]
    assert bench_serve.main(argv) == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["endpoint"], r["dataset_name"]) == (2, bench_data.CHAT, "mt-bench")
    assert all(0 < n <= 6 for n in r["output_lens"]) and all(n > len("Name a color.") for n in r["input_lens"])
    assert all(0 < t <= e for t, e in zip(r["ttfts"], r["latencies"]))
    (tmp / "wrong").write_text("sk-wrong\n")
    capsys.readouterr()
    assert bench_serve.main(["serve", "--base-url", deployment.base, "--api-key", f"@{tmp / 'wrong'}"]) == 2
    assert "refused the API key" in capsys.readouterr().err


def test_bench_serve_reports_consistent_metrics_for_each_dataset_against_kimik3_serve(
    served,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    check_random_poisson_counts_add_up_and_arrivals_keep_the_schedule(served, key, tmp_path, monkeypatch, capsys)
    check_multiturn_sends_each_sessions_turns_in_order_onto_its_cached_prefix(served, key, tmp_path)
    check_mt_bench_questions_go_over_chat_and_a_refused_key_is_one_line(served, key, tmp_path, capsys)
