"""The worker's HTTP API, in process (FastAPI TestClient) around a real engine on the tiny model."""

import json
import time

import numpy as np
import pytest

from kimik3 import tokenizer
from kimik3.generate import generate
from serving.engine import Engine
from serving.worker import EngineLoop, create_app

PAGE = 16


@pytest.fixture(scope="module")
def client(tiny_cfg, tiny_params):
    from fastapi.testclient import TestClient

    eng = Engine(
        tiny_params,
        tiny_cfg,
        num_pages=24,
        num_slots=2,
        num_snapshots=8,
        page_tokens=PAGE,
        kda_block_tokens=4 * PAGE,
        max_pages_per_request=16,
        prefill_chunk_tokens=32,
        kernels="reference",
    )
    loop = EngineLoop(eng, max_waiting=2, worker_id="w0")
    info = {"role": "both", "worker_id": "w0", "max_context": 256, "page_tokens": PAGE, "namespace": "t"}
    with TestClient(create_app(loop, info, keepalive_s=0.2)) as c:
        c.loop = loop
        yield c


def _lines(resp):
    return [json.loads(line) for line in resp.iter_lines() if line]


def test_generate_streams_the_oracle_tokens_then_done(client, tiny_cfg, tiny_params, rng):
    prompt = rng.integers(0, 256, 40).tolist()
    with client.stream("POST", "/generate", json={"prompt": prompt, "max_tokens": 5}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        events = _lines(r)
    assert events[0]["accepted"] and events[-1]["done"] and events[-1]["finish_reason"] == "length"
    tokens = [e["token"] for e in events if "token" in e]
    assert tokens == generate(tiny_params, tiny_cfg, prompt, 5).tokens.tolist()
    assert [e["index"] for e in events if "token" in e] == list(range(5))


def test_prefill_answers_one_token_and_a_repeat_hits_the_cache(client, tiny_cfg, tiny_params, rng):
    prompt = [7] + rng.integers(0, 256, 70).tolist()  # shares no page with other tests' prompts
    a = client.post("/prefill", json={"prompt": prompt, "max_tokens": 9}).json()
    b = client.post("/prefill", json={"prompt": prompt, "max_tokens": 9}).json()
    assert a["tokens"] == [a["token"]] == generate(tiny_params, tiny_cfg, prompt, 1).tokens.tolist()
    assert a["cached_tokens"] == 0 and b["cached_tokens"] >= 4 * PAGE and b["token"] == a["token"]


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "malformed JSON"),
        (json.dumps({"prompt": "text", "max_tokens": 3}).encode(), 400, "prompt"),
        (json.dumps({"prompt": [1, 2], "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": [1] * 300, "max_tokens": 5}).encode(), 400, "context limit"),
        (json.dumps({"prompt": [999], "max_tokens": 5}).encode(), 400, "token ids"),
    ],
)
def test_bad_requests_are_400_with_a_message(client, body, status, words):
    before = client.get("/load").json()["submitted"]
    r = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and words in r.json()["error"]
    assert client.get("/load").json()["submitted"] - before <= 1  # engine-side checks count as submitted


