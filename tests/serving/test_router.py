"""Router + prefill/decode workers as real processes on 127.0.0.1, sharing a real Mooncake store.

One cluster (worker start-up is the expensive part): 2 prefill workers, 2 decode workers (a
small per-step delay keeps streams long enough to kill one mid-stream), a router.  Every wait
is bounded.  The scenarios (`check_*`) run in order inside one test, so that `pytest -n`
(xdist) cannot split them over two processes and start two clusters; each leaves the cluster
whole for the next.
"""

import base64
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import jax
import numpy as np
import pytest

from kimik3 import config, model, tokenizer
from kimik3.generate import generate
from serving import internal_auth
from serving.launch import child_env, free_port, stop_process, wait_healthy

SEED = 0
PAGE = 16
AUTH = internal_auth.headers(child_env()[internal_auth.ENV])  # the deployment's internal token
CACHE_DIR = os.path.join(tempfile.gettempdir(), "kimik3-test-jax-cache")
WORKER_ARGS = [
    "--config",
    "tiny",
    "--seed",
    str(SEED),
    "--dtype",
    "float32",
    "--page-tokens",
    str(PAGE),
    "--kda-block-tokens",
    str(4 * PAGE),
    "--prefill-chunk-tokens",
    "16",
    "--num-pages",
    "48",
    "--num-slots",
    "2",
    "--max-waiting",
    "8",
    "--compile-cache",
    CACHE_DIR,
    "--kernels",
    "reference",
]
STARTUP_S = 400


class Cluster:
    def __init__(self, services, log_dir):
        self.services, self.log_dir = services, log_dir
        self.namespace = f"tiny/router-test-{os.getpid()}-{int(time.time())}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def worker_argv(self, name: str) -> list[str]:
        role = name.rstrip("0123456789")
        argv = [
            sys.executable,
            "-m",
            "serving.worker",
            "--role",
            role,
            "--port",
            str(self.ports[name]),
            "--worker-id",
            name,
            "--namespace",
            self.namespace,
            "--mooncake-master",
            self.services.master_addr,
            "--mooncake-metadata",
            self.services.metadata_url,
        ] + WORKER_ARGS
        return argv + (["--step-delay-s", "0.03"] if role == "decode" else [])

    def spawn(self, name: str, argv: list[str]) -> None:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "a")
        env = dict(child_env(), JAX_PLATFORMS="cpu")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def start_worker(self, name: str, wait: bool = True) -> None:
        self.ports.setdefault(name, free_port())
        self.spawn(name, self.worker_argv(name))
        if wait:
            self.wait_worker(name)

    def wait_worker(self, name: str, attempts: int = 3) -> None:
        """Wait until the worker answers; a worker that exited because its port was taken between
        `free_port` and its bind (another process's ephemeral port: seen once in a full run) starts
        again on a fresh port, at most `attempts` times in all."""
        for attempt in range(attempts):
            try:
                return wait_healthy(self.url(name), self.procs[name], STARTUP_S)
            except RuntimeError:
                with open(os.path.join(self.log_dir, f"{name}.log")) as f:
                    taken = f"127.0.0.1', {self.ports[name]}): address already in use" in f.read()
                if not taken or attempt == attempts - 1:
                    raise
                self.ports[name] = free_port()
                self.spawn(name, self.worker_argv(name))

    def start(self) -> "Cluster":
        names = ["prefill0", "prefill1", "decode0", "decode1"]
        cold = not os.path.isdir(CACHE_DIR) or len(os.listdir(CACHE_DIR)) < 5
        if cold:  # one worker fills the compilation cache; the others then load from it
            self.start_worker(names[0])
        for n in names[cold:]:
            self.start_worker(n, wait=False)
        for n in names:
            self.wait_worker(n)
        self.ports["router"] = free_port()
        self.spawn(
            "router",
            [
                sys.executable,
                "-m",
                "serving.router",
                "--port",
                str(self.ports["router"]),
                "--config",
                "tiny",
                "--prefill",
                self.url("prefill0"),
                self.url("prefill1"),
                "--decode",
                self.url("decode0"),
                self.url("decode1"),
                "--mooncake-master",
                self.services.master_addr,
                "--mooncake-metadata",
                self.services.metadata_url,
                "--max-inflight",
                "4",
                "--max-queue",
                "4",
                "--queue-timeout-s",
                "4",
                "--read-timeout-s",
                "4",
                "--health-interval-s",
                "0.3",
                "--health-timeout-s",
                "1.5",
                "--breaker-threshold",
                "2",
                "--breaker-cooldown-s",
                "2",
                "--breaker-max-cooldown-s",
                "4",
                "--retries",
                "3",
                "--log-level",
                "info",
                "--max-body-bytes",
                str(1 << 20),
                "--body-timeout-s",
                "1",
            ],
        )
        wait_healthy(self.url("router"), self.procs["router"], 60)
        return self

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
        for p in self.procs.values():
            stop_process(p, timeout_s=10)


@pytest.fixture(scope="module")
def cluster(mooncake_services, tmp_path_factory):
    c = Cluster(mooncake_services, str(tmp_path_factory.mktemp("cluster")))
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def params():
    """The workers' weights: same config, seed and dtype."""
    return model.init_params(config.tiny(), jax.random.PRNGKey(SEED), "float32")


def oracle(params, prompt, n, images=None):
    return generate(params, config.tiny(), prompt, n, images=images, stop_at_eos=True).tokens.tolist()


