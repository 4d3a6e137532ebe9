"""`kimik3 serve MODEL` with vLLM's flags: one real deployment of tiny on loopback (a router and
one colocated worker) for the whole module, served to OpenAI's client (the `openai` package where
it is installed, else the same calls over httpx); the public /metrics carries the worker's KV use
and prefix cache; no request compiles after the warm-up; the worker logs vLLM's stats line; and
the flags are the ones the engine's dataclass defines."""

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from serving import flags
from serving.engine_config import EngineConfig
from serving.launch import child_env, free_port, wait_healthy

from .test_router import CACHE_DIR

KEY = "sk-serve-test-key"
MODEL = "kimik3-tiny"
# a system prompt of several pages: a second conversation under it is a prefix hit
SYSTEM = "You are a careful assistant who answers in short sentences. " * 6


@dataclasses.dataclass
class Served:
    base: str
    proc: subprocess.Popen
    out_path: str
    state: dict

    def output(self) -> str:
        with open(self.out_path) as f:
            return f.read()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`kimik3 serve tiny --port P --max-model-len 1024 --max-num-seqs 8` (tiny has 1024 positions),
    its key in a file, its logs (the children's too: no --log-dir) on its stdout, here a file."""
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "key").write_text(KEY + "\n")
    port, state_file, out_path = free_port(), tmp / "state.json", str(tmp / "out.txt")
    env = {k: v for k, v in child_env().items() if k not in ("KIMIK3_API_KEY", "KIMIK3_API_KEY_FILE")}
    argv = [sys.executable, "-m", "serving.cli", "serve", "tiny", "--port", str(port), "--max-model-len", "1024"]
    argv += ["--max-num-seqs", "8", "--api-key", f"@{tmp / 'key'}", "--gpus", "none", "--log-stats-interval-s", "1"]
    argv += ["--worker-args", f"--compile-cache {CACHE_DIR}"]  # kept between runs, as the router tests' cluster
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [*argv, "--state-file", str(state_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env, JAX_PLATFORMS="cpu"),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 400
        while not state_file.exists():
            assert proc.poll() is None, open(out_path).read()
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.25)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, None, 60)
        yield Served(base, proc, out_path, json.loads(state_file.read_text()))
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        assert proc.returncode == 0, open(out_path).read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def samples(text: str, name: str) -> dict[tuple, float]:
    """{sorted label pairs: value} of the samples called `name` in a Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def worker_value(text: str, name: str, worker: str) -> float:
    got = [v for labels, v in samples(text, name).items() if dict(labels).get("worker") == worker]
    assert len(got) == 1, (name, samples(text, name))
    return got[0]


def chat(client, served, content: str, **kw):
    """One chat completion through the `openai` client, or over httpx in its shapes."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    if client is not None:
        return client.chat.completions.create(model=MODEL, messages=messages, **kw).model_dump()
    r = httpx.post(
        served.base + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "messages": messages, **kw},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def openai_client(served):
    try:
        import openai
    except ImportError:
        return None
    return openai.OpenAI(base_url=served.base + "/v1", api_key=KEY, max_retries=0)