def test_drain_refuses_new_requests_and_resume_accepts_them(client):
    assert client.post("/drain").json()["draining"]
    h = client.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "draining"
    r = client.post("/generate", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["retriable"]
    assert not client.post("/resume").json()["draining"]
    assert client.get("/health").status_code == 200
    assert client.post("/prefill", json={"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    "leave_on, prompt_len, delay_s",
    [
        # 7 prefill chunks of 32 tokens, 0.2 s a step: the request is still prefilling when the
        # closed stream is noticed
        ("accepted", 200, 0.2),
        # 10 ms a step: the 150 tokens take 1.5 s, so the request is still decoding (unthrottled,
        # tiny can finish all of them first and nothing is cancelled)
        ("token", 30, 0.01),
    ],
    ids=["mid_prefill", "decoding"],
)
def test_a_closed_stream_cancels_the_request_and_frees_every_page(
    client, rng, monkeypatch, leave_on, prompt_len, delay_s
):
    """Every page the request took is back in the pool once it is cancelled (pages it published to
    the prefix cache count as free: they are evictable), whether it was prefilling or decoding."""
    import time

    eng = client.loop.engine
    seen = []  # (tokens computed, context length, tokens emitted) when the cancel reached the engine
    real_cancel = eng.cancel

    def cancel(request_id):
        seen.extend((r.planned_len, len(r.context), len(r.output)) for r in eng.running if r.request_id == request_id)
        return real_cancel(request_id)

    monkeypatch.setattr(eng, "cancel", cancel)
    load0 = client.get("/load").json()
    client.loop.step_delay_s = delay_s
    try:
        prompt = [9] + rng.integers(0, 256, prompt_len - 1).tolist()
        with client.stream(
            "POST", "/generate", json={"prompt": prompt, "max_tokens": 150 if leave_on == "token" else 50}
        ) as r:
            for line in r.iter_lines():
                if f'"{leave_on}"' in line:
                    break  # the connection closes
    finally:
        client.loop.step_delay_s = 0.0

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        load = client.get("/load").json()
        if load["inflight"] == 0 and load["running"] == 0:
            break
        time.sleep(0.05)
    assert load["inflight"] == 0 and load["running"] == 0 and load["cancelled"] == load0["cancelled"] + 1
    assert len(seen) == 1
    computed, context, emitted = seen[0]
    assert (computed < context and emitted == 0) if leave_on == "accepted" else emitted >= 1
    assert load["free_pages"] == load0["free_pages"] == load0["total_pages"]
    for m in eng.managers:
        m.page_pool.check_invariants()


def test_a_full_queue_answers_429(client):
    loop = client.loop
    for _ in range(loop.max_waiting):  # hold the queue's places without running anything
        assert loop.try_reserve() is None
    try:
        r = client.post("/generate", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 429 and r.json()["retriable"]
    finally:
        with loop._lock:
            loop._pending -= loop.max_waiting
    assert client.get("/health").json()["load"]["rejected"] >= 1
    assert b"kimik3_worker" in client.get("/metrics").content or client.get("/metrics").status_code == 200


def test_direct_handoff_moves_the_prompts_kv_from_a_prefill_worker_to_a_decode_worker(tiny_cfg, tiny_params, rng):
    """No store: the prefill worker's answer carries the KV; the decode worker adopts it and
    decodes without computing the prompt, with the oracle's tokens."""
    from fastapi.testclient import TestClient

    def app(role):
        eng = Engine(
            tiny_params,
            tiny_cfg,
            num_pages=24,
            num_slots=2,
            num_snapshots=8,
            page_tokens=PAGE,
            kda_block_tokens=4 * PAGE,
            max_pages_per_request=16,
            prefill_chunk_tokens=32,
            kernels="reference",
            role=role,
        )
        return create_app(EngineLoop(eng, worker_id=role), {"role": role, "max_context": 256}, keepalive_s=0.2)

    prompt = [9] + rng.integers(0, 256, 50).tolist()
    want = generate(tiny_params, tiny_cfg, prompt, 6).tokens.tolist()
    with TestClient(app("prefill")) as pre, TestClient(app("decode")) as dec:
        r = pre.post("/prefill", json={"prompt": prompt, "max_tokens": 1, "export_kv": True})
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        assert int(r.headers["x-kimik3-token"]) == want[0]
        with dec.stream("POST", "/adopt", content=r.content, params={"max_tokens": 6}) as s:
            events = _lines(s)
        assert events[0]["adopt"] and events[-1]["done"]
        assert [want[0]] + [e["token"] for e in events if "token" in e] == want
        assert dec.get("/load").json()["prompt_tokens"] == len(prompt)
        assert dec.post("/adopt", content=b"junk", params={"max_tokens": 6}).status_code == 400
        # held for a decode worker to pull (`serving.kv_handoff`): the answer carries a handle, not the KV
        r = pre.post("/prefill", json={"prompt": prompt, "max_tokens": 1, "hold_kv": True}).json()
        assert r.get("token") == want[0] and r["kv_bytes"] > 0 and pre.get("/load").json()["kv_held"] == 1, r
        assert len(pre.get(f"/kv/{r['kv_handle']}").content) == r["kv_bytes"]
        assert pre.get(f"/kv/{r['kv_handle']}").status_code == 404  # once
        assert pre.get("/load").json()["kv_served"] == 1
        # a pull that cannot reach its source is a 502 the router retries elsewhere
        r = dec.post("/adopt", params={"max_tokens": 6, "kv_from": "http://127.0.0.1:9", "kv_handle": "abc"})
        assert r.status_code == 502 and r.json()["retriable"]
        assert dec.post("/adopt", params={"max_tokens": 6, "kv_from": "http://127.0.0.1:9"}).status_code == 400
        # a decode (or both) worker has nothing to export
        assert dec.post("/prefill", json={"prompt": prompt, "max_tokens": 1, "export_kv": True}).status_code == 400


def test_sampled_generation_is_the_engines_sample_for_that_seed(client, tiny_cfg, tiny_params, rng):
    from serving.sampling import SamplingParams

    prompt = [9] + rng.integers(0, 256, 30).tolist()
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "top_p": 0.95, "seed": 123}
    with client.stream("POST", "/generate", json=body) as r:
        tokens = [e["token"] for e in _lines(r) if "token" in e]
    ref = Engine(
        tiny_params,
        tiny_cfg,
        num_pages=24,
        num_slots=2,
        num_snapshots=8,
        page_tokens=PAGE,
        kda_block_tokens=4 * PAGE,
        max_pages_per_request=16,
        prefill_chunk_tokens=32,
        kernels="reference",
    )
    want = ref.submit(prompt, 6, sampling=SamplingParams(1.0, 0.95, 123))
    ref.run(max_steps=100)
    assert tokens == want.output != generate(tiny_params, tiny_cfg, prompt, 6).tokens.tolist()
    r = client.post("/generate", json=dict(body, temperature=3.0))
    assert r.status_code == 400 and "temperature" in r.json()["error"]


def test_images_travel_as_base64_pixels_and_equal_the_oracle(client, tiny_cfg, tiny_params, rng):
    import base64

    size = tiny_cfg.vit.image_size
    pixels = rng.integers(0, 256, (1, size, size, 3), dtype=np.uint8)
    prompt = tokenizer.apply_chat_template(
        [tokenizer.Message("user", "look", n_images=1)], tokens_per_image=tiny_cfg.vit.tokens_per_image
    )
    body = {"prompt": prompt, "max_tokens": 4, "images": [base64.b64encode(pixels[0].tobytes()).decode()]}
    with client.stream("POST", "/generate", json=body) as r:
        tokens = [e["token"] for e in _lines(r) if "token" in e]
    assert tokens == generate(tiny_params, tiny_cfg, prompt, 4, images=pixels).tokens.tolist()
    r = client.post("/generate", json=dict(body, images=["not base64!"]))
    assert r.status_code == 400 and "base64" in r.json()["error"]
    r = client.post("/generate", json=dict(body, images=None))
    assert r.status_code == 400 and "no images" in r.json()["error"]


def test_a_dead_store_degrades_health_and_costs_requests_nothing(client, tiny_cfg, tiny_params, rng, monkeypatch):
    """With the shared store's master killed, requests still get the oracle's tokens,
    /health says "degraded" (200: still serving), and once the breaker is open no request's
    lookup reaches the store (unguarded, a dead store costs 7-47 s of TTFT)."""
    from cache.guarded_tier import GuardedHostKVTier
    from cache.mooncake_tier import MooncakeHostKVTier
    from tests.conftest import start_mooncake

    svc = start_mooncake(64 << 20)  # its own: the test kills its master
    tier = GuardedHostKVTier(
        MooncakeHostKVTier(svc.master_addr, svc.metadata_url, staging_bytes=1 << 20), timeout_s=2.0, cooldown_s=3600.0
    )
    try:
        monkeypatch.setattr(client.loop.engine.manager, "host", tier)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["store_health"]["breaker"] == "closed"
        svc.kill_master()
        for n in (3, 2):  # the first lookup meets the dead store and opens the breaker
            prompt = [9, n] + rng.integers(0, 256, 3 * PAGE).tolist()
            done = client.post("/prefill", json={"prompt": prompt, "max_tokens": 1}).json()
            assert done["tokens"] == generate(tiny_params, tiny_cfg, prompt, 1).tokens.tolist()
            if n == 3:
                skipped = tier.skipped
        assert tier.skipped > skipped  # the second request's lookup never reached the store
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert health.json()["store_health"]["breaker"] == "open"
    finally:
        svc.stop()
        tier.close()


def _worker_args(*argv):
    import argparse

    from serving import worker

    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    return parser.parse_args(["--port", "1", "--kernels", "reference", *argv])


def test_vllms_sizing_flags_reach_the_engine():
    """--max-model-len caps a request's context (what the router enforces, from the
    worker's info); --gpu-memory-utilization sizes the pool from the device's memory (a clear
    error where the device reports none, or next to --num-pages)."""
    from serving import worker

    eng, _, info = worker.build_engine(_worker_args("--num-pages", "40", "--max-model-len", "100"))
    assert info["max_context"] == 100 and eng.manager.page_pool.num_blocks == 40
    with pytest.raises(ValueError, match="past tiny's"):
        worker.build_engine(_worker_args("--max-model-len", str(10**7)))
    with pytest.raises(ValueError, match="does not\\): pass --num-pages"):
        worker.build_engine(_worker_args("--gpu-memory-utilization", "0.5"))
    with pytest.raises(ValueError, match="pass one"):
        worker.build_engine(_worker_args("--gpu-memory-utilization", "0.5", "--num-pages", "8"))


_MESHES = """
import jax
jax.config.update("jax_num_cpu_devices", 4)
from kimik3 import config
from serving import worker
from tests.serving.test_worker import _worker_args
cfg = config.tiny()
both = worker.meshes(_worker_args("--tensor-parallel-size", "2", "--data-parallel-size", "4", "--enable-expert-parallel"), cfg)
print("both", [dict(m.shape) for m in both])
print("decode", dict(worker.meshes(_worker_args("--role", "decode", "--data-parallel-size", "2"), cfg).shape))
print("one", worker.meshes(_worker_args(), cfg))
try:
    worker.meshes(_worker_args("--role", "decode", "--tensor-parallel-size", "2"), cfg)
except ValueError as e:
    print("refused", e)
"""


def test_the_served_model_name_labels_the_workers_metrics():
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from serving import worker

    args = _worker_args("--num-pages", "16", "--served-model-name", "kimi", "--no-warmup")
    engine, _, info = worker.build_engine(args)
    registry = CollectorRegistry()
    loop = worker.EngineLoop(engine, registry=registry, model_name=args.served_model_name)
    with TestClient(worker.create_app(loop, info, registry=registry)) as c:
        assert 'vllm:num_requests_waiting{model_name="kimi"}' in c.get("/metrics").text


def test_the_workers_metrics_carry_the_engines_step_profile_by_kind():
    """What `kimik3 bench serve` reads: steps, host seconds and device-wait seconds per step kind,
    equal to the engine's own profile after it served a request."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from serving import bench_metrics, worker

    args = _worker_args("--num-pages", "16", "--no-warmup")
    engine, _, info = worker.build_engine(args)
    registry = CollectorRegistry()
    loop = worker.EngineLoop(engine, registry=registry, model_name="m")
    with TestClient(worker.create_app(loop, info, registry=registry)) as c:
        assert bench_metrics.read_step_counters(c.get("/metrics").text) is None  # no step yet
        with c.stream("POST", "/generate", json={"prompt": list(range(1, 30)), "max_tokens": 6}) as r:
            assert r.status_code == 200 and len(list(r.iter_lines())) > 0
        prof, deadline = engine.profile, time.monotonic() + 30
        while True:  # the engine thread ends its last step after the stream's last line
            counters = bench_metrics.read_step_counters(c.get("/metrics").text) or {}
            if {k: v["steps"] for k, v in counters.items()} == dict(prof.steps):
                break
            assert time.monotonic() < deadline, (counters, prof.steps)
            time.sleep(0.05)
    assert "prefill" in counters and sum(v["steps"] for v in counters.values()) >= 2
    for kind, v in counters.items():
        assert v["host_s"] == pytest.approx(prof.host_s[kind]) and v["wait_s"] == pytest.approx(prof.wait_s[kind])


def test_vllms_parallel_flags_become_the_engines_meshes():
    """--tensor-parallel-size (prefill), --data-parallel-size (decode), --enable-expert-parallel
    (the experts over the same devices), on 4 CPU host devices in a fresh process."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MESHES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["both"] == "[{'replica': 1, 'expert': 2}, {'replica': 1, 'expert': 4}]", out.stdout
    assert lines["decode"] == "{'replica': 2, 'expert': 1}" and lines["one"] == "None"
    assert "data-parallel" in lines["refused"]