def png_data_url(pixels):
    """A base64 PNG data: URL of uint8 [S, S, 3] pixels."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat_body(text, pixels, max_tokens):
    return {
        "model": "kimik3-tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url(pixels)}},
                    {"type": "text", "text": text},
                ],
            }
        ],
    }


def sampled(params, prompt, n, sp):
    """What one in-process engine samples for these parameters (the draws are seeded per position)."""
    from serving.engine import Engine
    from serving.sampling import SamplingParams

    eng = Engine(
        params,
        config.tiny(),
        num_pages=32,
        num_slots=1,
        page_tokens=PAGE,
        kda_block_tokens=4 * PAGE,
        max_pages_per_request=16,
        kernels="reference",
    )
    req = eng.submit(prompt, n, stop_at_eos=True, sampling=SamplingParams(**sp))
    eng.run(max_steps=200)
    return req.output


def chat_body(text, max_tokens, **kw):
    """A chat request; greedy unless kw says otherwise (OpenAI's default temperature is 1)."""
    return {
        "model": "kimik3-tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **kw,
    }


def chat_prompt(text):
    return tokenizer.apply_chat_template([tokenizer.Message("user", text)])


def sse_events(resp):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                return
            yield json.loads(line[6:])


def metric(cluster, name, **labels) -> float:
    text = httpx.get(cluster.url("router") + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def metric_value(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def workers(cluster) -> dict:
    workers = httpx.get(cluster.url("router") + "/admin/workers", timeout=10, headers=AUTH).json()["workers"]
    return {w["url"]: w for w in workers}


def wait_for(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


# ---- unit tests of the router's parts (no processes) -------------------------------------------------
def test_circuit_breaker_opens_half_opens_and_closes():
    from serving.router import CircuitBreaker

    now = [0.0]
    b = CircuitBreaker(threshold=2, cooldown_s=5, max_cooldown_s=8, clock=lambda: now[0])
    b.failure()
    assert b.state == "closed" and b.available()
    b.failure()
    assert b.state == "open" and not b.available()
    b.success()  # a late success from before the opening does not close it
    assert b.state == "open"
    now[0] = 5.0
    assert b.state == "half_open" and b.available()
    b.failure()  # the trial failed: open again, longer
    assert b.state == "open" and b.cooldown_s == 8
    now[0] = 13.0
    b.success()
    assert b.state == "closed" and b.cooldown_s == 5 and b.failures == 0


def test_admission_runs_queues_then_sheds():
    import asyncio

    from serving.router import Admission, Overloaded

    async def go():
        adm = Admission(max_inflight=2, max_queue=1, timeout_s=0.3)
        await adm.acquire()
        await adm.acquire()
        queued = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0.05)
        assert adm.waiting == 1
        try:
            await adm.acquire()  # queue full: shed at once
            raise AssertionError("not shed")
        except Overloaded:
            pass
        await adm.release()
        await asyncio.wait_for(queued, 1)  # the queued one got the freed place
        assert adm.running == 2
        try:
            await adm.acquire()  # waits its bound, then shed
            raise AssertionError("not shed")
        except Overloaded as e:
            assert "within" in str(e)

    asyncio.run(go())


def test_prefix_affinity_applies_only_when_the_prefix_is_not_in_the_shared_store():
    import asyncio

    from serving.router import Router, RouterConfig

    r = Router(RouterConfig(prefill=["http://a", "http://b"], decode=["http://c"], affinity_slack=1.0))
    a, b = r.prefill
    for w in r.workers:
        w.healthy, w.info = True, {"namespace": "ns", "page_tokens": 4}
    turn1 = list(range(20))
    r._remember(turn1, a.url)
    turn2 = turn1 + [7, 7, 7, 7, 7]

    class Probe:
        def __init__(self, found):
            self.found = found

        def has(self, ns, h):
            return self.found

    async def choose():
        return (await r.pick(r.prefill, set(), turn2)).url

    b.inflight, a.inflight = 0, 1  # a holds the prefix and is a little busier: affinity still wins
    assert asyncio.run(choose()) == a.url
    r.store = Probe(True)  # any worker finds it in the store: load decides
    assert asyncio.run(choose()) == b.url
    r.store = Probe(False)
    a.inflight = 3  # too busy for affinity to pay
    assert asyncio.run(choose()) == b.url
    a.breaker._state, a.breaker.opened_at, a.inflight = "open", 1e18, 0  # open circuit: never chosen
    assert asyncio.run(choose()) == b.url
    text = r.metrics.registry.get_sample_value
    assert text("kimik3_router_prefill_choice_total", {"decision": "affinity"}) == 1
    assert text("kimik3_router_prefill_choice_total", {"decision": "store"}) == 1


def test_the_routers_hashes_of_an_image_prompt_are_the_engines(rng, tiny_cfg, tiny_params):
    """The prefix cache (L4) across image prompts: the router hashes an image prompt as the
    workers' caches do (the image's content in the blocks it spans), so image prompts meet their
    workers' blocks for affinity and the store probe, and two prompts that differ only in their
    image do not."""
    import base64

    from kimik3 import tokenizer
    from serving.engine import Engine, EngineConfig
    from serving.router import Router, RouterConfig

    page = 16
    eng = Engine(
        tiny_params,
        tiny_cfg,
        EngineConfig(num_pages=16, num_slots=2, page_tokens=page, kda_block_tokens=4 * page, kernels="reference"),
    )
    r = Router(RouterConfig(decode=["http://d"]))
    r.decode[0].info = {"namespace": eng.manager.spec.namespace, "page_tokens": page}
    prompt = tokenizer.apply_chat_template(
        [tokenizer.Message("user", "what is in the picture, in a few words?", n_images=1)],
        tokens_per_image=tiny_cfg.vit.tokens_per_image,
    )
    s = tiny_cfg.vit.image_size
    img, other = (rng.integers(0, 256, (1, s, s, 3), dtype=np.uint8) for _ in range(2))
    b64 = lambda a: [base64.b64encode(a[0].tobytes()).decode()]  # what parse() sends the workers  # noqa: E731
    for salt in (None, "tenant"):
        want = eng.manager.hashes(prompt, eng._check_images(prompt, img)[1], salt=salt)
        assert len(want) >= 2 and r._hashes(prompt, salt, b64(img)) == want
        got_other = r._hashes(prompt, salt, b64(other))
        first = prompt.index(tokenizer.IMAGE_ID) // page
        assert got_other[:first] == want[:first] and got_other[first] != want[first]


def test_router_options_from_a_config_file(tmp_path):
    import argparse

    from serving.router import add_arguments, config_from_args

    f = tmp_path / "router.json"
    f.write_text(json.dumps({"prefill": ["http://p"], "decode": ["http://d"], "max_inflight": 3, "retries": 1}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--port", "1", "--config-file", str(f), "--retries", "5"]))
    assert cfg.prefill == ["http://p"] and cfg.max_inflight == 3 and cfg.retries == 5
    f.write_text(json.dumps({"decode": ["http://d"], "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        config_from_args(parser.parse_args(["--port", "1", "--config-file", str(f)]))


def test_a_worker_whose_tokenizer_ends_requests_elsewhere_is_kept_out_of_the_pools():
    """A worker reports its tokenizer on /health: one whose end-of-sequence id is not the router's
    would never end a request where the router expects, so it is unhealthy, with the reason."""
    import asyncio

    from serving.router import Router, RouterConfig
    from tests.cache.test_media_fetch import ImageServer

    server = ImageServer()
    health = lambda eos: (
        200,
        {"Content-Type": "application/json"},
        json.dumps({"status": "ok", "tokenizer": {"name": "x", "eos_id": eos}}).encode(),
    )
    router = Router(RouterConfig(decode=[f"http://127.0.0.1:{server.port}"]))

    async def check(eos):
        server.routes["/health"] = health(eos)
        async with httpx.AsyncClient() as router.client:
            await router._check(router.decode[0])
        return router.decode[0]

    try:
        w = asyncio.run(check(tokenizer.EOS_ID + 1))
        assert not w.healthy and "tokenizer mismatch" in w.last_error
        assert asyncio.run(check(tokenizer.EOS_ID)).healthy
    finally:
        server.httpd.shutdown()


# ---- tests with processes ----------------------------------------------------------------------------
def check_greedy_output_through_router_and_workers_equals_the_oracle(cluster, params):
    base = cluster.url("router")
    text = "Tell me about the lifecycle of state in a hybrid model, in detail, please."  # 5 full pages
    prompt = chat_prompt(text)
    want = oracle(params, prompt, 10)
    r = httpx.post(base + "/v1/chat/completions", json=chat_body(text, 10), timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "kimik3-tiny"
    choice = body["choices"][0]
    assert choice["token_ids"] == want and choice["message"]["content"] == tokenizer.decode(want)
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(want),
        "total_tokens": len(prompt) + len(want),
        "prompt_tokens_details": {"cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]},
    }
    # the decode worker took the prompt's KV from the shared store instead of recomputing it
    assert metric(cluster, "kimik3_router_handoff_cached_tokens_total") >= (len(prompt) // PAGE) * PAGE

    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        timeout=120,
        json=chat_body(text, 10, stream=True, stream_options={"include_usage": True}),
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == want
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == tokenizer.decode(want)
    assert events[-1]["usage"]["completion_tokens"] == len(want)
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again

    # an image (PNG data URL at the ViT's size): the same tokens as the oracle on those pixels
    size = config.tiny().vit.image_size
    pixels = np.random.default_rng(3).integers(0, 256, (size, size, 3), dtype=np.uint8)
    img_prompt = tokenizer.apply_chat_template(
        [tokenizer.Message("user", "what is this?", n_images=1)], tokens_per_image=config.tiny().vit.tokens_per_image
    )
    r = httpx.post(base + "/v1/chat/completions", json=image_chat_body("what is this?", pixels, 6), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == oracle(params, img_prompt, 6, pixels[None])

    # sampling: one seed gives one sample, through the prefill -> decode pair as in one engine
    sp = dict(temperature=1.0, top_p=0.9, seed=77)
    got = [
        httpx.post(base + "/v1/chat/completions", json=chat_body(text, 10, **sp), timeout=120).json()["choices"][0][
            "token_ids"
        ]
        for _ in range(2)
    ]
    assert got[0] == got[1] == sampled(params, prompt, 10, sp) != want

    ids = [tokenizer.BOS_ID] + tokenizer.encode("plain completion")
    r = httpx.post(
        base + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0}, timeout=120
    )
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == oracle(params, ids, 6)
    models = httpx.get(base + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["kimik3-tiny"]
    assert "kimik3_router_ttft_seconds_bucket" in httpx.get(base + "/metrics", timeout=10).text
    # vLLM's names with model_name, at the router (requests) and at each worker (engine)
    assert metric(cluster, "vllm:request_success_total", model_name="kimik3-tiny", finished_reason="length") >= 1
    assert metric(cluster, "vllm:time_to_first_token_seconds_count", model_name="kimik3-tiny") >= 5
    assert metric(cluster, "vllm:num_requests_waiting", model_name="kimik3-tiny") == 0
    worker = httpx.get(cluster.url("decode0") + "/metrics", timeout=10).text
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ):
        assert f'{name}{{model_name="kimik3-tiny"}}' in worker, name
    # request-level series come from the router alone (a P/D pair would count each request twice)
    assert (
        'vllm:request_success_total{finished_reason="length",model_name="kimik3-tiny"} 0.0' in worker
        or 'vllm:request_success_total{model_name="kimik3-tiny",finished_reason="length"} 0.0' in worker
    )


def check_stop_sequences_and_stop_tokens_end_the_text_where_the_oracle_says(cluster, params):
    """`stop` cuts the completion before the first stop string, streamed or not (the
    string spans tokens: held back until settled), `stop_token_ids` ends it at that token (its
    text left out); finish_reason "stop", the usage counts what was generated."""
    base = cluster.url("router")
    text = "Where should the text stop? Somewhere in the middle of the answer."
    prompt = chat_prompt(text)
    want = oracle(params, prompt, 12)
    full = tokenizer.decode(want)
    assert len(want) >= 6 and len(full) >= 6, (want, full)
    stop = full[len(full) // 2 : len(full) // 2 + 2]  # two bytes of the model's own text: two tokens
    cut = full[: full.find(stop)]
    r = httpx.post(base + "/v1/chat/completions", json=chat_body(text, 12, stop=stop), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == cut and choice["finish_reason"] == "stop"
    assert want[: len(choice["token_ids"])] == choice["token_ids"] and len(choice["token_ids"]) < len(want)
    assert r.json()["usage"]["completion_tokens"] == len(choice["token_ids"])
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        timeout=120,
        json=chat_body(text, 12, stop=[stop, "never in it \u2603"], stream=True),
    ) as r:
        events = list(sse_events(r))
    deltas = [c["delta"].get("content", "") for e in events for c in e["choices"]]
    assert "".join(deltas) == cut and events[-1]["choices"][0]["finish_reason"] == "stop"
    # a stop token: generation ends at it, its text left out
    at = 3
    r = httpx.post(base + "/v1/chat/completions", json=chat_body(text, 12, stop_token_ids=[want[at]]), timeout=120)
    choice = r.json()["choices"][0]
    first = want.index(want[at])
    assert choice["token_ids"] == want[: first + 1] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == tokenizer.decode(want[:first])
    # vLLM's top_k reaches the workers: top_k 1 at temperature 1 is the greedy answer
    r = httpx.post(
        base + "/v1/chat/completions", json=chat_body(text, 12, temperature=1.0, top_k=1, seed=9), timeout=120
    )
    assert r.json()["choices"][0]["token_ids"] == want
    # the defaults clients send for fields we do not implement are accepted (and change nothing)
    r = httpx.post(
        base + "/v1/chat/completions",
        timeout=120,
        json=chat_body(
            text, 4, logprobs=False, frequency_penalty=0, presence_penalty=0, tools=[], logit_bias={}, top_logprobs=0
        ),
    )
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want[:4]


def assert_logprobs_are_the_oracles(params, prompt, choice):
    """A greedy chat choice's logprobs: one entry per token, each the oracle's log-softmax."""
    tokens = choice["token_ids"]
    result = generate(params, config.tiny(), prompt, len(tokens), stop_at_eos=True)
    assert result.tokens.tolist() == tokens
    content = choice["logprobs"]["content"]
    assert len(content) == len(tokens)
    for tok, entry, logits in zip(tokens, content, result.logits):
        ref = jax.nn.log_softmax(jax.numpy.asarray(logits, "float32"))
        assert entry["bytes"] == list(tokenizer.token_bytes(tok))
        assert abs(entry["logprob"] - float(ref[tok])) < 1e-3
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]  # greedy: the chosen token is the top one
        assert len(entry["top_logprobs"]) == 2 and sum(math.exp(t["logprob"]) for t in entry["top_logprobs"]) <= 1


def check_logprobs_and_penalties_reach_the_workers_and_come_back_in_openais_shapes(cluster, params):
    """Chat logprobs (streamed and not) are the oracle's log-softmax, completions give the
    legacy lists with text offsets, and greedy decoding with penalties gives the oracle's tokens
    under vLLM's penalty rule (prefill worker's first token, decode worker's others)."""
    base = cluster.url("router")
    text = "Tell me which tokens you were sure of."
    prompt = chat_prompt(text)
    r = httpx.post(base + "/v1/chat/completions", json=chat_body(text, 8, logprobs=True, top_logprobs=2), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert_logprobs_are_the_oracles(params, prompt, choice)
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        timeout=120,
        json=chat_body(text, 8, logprobs=True, top_logprobs=2, stream=True),
    ) as s:
        chunks = [c for e in sse_events(s) for c in e["choices"] if c.get("token_ids")]
    assert [c["logprobs"]["content"][0] for c in chunks] == choice["logprobs"]["content"]
    r = httpx.post(
        base + "/v1/completions",
        timeout=120,
        json={"model": "kimik3-tiny", "prompt": text, "max_tokens": 6, "temperature": 0, "logprobs": 1},
    )
    legacy = r.json()["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) == 6
    assert all(len(t) <= 1 for t in legacy["top_logprobs"]) and legacy["text_offset"] == sorted(legacy["text_offset"])
    result = generate(params, config.tiny(), [tokenizer.BOS_ID] + tokenizer.encode(text), 6, stop_at_eos=True)
    assert r.json()["choices"][0]["token_ids"] == result.tokens.tolist() and legacy["text_offset"][0] == 0
    ref = jax.nn.log_softmax(jax.numpy.asarray(result.logits), axis=-1)
    np.testing.assert_allclose(
        legacy["token_logprobs"], [float(ref[i, t]) for i, t in enumerate(result.tokens)], atol=1e-3
    )
    from tests.serving.test_engine_logprobs import penalized_greedy

    pen = dict(presence_penalty=0.5, frequency_penalty=1.5)
    want = generate(
        params,
        config.tiny(),
        prompt,
        16,
        stop_at_eos=True,
        choose=penalized_greedy(pen["presence_penalty"], pen["frequency_penalty"]),
    ).tokens.tolist()
    r = httpx.post(base + "/v1/chat/completions", json=chat_body(text, 16, **pen), timeout=120)
    assert r.json()["choices"][0]["token_ids"] == want != oracle(params, prompt, 16)


def check_direct_handoff_through_a_second_router_equals_the_oracle(cluster, params):
    """The same workers behind a router that carries the KV itself (no store on the way)."""
    port = free_port()
    cluster.ports["router_direct"] = port
    cluster.spawn(
        "router_direct",
        [
            sys.executable,
            "-m",
            "serving.router",
            "--port",
            str(port),
            "--config",
            "tiny",
            "--handoff",
            "direct",
            "--prefill",
            cluster.url("prefill0"),
            cluster.url("prefill1"),
            "--decode",
            cluster.url("decode0"),
            cluster.url("decode1"),
        ],
    )
    wait_healthy(cluster.url("router_direct"), cluster.procs["router_direct"], 60)
    text = "Direct handoff: the prompt's pages and state travel with the first token, no store."
    want = oracle(params, chat_prompt(text), 8)
    r = httpx.post(cluster.url("router_direct") + "/v1/chat/completions", json=chat_body(text, 8), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
    # the sampling filters travel with the handoff too (/adopt's parameters): min_p 1 keeps the top token
    r = httpx.post(
        cluster.url("router_direct") + "/v1/chat/completions",
        timeout=120,
        json=chat_body(text, 8, temperature=1.0, min_p=1.0, seed=4),
    )
    assert r.json()["choices"][0]["token_ids"] == want
    # the first token's logprobs come from the prefill worker (with the KV), the rest from the decode worker
    r = httpx.post(
        cluster.url("router_direct") + "/v1/chat/completions",
        timeout=120,
        json=chat_body(text, 8, logprobs=True, top_logprobs=2),
    )
    assert_logprobs_are_the_oracles(params, chat_prompt(text), r.json()["choices"][0])
    text = httpx.get(cluster.url("router_direct") + "/metrics", timeout=10).text
    assert 'kimik3_router_handoffs_total{mode="direct"} 3.0' in text
    # the KV went worker to worker: the prefill workers served each handoff once and hold none now
    loads = [httpx.get(cluster.url(f"prefill{i}") + "/load", timeout=10).json() for i in (0, 1)]
    assert sum(x["kv_served"] for x in loads) == 3 and sum(x["kv_held"] for x in loads) == 0
    assert metric_value(text, "kimik3_router_direct_handoff_bytes_total") > 0
    stop_process(cluster.procs.pop("router_direct"))


BAD = [
    ("malformed JSON", b'{"model": "kimik3-tiny", "messages": [', 400, "malformed JSON"),
    ("not an object", b"[1, 2]", 400, "JSON object"),
    ("wrong type", json.dumps({"model": "kimik3-tiny", "messages": "hello"}).encode(), 400, "messages"),
    ("wrong content type", json.dumps(chat_body(5, 3)).encode(), 400, "content"),
    ("wrong max_tokens type", json.dumps(chat_body("hi", "many")).encode(), 400, "max_tokens"),
    ("missing messages", json.dumps({"model": "kimik3-tiny"}).encode(), 400, "messages"),
    ("unknown model", json.dumps({**chat_body("hi", 3), "model": "gpt-9"}).encode(), 404, "does not exist"),
    ("prompt over the context", json.dumps(chat_body("x" * 1100, 3)).encode(), 400, "maximum context length"),
    ("max_tokens zero", json.dumps(chat_body("hi", 0)).encode(), 400, "max_tokens"),
    ("max_tokens over the context", json.dumps(chat_body("hi", 5000)).encode(), 400, "maximum context length"),
    (
        "too many images",
        json.dumps(
            {
                "model": "kimik3-tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}] * 17
                        + [{"type": "text", "text": "hi"}],
                    }
                ],
            }
        ).encode(),
        400,
        "too many images",
    ),
    (
        "broken image",
        json.dumps(
            {
                "model": "kimik3-tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAA"}}
                        ],
                    }
                ],
            }
        ).encode(),
        400,
        "broken image",
    ),
    (
        "remote image URL",
        json.dumps(
            {
                "model": "kimik3-tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}],
                    }
                ],
            }
        ).encode(),
        400,
        "non-public address",
    ),  # the fetcher refuses loopback before connecting
    (
        "file image URL",
        json.dumps(
            {
                "model": "kimik3-tiny",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}
                ],
            }
        ).encode(),
        400,
        "http(s) URLs",
    ),
    (
        "bad role",
        json.dumps({"model": "kimik3-tiny", "messages": [{"role": "robot", "content": "hi"}]}).encode(),
        400,
        "role",
    ),
    ("n > 1", json.dumps(chat_body("hi", 3, n=2)).encode(), 400, "n must be 1"),
    ("temperature out of range", json.dumps(chat_body("hi", 3, temperature=7)).encode(), 400, "temperature"),
    ("temperature as a string", json.dumps(chat_body("hi", 3, temperature="0.5")).encode(), 400, "temperature"),
    (
        "nested too deeply",
        b'{"model": "kimik3-tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        "nested too deeply",
    ),
    ("a lone surrogate", json.dumps(chat_body("hi \ud800", 3)).encode(), 400, "not valid Unicode"),
    ("a body over the cap", json.dumps(chat_body("x" * (1 << 20), 3)).encode(), 413, "larger than"),
    # no field is silently ignored
    (
        "an unknown field",
        json.dumps(chat_body("hi", 3, frobnicate=1)).encode(),
        400,
        "Unrecognized request argument supplied: frobnicate",
    ),
    (
        "top_logprobs over 20",
        json.dumps(chat_body("hi", 3, logprobs=True, top_logprobs=21)).encode(),
        400,
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        json.dumps(chat_body("hi", 3, top_logprobs=2)).encode(),
        400,
        "top_logprobs needs logprobs",
    ),
    (
        "logit_bias",
        json.dumps(chat_body("hi", 3, logit_bias={"50": 10})).encode(),
        400,
        "'logit_bias' is not supported",
    ),
    (
        "tools",
        json.dumps(chat_body("hi", 3, tools=[{"type": "function", "function": {"name": "f"}}])).encode(),
        400,
        "'tools' is not supported",
    ),
    (
        "a penalty out of range",
        json.dumps(chat_body("hi", 3, frequency_penalty=2.5)).encode(),
        400,
        "frequency_penalty",
    ),
    (
        "repetition_penalty",
        json.dumps(chat_body("hi", 3, repetition_penalty=1.2)).encode(),
        400,
        "'repetition_penalty' is not supported",
    ),
    ("five stop sequences", json.dumps(chat_body("hi", 3, stop=list("abcde"))).encode(), 400, "at most 4"),
    (
        "a stop token out of the vocabulary",
        json.dumps(chat_body("hi", 3, stop_token_ids=[10**6])).encode(),
        400,
        "not a token id",
    ),
]


def _huge_png() -> bytes:
    """A 5000 x 4000 PNG (a few KB compressed: a decompression bomb under PIL's own limit)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5000, 4000)).save(buf, format="PNG")
    return buf.getvalue()


def check_a_tenant_never_sees_another_tenants_prefix_in_cached_tokens(cluster, params):
    """The cross-tenant prefix oracle (no API key: every client is the anonymous tenant, and
    `cache_salt` narrows within it): A's prompt (a secret in its system prompt) cached under its
    salt, B (another `cache_salt`, or none) sending the same prompt sees cached_tokens 0 and gets
    the same tokens; A sending it again hits its own blocks.  `user` narrows nothing: two users
    without a salt share the unsalted cache (tenants come from API keys: test_router_security.py)."""
    base = cluster.url("router")
    text = "system: the PIN is 4821. Never reveal it. " * 3
    prompt, want = chat_prompt(text), None

    def cached(**kw):
        nonlocal want
        r = httpx.post(base + "/v1/chat/completions", json=chat_body(text, 3, **kw), timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        want = want or oracle(params, prompt, 3)
        assert body["choices"][0]["token_ids"] == want
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    full = (len(prompt) // PAGE - 1) * PAGE
    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-b") == 0
    assert cached(user="mallory") == 0  # nor the shared, unsalted cache
    assert cached(user="alice") >= full  # which `user` does not split
    assert cached(cache_salt="tenant-a") >= full


def check_workers_and_admin_routes_refuse_callers_without_the_internal_token(cluster, params):
    """A worker's POSTs and the router's admin routes need the deployment's token;
    an authenticated /adopt of hostile KV (NaN pages for a real prompt) is refused, and the
    prompt's next request still gets the oracle's tokens (nothing was committed)."""
    import io as _io

    worker = cluster.url("decode0")
    prompt = chat_prompt("poison me if you can")
    for path in ("/generate", "/prefill", "/drain", "/resume"):
        r = httpx.post(worker + path, json={"prompt": prompt, "max_tokens": 2}, timeout=10)
        assert r.status_code == 401, (path, r.text)
        r = httpx.post(
            worker + path,
            json={"prompt": prompt, "max_tokens": 2},
            timeout=10,
            headers={"Authorization": "Bearer wrong"},
        )
        assert r.status_code == 401, path
    r = httpx.post(cluster.url("router") + "/admin/drain", json={"url": worker}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(worker + "/health", timeout=5).json()["status"] == "ok"  # nothing was drained
    info = httpx.get(worker + "/health", timeout=5).json()
    n_pages = -(-len(prompt) // info["page_tokens"])
    buf = _io.BytesIO()
    np.savez(
        buf,
        prompt=np.asarray(prompt, np.int32),
        token=np.int32(5),
        pages=np.full((n_pages,) + tuple(info["page_shape"]), np.nan, np.float32),
        state=np.zeros(info["snapshot_size"], np.float32),
    )
    r = httpx.post(worker + "/adopt", params={"max_tokens": 4}, content=buf.getvalue(), timeout=30, headers=AUTH)
    assert r.status_code == 400 and "finite" in r.json()["error"]
    got = httpx.post(
        cluster.url("router") + "/v1/chat/completions", json=chat_body("poison me if you can", 4), timeout=120
    ).json()["choices"][0]["token_ids"]
    assert got == oracle(params, prompt, 4)


def _worker_counts(cluster) -> dict:
    """Summed /load counters: every worker's `cancelled`, the decode pool's `submitted` / `finished`."""
    loads = {
        n: httpx.get(cluster.url(n) + "/load", timeout=10).json()
        for n in ("prefill0", "prefill1", "decode0", "decode1")
    }
    return {
        "cancelled": sum(v["cancelled"] for v in loads.values()),
        "inflight": sum(v["inflight"] for v in loads.values()),
        "decode_submitted": sum(v["submitted"] for n, v in loads.items() if n.startswith("decode")),
        "decode_finished": sum(v["finished"] for n, v in loads.items() if n.startswith("decode")),
    }


def _assert_nobody_decodes_for_the_client_that_left(cluster, before: dict, what: str) -> None:
    """Once the router has closed the stream (its inflight gauge back to 0: no attempt can start
    after that) and every worker is idle, the request's worker request was cancelled, or, when the
    client left during the prefill -> decode handoff, no decode request was ever sent; never did a
    decode worker run it to max_tokens."""
    wait_for(
        lambda: metric(cluster, "kimik3_router_inflight") == 0 and _worker_counts(cluster)["inflight"] == 0,
        30,
        f"the router and every worker to let go of {what}",
    )
    after = _worker_counts(cluster)
    assert after["decode_finished"] == before["decode_finished"], f"{what} was decoded to its end for nobody"
    assert after["cancelled"] > before["cancelled"] or after["decode_submitted"] == before["decode_submitted"], (
        f"{what}: a decode request was sent and neither cancelled nor finished",
        before,
        after,
    )


def check_a_client_that_leaves_cancels_its_worker_request(cluster):
    """A client that goes away (a streamed request closed after its first chunk, a
    non-streamed one timing out) gets its worker request cancelled, not decoded to max_tokens."""
    base = cluster.url("router")
    before = _worker_counts(cluster)
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        timeout=60,
        json=chat_body("tell me a long story", 600, stream=True, ignore_eos=True),
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    _assert_nobody_decodes_for_the_client_that_left(cluster, before, "the streamed request")
    before, abandoned = _worker_counts(cluster), metric(cluster, "kimik3_router_abandoned_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/chat/completions", json=chat_body("tell me another", 600, ignore_eos=True), timeout=1.5)
    _assert_nobody_decodes_for_the_client_that_left(cluster, before, "the non-streamed request")
    wait_for(
        lambda: metric(cluster, "kimik3_router_abandoned_total") == abandoned + 1,
        10,
        "the router to count the abandoned request",
    )


def check_bad_input_is_a_4xx_in_openai_shape_and_never_reaches_a_worker(cluster):
    base = cluster.url("router")
    urls = [cluster.url(n) for n in ("prefill0", "prefill1", "decode0", "decode1")]
    submitted = lambda: sum(httpx.get(u + "/load", timeout=10).json()["submitted"] for u in urls)
    before, attempts = submitted(), metric(cluster, "kimik3_router_worker_requests_total")
    for name, raw, status, words in BAD:
        r = httpx.post(
            base + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=30
        )
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and words in err["message"], (name, err)
    r = httpx.post(
        base + "/v1/completions", json={"model": "kimik3-tiny", "prompt": [1, 99999], "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 400 and "token id" in r.json()["error"]["message"]
    url = "data:image/png;base64," + base64.b64encode(_huge_png()).decode()
    r = httpx.post(
        base + "/v1/chat/completions",
        timeout=30,
        json={
            "model": "kimik3-tiny",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        },
    )
    assert r.status_code == 400 and "pixels" in r.json()["error"]["message"]
    assert httpx.post(base + "/v1/nothing", json={}, timeout=10).status_code == 404
    # half a body, then silence: a 408 once --body-timeout-s passes, not a connection held forever
    import socket

    with socket.create_connection(("127.0.0.1", cluster.ports["router"]), timeout=20) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": "kimik3-tiny", '
        )
        reply = b""
        while b"did not arrive" not in reply:  # headers and body may come in separate packets
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive" in reply, reply[:200]
    assert submitted() == before and metric(cluster, "kimik3_router_worker_requests_total") == attempts


def check_a_decode_worker_killed_mid_stream_fails_over_without_duplicates_and_its_restart_finds_the_kv(cluster, params):
    base = cluster.url("router")
    text = "A long answer, please: stream it slowly so that a worker can die halfway through it."
    prompt = chat_prompt(text)
    want = oracle(params, prompt, 40)
    failovers = metric(cluster, "kimik3_router_failovers_total")
    streamed, victim = [], None
    t0 = time.monotonic()
    with httpx.stream("POST", base + "/v1/chat/completions", json=chat_body(text, 40, stream=True), timeout=60) as r:
        assert r.status_code == 200
        for ev in sse_events(r):
            assert "error" not in ev, ev
            streamed += [t for c in ev["choices"] for t in c.get("token_ids", [])]
            if victim is None and len(streamed) >= 3:
                busy = [
                    n
                    for n in ("decode0", "decode1")
                    if httpx.get(cluster.url(n) + "/load", timeout=5).json()["inflight"] > 0
                ]
                assert len(busy) == 1, busy
                victim = busy[0]
                os.killpg(cluster.procs[victim].pid, signal.SIGKILL)
                killed_at = len(streamed)
    assert time.monotonic() - t0 < 60
    assert streamed == want  # every token once, in order, equal to the oracle
    assert killed_at < len(want) and metric(cluster, "kimik3_router_failovers_total") >= failovers + 1
    cluster.procs[victim].wait(timeout=10)

    # the restarted worker finds the first turn's KV (published by the prefill worker) in the store
    cluster.start_worker(victim)
    turn2 = prompt + want + chat_prompt("and then?")[1:]
    r = httpx.post(cluster.url(victim) + "/prefill", json={"prompt": turn2, "max_tokens": 1}, timeout=60, headers=AUTH)
    assert r.status_code == 200 and r.json()["cached_tokens_host"] >= (len(prompt) // PAGE) * PAGE
    assert r.json()["token"] == oracle(params, turn2, 1)[0]
    wait_for(lambda: workers(cluster)[cluster.url(victim)]["circuit"] == "closed", 30, "the circuit to close")


def check_a_hanging_prefill_worker_opens_its_circuit_and_traffic_moves(cluster, params):
    base = cluster.url("router")
    hung, other = cluster.url("prefill0"), cluster.url("prefill1")
    os.killpg(cluster.procs["prefill0"].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        texts = [f"hang test {i}" for i in range(3)]
        results = [None] * len(texts)

        def send(i):
            results[i] = httpx.post(base + "/v1/chat/completions", json=chat_body(texts[i], 3), timeout=60)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for text, r in zip(texts, results):  # in flight while it hung: retried elsewhere, in bounded time
            assert r is not None and r.status_code == 200, r and r.text
            assert r.json()["choices"][0]["token_ids"] == oracle(params, chat_prompt(text), 3)
        assert time.monotonic() - t0 < 40
        wait_for(lambda: workers(cluster)[hung]["circuit"] == "open", 20, "the hung worker's circuit to open")
        ok_hung = metric(cluster, "kimik3_router_worker_requests_total", worker=hung, outcome="ok")
        ok_other = metric(cluster, "kimik3_router_worker_requests_total", worker=other, role="prefill", outcome="ok")
        for i in range(3):
            t1 = time.monotonic()
            r = httpx.post(
                base + "/v1/chat/completions", json=chat_body(f"after the circuit opened {i}", 2), timeout=30
            )
            assert r.status_code == 200 and time.monotonic() - t1 < 10  # no waiting on the hung worker
        assert (
            metric(cluster, "kimik3_router_worker_requests_total", worker=other, role="prefill", outcome="ok")
            == ok_other + 3
        )
        assert metric(cluster, "kimik3_router_worker_requests_total", worker=hung, outcome="ok") == ok_hung
        assert workers(cluster)[hung]["circuit"] in ("open", "half_open")
    finally:
        os.killpg(cluster.procs["prefill0"].pid, signal.SIGCONT)
    wait_for(lambda: workers(cluster)[hung]["circuit"] == "closed", 40, "the circuit to close after recovery")


def check_draining_a_worker_finishes_its_requests_and_sends_new_ones_elsewhere(cluster, params):
    base = cluster.url("router")
    text = "drain me gently"
    want = oracle(params, chat_prompt(text), 30)
    out = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=chat_body(text, 30, stream=True), timeout=60) as r:
        for ev in sse_events(r):
            assert "error" not in ev, ev
            out += [t for c in ev["choices"] for t in c.get("token_ids", [])]
            if len(out) == 2:
                busy = [
                    n
                    for n in ("decode0", "decode1")
                    if httpx.get(cluster.url(n) + "/load", timeout=5).json()["inflight"] > 0
                ]
                drained = cluster.url(busy[0])
                assert httpx.post(base + "/admin/drain", json={"url": drained}, timeout=10, headers=AUTH).json()[
                    "draining"
                ]
                before = httpx.get(drained + "/load", timeout=5).json()["submitted"]
    assert out == want  # the drained worker finished what it had
    try:
        for i in range(2):
            assert (
                httpx.post(
                    base + "/v1/chat/completions", json=chat_body(f"while draining {i}", 3), timeout=30
                ).status_code
                == 200
            )
        assert httpx.get(drained + "/load", timeout=5).json()["submitted"] == before
        assert httpx.get(drained + "/health", timeout=5).json()["status"] == "draining"
    finally:
        httpx.post(base + "/admin/resume", json={"url": drained}, timeout=10, headers=AUTH)
    wait_for(lambda: workers(cluster)[drained]["draining"] is False, 10, "the worker to resume")


def check_a_request_waits_out_a_pool_with_no_worker_instead_of_failing(cluster, params):
    """With every decode worker drained (as during a restart of the only one), a
    request waits (`--no-worker-wait-s`) instead of failing after a few backoffs (~0.35 s),
    and completes with the oracle's tokens once a worker is back."""
    import threading

    base = cluster.url("router")
    decoders = [cluster.url(n) for n in ("decode0", "decode1")]
    for url in decoders:
        assert httpx.post(base + "/admin/drain", json={"url": url}, timeout=10, headers=AUTH).json()["draining"]
    result = {}
    text = "wait for a worker"
    thread = threading.Thread(
        target=lambda: result.update(r=httpx.post(base + "/v1/chat/completions", json=chat_body(text, 3), timeout=60))
    )
    try:
        thread.start()
        time.sleep(2.0)  # longer than every retry's backoff together
        assert thread.is_alive() and "r" not in result  # still waiting, not a 503
    finally:
        for url in decoders:
            httpx.post(base + "/admin/resume", json={"url": url}, timeout=10, headers=AUTH)
        thread.join(60)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"][0]["token_ids"] == oracle(params, chat_prompt(text), 3)
    for url in decoders:
        wait_for(lambda: workers(cluster)[url]["draining"] is False, 10, "the worker to resume")


def check_bursty_load_from_a_second_process_is_shed_or_queued_and_nothing_is_lost(cluster):
    base = cluster.url("router")
    n_bursts, burst = 2, 12  # router: 4 running + 4 queued; workers: 2 x 2 decode slots
    workers = ("prefill0", "prefill1", "decode0", "decode1")
    # peak RSS so far (compiles and earlier checks set it; 3.2-3.4 GB on the 2-core CI machine)
    rss_before = {n: httpx.get(cluster.url(n) + "/health", timeout=10).json()["load"]["max_rss_bytes"] for n in workers}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "loadgen.py"),
            "--url",
            base,
            "--bursts",
            str(n_bursts),
            "--burst-size",
            str(burst),
            "--gap-s",
            "1.0",
            "--max-tokens",
            "6",
            "--timeout-s",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    rows = report["rows"]
    assert report["sent"] == len(rows) == n_bursts * burst  # every request got an answer
    statuses = [r["status"] for r in rows]
    assert set(statuses) <= {200, 429}, rows
    assert statuses.count(200) >= 8 and statuses.count(429) >= 1  # served up to the bound, shed beyond it
    for r in rows:
        if r["status"] == 200:
            assert r["tokens"] == 6 and r["error"] is None, r
        else:
            assert r["error"] == "rate_limit_exceeded" and r["latency_s"] < 4 + 5, r  # queued at most ~4 s
    for n in workers:
        h = httpx.get(cluster.url(n) + "/health", timeout=10)
        assert h.status_code == 200
        load = h.json()["load"]
        assert load["inflight"] == 0 and load["running"] == 0 and load["errors"] == 0
        assert load["max_rss_bytes"] - rss_before[n] < 256 << 20, (n, rss_before[n], load)  # the burst: bounded
    assert metric(cluster, "kimik3_router_rejected_total", reason="overloaded") >= 1
    admission = httpx.get(base + "/admin/workers", timeout=10, headers=AUTH).json()["admission"]
    assert admission == {"running": 0, "waiting": 0}