def test_kimik3_serve_answers_openais_client(served):
    """The deployment `kimik3 serve` starts: a router on the port and one colocated worker, none
    of it reachable without the key; models, chat (greedy, sampled, streamed, with logprobs and
    penalties) and completions in OpenAI's shapes."""
    client = openai_client(served)
    assert served.state["router"] == served.base + "/v1" and served.state["prefill"] == []
    assert set(served.state["pids"]) == {"router", "decode-0"}
    assert httpx.get(served.state["decode"][0] + "/health", timeout=10).json()["role"] == "both"
    assert httpx.get(served.base + "/v1/models", timeout=10).status_code == 401  # the key is required
    if client is not None:
        import openai

        assert [m.id for m in client.models.list()] == [MODEL]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=served.base + "/v1", api_key="wrong", max_retries=0).models.list()
    else:
        models = httpx.get(served.base + "/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 1024
    greedy = chat(client, served, "Hello!", max_tokens=8, temperature=0)
    assert greedy["choices"][0]["finish_reason"] in ("stop", "length")
    assert greedy["usage"]["completion_tokens"] <= 8 and greedy["choices"][0]["message"]["role"] == "assistant"
    assert chat(client, served, "Hello!", max_tokens=8, temperature=0)["choices"] == greedy["choices"]
    rich = chat(
        client, served, "Hi", max_tokens=6, temperature=0.8, seed=3, presence_penalty=0.5, logprobs=True, top_logprobs=2
    )
    content = rich["choices"][0]["logprobs"]["content"]
    assert len(content) == rich["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2 for t in content)
    if client is not None:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Stream"}], max_tokens=5, stream=True, temperature=0
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
        assert done.choices[0].finish_reason in ("stop", "length") and done.usage.prompt_tokens > 0
    else:
        with httpx.stream(
            "POST",
            served.base + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Stream"}], "max_tokens": 5, "stream": True},
            timeout=120,
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        pieces = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
        r = httpx.post(
            served.base + "/v1/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0
    assert pieces and isinstance("".join(pieces), str)


def test_the_public_metrics_carry_the_workers_kv_use_and_prefix_cache(served):
    """/metrics on the router's port (open, as vLLM's, while /v1 needs the key) holds the worker's
    engine series labelled by worker: KV use rises while a request runs, and a conversation under
    a system prompt already seen moves the prefix cache's hits."""
    worker = served.state["decode"][0]
    text = httpx.get(served.base + "/metrics", timeout=10).text  # no key
    assert worker_value(text, "kimik3_router_worker_metrics_up", worker) == 1
    queries0 = worker_value(text, "vllm:prefix_cache_queries_total", worker)
    hits0 = worker_value(text, "vllm:prefix_cache_hits_total", worker)
    # the router's own copies (which never moved) are gone: every engine series names its worker
    assert all(dict(labels).get("worker") for labels in samples(text, "vllm:kv_cache_usage_perc"))
    chat(None, served, "First question", max_tokens=4, temperature=0)
    usage = chat(None, served, "Second question", max_tokens=4, temperature=0)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    text = httpx.get(served.base + "/metrics", timeout=10).text
    assert worker_value(text, "vllm:prefix_cache_queries_total", worker) >= queries0 + usage["prompt_tokens"]
    assert (
        worker_value(text, "vllm:prefix_cache_hits_total", worker) - hits0
        >= usage["prompt_tokens_details"]["cached_tokens"]
    )
    # KV use while a long request streams
    body = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", served.base + "/v1/completions", headers={"authorization": f"Bearer {KEY}"}, json=body, timeout=120
    ) as r:
        lines = r.iter_lines()
        while "data: {" not in next(lines):
            pass
        kv = worker_value(httpx.get(served.base + "/metrics", timeout=10).text, "vllm:kv_cache_usage_perc", worker)
    assert 0 < kv <= 1


def test_no_request_compiles_after_the_warm_up(served):
    """Greedy, sampled, penalized and logprobs requests find every program built at start-up (the
    worker counts what it builds while serving: kimik3_worker_compiles, on the public /metrics)."""
    for kw in (
        dict(temperature=0),
        dict(temperature=1.0, top_p=0.9, top_k=20, seed=1),
        dict(temperature=0, presence_penalty=0.4, frequency_penalty=0.2),
        dict(temperature=0.7, frequency_penalty=0.3, logprobs=True, top_logprobs=3),
        dict(temperature=0, logprobs=True),
    ):
        chat(None, served, "Which variant?", max_tokens=5, **kw)
    text = httpx.get(served.base + "/metrics", timeout=10).text
    assert worker_value(text, "kimik3_worker_compiles", served.state["decode"][0]) == 0


def test_the_worker_logs_vllms_stats_line(served):
    chat(None, served, "Stats please", max_tokens=4, temperature=0)
    pattern = re.compile(
        r"decode-0: Avg prompt throughput: [0-9.]+ tokens/s, Avg generation throughput: [0-9.]+ tokens/s, "
        r"Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [0-9.]+%, Prefix cache hit rate: [0-9.]+%"
    )
    deadline = time.monotonic() + 10
    while not any(float(m) > 0 for m in re.findall(r"Avg prompt throughput: ([0-9.]+)", served.output())):
        assert time.monotonic() < deadline, served.output()[-2000:]
        time.sleep(0.25)
    assert pattern.search(served.output())


def test_what_the_machine_cannot_honour_is_one_line_naming_the_flag(capsys, monkeypatch):
    """Before anything starts: more devices than the machine has, a context past the model's,
    a key written on the command line, speculative options the engine does not have."""
    from serving import cli

    monkeypatch.delenv("KIMIK3_API_KEY", raising=False)
    cases = [
        (["--data-parallel-size", "2"], "--data-parallel-size 2: a worker would span 2 devices"),
        (["--tensor-parallel-size", "4"], "--tensor-parallel-size 4: a worker would span 4 devices"),
        (["--max-model-len", "2048"], "--max-model-len 2048 is past tiny's 1024 positions"),
        (["--max-num-seqs", "3", "--gpus", "0,1", "--data-parallel-size", "2"], "does not split"),
        (["--api-key", "sk-in-argv"], "--api-key takes @FILE"),
        (["--speculative-config", '{"method": "ngram"}'], "method 'ngram' is not supported"),
        (["--speculative-config", '{"model": "d", "draft_tensor_parallel_size": 2}'], "'draft_tensor_parallel_size'"),
        (["--speculative-config", '{"model": "d"}'], "needs its trained target"),
    ]
    for argv, message in cases:
        gpus = [] if "--gpus" in argv else ["--gpus", "none"]
        assert cli.main(["serve", "tiny", *gpus, *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert cli.main(["serve", "no-such-model"]) == 2
    assert "neither a directory" in capsys.readouterr().err


def test_every_engine_config_field_is_a_generated_flag_of_worker_launch_and_serve():
    """One flag per EngineConfig field, spelled, typed and documented from the dataclass, on the
    worker (with the worker's defaults), launch and serve (unset unless given: passed on as given);
    vLLM's aliases read the same fields."""
    from serving import launch, serve, worker

    parsers = {}
    for name, module in (("worker", worker), ("launch", launch), ("serve", serve)):
        parsers[name] = argparse.ArgumentParser()
        module.add_arguments(parsers[name])
    for f in dataclasses.fields(EngineConfig):
        for name, parser in parsers.items():
            if name != "worker" and f.name == "role":  # launch and serve choose each worker's role
                continue
            action = next((a for a in parser._actions if a.dest == f.name), None)
            assert action is not None and flags.flag_name(f.name) in action.option_strings, (name, f.name)
            assert f.metadata["help"] in action.help, (name, f.name)
            if name == "worker":
                default = flags.WORKER_DEFAULTS.get(f.name, (f.default,))[0]
                assert action.default == default, f.name
            else:
                assert action.default is None, (name, f.name)
    w = parsers["worker"].parse_args(
        [
            "--port",
            "1",
            "--max-num-seqs",
            "4",
            "--block-size",
            "16",
            "--no-enable-prefix-caching",
            "--scan-layers",
            "all",
        ]
    )
    assert (w.num_slots, w.page_tokens, w.prefix_caching, w.scan_layers, w.prefill_chunk_tokens) == (
        4,
        16,
        False,
        "all",
        64,
    )
    with pytest.raises(SystemExit):
        parsers["worker"].parse_args(["--port", "1", "--kernels", "fastest"])


def test_engine_config_choices_are_the_modules_own():
    """The choices engine_config spells out (so that --help imports no JAX) are what the
    modules that use them accept."""
    from kimik3 import ops
    from serving import engine_config, model_runner, spec_decode
    from sharding import layers

    assert engine_config.KERNEL_CHOICES == ops.KERNEL_CHOICES
    assert engine_config.SCAN_CHOICES == model_runner.SCAN_CHOICES
    assert engine_config.DISPATCH_CHOICES == layers.DISPATCH_CHOICES
    assert engine_config.TAIL_CHOICES == spec_decode.TAIL_MODES
    probe = "import sys; from serving import launch, serve; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_speculative_config_maps_to_the_eagle3_flags():
    assert flags.speculative_argv('{"method": "eagle3", "model": "/d", "num_speculative_tokens": 2}') == [
        "--speculative",
        "eagle3",
        "--draft-checkpoint",
        "/d",
        "--draft-tokens",
        "2",
    ]
    for text, message in (
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle3"}', 'needs "model"'),
        ('{"model": "/d", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"model": "/d", "prompt_lookup_max": 3, "acceptance_rate": 1}', "'acceptance_rate', 'prompt_lookup_max'"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            flags.speculative_argv(text)
