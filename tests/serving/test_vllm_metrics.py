"""The `vllm:*` series: what a vLLM dashboard or KV-aware router scrapes, with
model_name on every sample, filled from a worker's load and its finished requests."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.vllm_metrics import VLLMMetrics


def samples(registry) -> dict:
    return samples_of(generate_latest(registry).decode())


def test_vllms_names_carry_model_name_and_follow_the_load_and_the_requests():
    reg = CollectorRegistry()
    m = VLLMMetrics(reg, "kimik3-tiny")
    model = (("model_name", "kimik3-tiny"),)
    m.load(running=3, waiting=2, kv_use=0.25, preemptions=1)
    m.load(running=1, waiting=0, kv_use=0.5, preemptions=4)  # the engine's running total: +3
    m.finished(prompt_tokens=100, generation_tokens=8, finished_reason="stop", ttft_s=0.05, tpot_s=0.01, e2e_s=0.2)
    m.finished(prompt_tokens=10, generation_tokens=4, finished_reason="length")
    m.prefix_cache(110, 64)  # an engine's lookups (workers); the router's `finished` feeds none
    got = samples(reg)
    assert got[("vllm:num_requests_running", model)] == 1 and got[("vllm:num_requests_waiting", model)] == 0
    assert got[("vllm:kv_cache_usage_perc", model)] == 0.5
    assert got[("vllm:num_preemptions_total", model)] == 4
    assert got[("vllm:prompt_tokens_total", model)] == 110 and got[("vllm:generation_tokens_total", model)] == 12
    assert got[("vllm:prefix_cache_queries_total", model)] == 110 and got[("vllm:prefix_cache_hits_total", model)] == 64
    reason = lambda r: ("vllm:request_success_total", tuple(sorted((("finished_reason", r),) + model)))
    assert (got[reason("stop")], got[reason("length")], got[reason("abort")]) == (1, 1, 0)
    assert got[("vllm:time_to_first_token_seconds_count", model)] == 1
    assert got[("vllm:e2e_request_latency_seconds_sum", model)] == 0.2
    assert got[("vllm:request_generation_tokens_count", model)] == 2
    assert all(dict(labels).get("model_name") == "kimik3-tiny" for name, labels in got if name.startswith("vllm:"))


def test_a_routers_metrics_carry_each_workers_engine_series_labelled_by_worker():
    """`federate`: the workers' engine series (KV use, the prefix cache, preemptions) and their
    kimik3_worker_* series, one family each with every worker's samples labelled worker=...;
    the router's own never-moving copies are left out (`WithWorkers`), its request series kept."""
    from serving.vllm_metrics import WithWorkers, federate

    texts = {}
    for url, kv in (("http://127.0.0.1:1", 0.25), ("http://127.0.0.1:2", 0.5)):
        reg = CollectorRegistry()
        m = VLLMMetrics(reg, "kimik3-tiny")
        m.load(running=1, waiting=0, kv_use=kv)
        m.prefix_cache(100, 64)
        texts[url] = generate_latest(reg).decode()
    texts["http://127.0.0.1:3"] = None  # did not answer
    families, answered = federate(texts)
    assert answered == {"http://127.0.0.1:1": True, "http://127.0.0.1:2": True, "http://127.0.0.1:3": False}
    router = CollectorRegistry()
    VLLMMetrics(router, "kimik3-tiny").finished(prompt_tokens=5, generation_tokens=2, finished_reason="stop")
    got = samples(WithWorkers(router, families))
    model = ("model_name", "kimik3-tiny")
    kv = {dict(k)["worker"]: v for (name, k), v in got.items() if name == "vllm:kv_cache_usage_perc"}
    assert kv == {"http://127.0.0.1:1": 0.25, "http://127.0.0.1:2": 0.5}  # the router's own 0 is gone
    hits = [v for (name, k), v in got.items() if name == "vllm:prefix_cache_hits_total"]
    assert hits == [64, 64]
    assert got[("vllm:request_success_total", tuple(sorted((("finished_reason", "stop"), model))))] == 1
    assert ("vllm:num_requests_running", (model,)) in got  # the router's (requests), not the workers' (engines)
    assert not [name for name, _ in got if name.endswith("_created") and "prefix" in name]


def test_a_worker_that_does_not_answer_is_a_gauge_and_metrics_answer_in_bounded_time(monkeypatch):
    """A worker whose port refuses, or accepts and never answers: the router's /metrics still
    answers (within its scrape timeout) with kimik3_router_worker_metrics_up 0 for it, and stays
    open without the API key, as vLLM's."""
    import argparse
    import socket
    import time

    from fastapi.testclient import TestClient

    from serving.router import metrics as router_mod
    from serving.router import Router, add_arguments, config_from_args

    monkeypatch.setattr(router_mod, "WORKER_SCRAPE_TIMEOUT_S", 0.5)
    monkeypatch.setenv("KIMIK3_API_KEY", "s3cret")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections queue up; none is ever answered
    hung = f"http://127.0.0.1:{silent.getsockname()[1]}"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--port", "1", "--l1-bytes", "0", "--decode", "http://127.0.0.1:9", hung])
    try:
        with TestClient(Router(config_from_args(args)).create_app()) as c:
            t0 = time.monotonic()
            r = c.get("/metrics")
            assert r.status_code == 200 and time.monotonic() - t0 < 5
            up = {
                dict(k)["worker"]: v
                for (n, k), v in samples_of(r.text).items()
                if n == "kimik3_router_worker_metrics_up"
            }
            assert up == {"http://127.0.0.1:9": 0, hung: 0}
            assert c.get("/v1/models").status_code == 401
    finally:
        silent.close()


def samples_of(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