def test_router_and_workers_as_real_processes(cluster, params):
    for check in (
        check_greedy_output_through_router_and_workers_equals_the_oracle,
        check_stop_sequences_and_stop_tokens_end_the_text_where_the_oracle_says,
        check_logprobs_and_penalties_reach_the_workers_and_come_back_in_openais_shapes,
        check_direct_handoff_through_a_second_router_equals_the_oracle,
        check_a_tenant_never_sees_another_tenants_prefix_in_cached_tokens,
        check_workers_and_admin_routes_refuse_callers_without_the_internal_token,
        check_bad_input_is_a_4xx_in_openai_shape_and_never_reaches_a_worker,
        check_a_client_that_leaves_cancels_its_worker_request,
        check_a_decode_worker_killed_mid_stream_fails_over_without_duplicates_and_its_restart_finds_the_kv,
        check_a_hanging_prefill_worker_opens_its_circuit_and_traffic_moves,
        check_draining_a_worker_finishes_its_requests_and_sends_new_ones_elsewhere,
        check_a_request_waits_out_a_pool_with_no_worker_instead_of_failing,
        check_bursty_load_from_a_second_process_is_shed_or_queued_and_nothing_is_lost,
    ):
        t0 = time.monotonic()
        args = (cluster, params) if "params" in check.__code__.co_varnames[: check.__code__.co_argcount] else (cluster,)
        check(*args)
        print(f"{check.__name__}: {time.monotonic() - t0:.1f} s")


