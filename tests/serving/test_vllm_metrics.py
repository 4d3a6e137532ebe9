"""The `vllm:*` series: what a vLLM dashboard or KV-aware router scrapes, with
model_name on every sample, filled from a worker's load and its finished requests."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.vllm_metrics import VLLMMetrics


def samples(registry) -> dict:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


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