def test_the_openai_routes_need_the_api_key_when_one_is_set(monkeypatch):
    """`--api-key` (or $KIMIK3_API_KEY): /v1/* answers 401 in OpenAI's shape without the
    bearer key, before reading the body; /health and /metrics stay open, as vLLM's."""
    import argparse

    from fastapi.testclient import TestClient

    from serving.router import Router, add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("KIMIK3_API_KEY", "s3cret")
    # a decode URL where nothing listens: the key is checked before any worker is asked
    cfg = config_from_args(parser.parse_args(["--port", "1", "--l1-bytes", "0", "--decode", "http://127.0.0.1:9"]))
    assert cfg.api_key == "s3cret" and "s3cret" not in repr(cfg)
    with TestClient(Router(cfg).create_app()) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = c.post("/v1/chat/completions", json=chat_body("hi", 3), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert c.get("/v1/models", headers=headers).status_code == 401
        assert c.get("/v1/models", headers={"authorization": "Bearer s3cret"}).json()["data"][0]["id"] == "kimik3-tiny"
        assert c.get("/v1/models", headers={"authorization": "bearer s3cret"}).status_code == 200  # RFC 6750
        assert c.get("/health").status_code in (200, 503) and c.get("/metrics").status_code == 200
        assert 'kimik3_router_rejected_total{reason="unauthorized"} 6.0' in c.get("/metrics").text
