"""A request's failure is that request's: bad input is a 400 naming the field, a request whose own
work raises inside the engine fails alone (not retriable), and a worker whose engine faulted is
restarted by `kimik3 launch` and serves again.

The in-process tests drive an `Engine` and a worker app directly; the rest share one real
deployment (`launch --prefill 0 --decode 1 --no-store --redis`) whose workers load a
`sitecustomize` from this test's directory: with $KIMIK3_TEST_FAULT_FILE set, the next engine step
after that file appears raises (the file is consumed), as a device fault would.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from kimik3.generate import generate
from serving import executor as executor_mod
from serving.launch import child_env, free_port, wait_healthy
from tests.serving.test_engine import PAGE, _engine

BIG = "1" * 5000  # past Python's 4,300-digit int() limit
BAD = {"2^31": str(2**31), "2^63": str(2**63), "-1": "-1", "NaN": "NaN", "5000 digits": BIG}
# values that are in range for the field (top_k -1: off; penalties lie in [-2, 2]; seeds below 2^63)
VALID = {("top_k", "-1"), ("presence_penalty", "-1"), ("frequency_penalty", "-1"), ("seed", "2^31")}


def _cases(fields):
    return [(f, v) for f in fields for v in BAD if (f, v) not in VALID]


ROUTER_FIELDS = [
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "top_logprobs",
    "repetition_penalty",
    "stop_token_ids",
    "logit_bias",
]
WORKER_FIELDS = [
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "prior_output",
]
LISTS = {"stop_token_ids", "prompt"}  # the value goes in as the list's item
DICTS = {"logit_bias"}  # the value goes in as an entry's value


def _literal(field, value):
    if field in LISTS:
        return f"[{value}]" if field != "prompt" else f"[1, 2, {value}]"
    if field in DICTS:
        return '{"5": %s}' % value
    return value


# ---- in process ---------------------------------------------------------------------------------
def test_the_top_k_of_death_is_refused_where_it_enters():
    from pydantic import ValidationError

    from serving.openai_api import ChatCompletionRequest, validation_error
    from serving.sampling import SamplingParams

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 1000000000000}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    assert validation_error(e.value).param == "top_k" and validation_error(e.value).status == 400
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=1.0, top_k=10**12)
    for bad in (dict(temperature=float("nan")), dict(top_p=float("inf")), dict(min_p=float("nan")), dict(seed=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_a_request_whose_own_work_raises_fails_alone(rng, tiny_cfg, tiny_params, monkeypatch):
    """Two poisoned requests -- one whose first token's host-side choice raises, one whose decode
    row cannot be built -- fail alone, marked as their own failures, and free what they held;
    the request beside them in the same steps gets the oracle's tokens."""
    from serving.sampling import SamplingParams

    eng = _engine(tiny_params, tiny_cfg)
    free_pages = sum(m.page_pool.num_free for m in eng.managers)
    prompts = [rng.integers(0, 256, n).tolist() for n in (37, 21, 50)]
    choose, build = executor_mod.choose_token, executor_mod.DecodeRows.build
    poisoned = {"choose": SamplingParams(seed=666), "row": SamplingParams(seed=777)}
    healthy = eng.submit(prompts[0], 6)
    by_choice = eng.submit(prompts[1], 6, sampling=poisoned["choose"])
    by_row = eng.submit(prompts[2], 6, sampling=poisoned["row"])

    def choose_or_die(logits, params, *a, **kw):
        if params is poisoned["choose"]:
            raise OverflowError("Python int too large to convert to C int")
        return choose(logits, params, *a, **kw)

    def build_or_die(*a, **kw):
        if any(s is poisoned["row"] for s in a[5]):
            raise OverflowError("Python int too large to convert to C int")
        return build(*a, **kw)

    monkeypatch.setattr(executor_mod, "choose_token", choose_or_die)
    monkeypatch.setattr(executor_mod.DecodeRows, "build", staticmethod(build_or_die))
    eng.run(max_steps=200)
    assert healthy.error is None and healthy.output == generate(tiny_params, tiny_cfg, prompts[0], 6).tokens.tolist()
    assert by_choice.done and by_choice.fault == "invalid" and "OverflowError" in by_choice.error
    assert by_choice.output == []
    assert by_row.done and by_row.fault == "invalid" and len(by_row.output) == 1  # its first token, then its row
    # nothing leaked: every slot and every page not cached is back
    assert len(eng.scheduler.free_slots) == 4 and not eng.running and not eng.waiting
    assert sum(m.page_pool.num_free for m in eng.managers) == free_pages
    for m in eng.managers:
        m.page_pool.check_invariants()
    # and the engine serves on
    monkeypatch.undo()
    again = eng.submit(prompts[1], 3)
    eng.run(max_steps=100)
    assert again.output == generate(tiny_params, tiny_cfg, prompts[1], 3).tokens.tolist()


def test_the_worker_reports_a_request_failure_as_not_retriable(tiny_cfg, tiny_params, monkeypatch):
    """Through a worker: the poisoned request's stream ends with a non-retriable error; the worker
    stays healthy and serves the next request."""
    from fastapi.testclient import TestClient

    from serving.worker import EngineLoop, create_app

    eng = _engine(tiny_params, tiny_cfg, num_pages=24, num_slots=2, num_snapshots=8, prefill_chunk_tokens=32)
    faults = []
    loop = EngineLoop(eng, worker_id="w0", on_fault=lambda: faults.append(1))
    info = {"role": "both", "worker_id": "w0", "max_context": 256, "page_tokens": PAGE, "namespace": "t"}
    choose = executor_mod.choose_token

    def choose_or_die(logits, params, *a, **kw):
        if params.seed == 666:
            raise RuntimeError("a bug in one request's sampling")
        return choose(logits, params, *a, **kw)

    monkeypatch.setattr(executor_mod, "choose_token", choose_or_die)
    with TestClient(create_app(loop, info, keepalive_s=0.2)) as c:
        lines = lambda r: [json.loads(x) for x in r.iter_lines() if x]  # noqa: E731
        with c.stream("POST", "/generate", json={"prompt": [1, 2, 3], "max_tokens": 3, "seed": 666}) as r:
            events = lines(r)
        assert events[0]["accepted"] and events[-1] == {
            "error": events[-1]["error"],
            "status": 500,
            "retriable": False,
            "code": "request_failed",
        }
        assert "RuntimeError" in events[-1]["error"]
        with c.stream("POST", "/generate", json={"prompt": [1, 2, 3], "max_tokens": 3}) as r:
            events = lines(r)
        want = generate(tiny_params, tiny_cfg, [1, 2, 3], 3).tokens.tolist()
        assert [e["token"] for e in events if "token" in e] == want
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok" and not faults
        # the same values through /adopt's query parameters are 400s naming the field too
        r = c.post("/adopt", params={"max_tokens": 4, "top_k": 10**12}, content=b"")
        assert r.status_code == 400 and "top_k" in r.json()["error"] and r.json()["param"] == "top_k"
        r = c.post("/adopt", params={"max_tokens": 4, "temperature": "nan"}, content=b"")
        assert r.status_code == 400 and r.json()["param"] == "temperature"


def test_restarts_back_off_and_keys_reach_the_router_alone(tmp_path, monkeypatch):
    import argparse

    from serving import launch

    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    monkeypatch.delenv("KIMIK3_API_KEY", raising=False)
    monkeypatch.delenv("KIMIK3_API_KEY_FILE", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("sk-one acme\nsk-two\n")
    keys.chmod(0o600)
    args = parser.parse_args(["--log-dir", str(tmp_path), "--api-key-file", str(keys), "--gpus", "none"])
    d = launch.Deployment(args)
    assert d._router_env() == {"KIMIK3_API_KEY_FILE": str(keys)}
    launch.check_api_keys(args)
    keys.write_text("a b c\n")
    with pytest.raises(ValueError, match="KEY"):
        launch.check_api_keys(args)
    with pytest.raises(ValueError, match="no-such"):
        launch.check_api_keys(parser.parse_args(["--api-key-file", str(tmp_path / "no-such")]))
    # every child shares the store secret; none but the router gets the clients' keys
    monkeypatch.setenv("KIMIK3_API_KEY", "sk-env")
    env = child_env()
    assert len(bytes.fromhex(env["KIMIK3_STORE_SECRET"])) == 32 and "KIMIK3_API_KEY" not in env
    assert launch.Deployment(parser.parse_args(["--gpus", "none"]))._router_env() == {"KIMIK3_API_KEY": "sk-env"}
    # the first restart is at once, the next ones back off (doubling from --restart-backoff-s)
    clock = [100.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    d.args.restart_backoff_s = 2.0
    assert d._restart_due("decode-0", 0)
    assert not d._restart_due("decode-0", 1)
    clock[0] += 1.9
    assert not d._restart_due("decode-0", 1)
    clock[0] += 0.2
    assert d._restart_due("decode-0", 1)
    assert not d._restart_due("decode-0", 3) and d._restart_at["decode-0"] == clock[0] + 8.0
    d._restart_at.clear()
    assert not d._restart_due("decode-0", 10) and d._restart_at["decode-0"] == clock[0] + 30.0


def test_a_redirect_to_a_data_url_is_a_clean_refusal():
    from cache.media.fetch import FetchError, fetch

    from ..cache.test_media_fetch import LOCAL, ImageServer

    server = ImageServer()
    try:
        for location in ("data:image/png;base64,iVBORw0KGgo=", "data:,x", "javascript:alert(1)"):
            server.routes["/r"] = (302, {"Location": location}, b"")
            with pytest.raises(FetchError, match="refused"):
                fetch(server.url("/r"), LOCAL)
    finally:
        server.close()


# ---- a real deployment --------------------------------------------------------------------------
SITECUSTOMIZE = textwrap.dedent(
    '''
    """Test fault injection: with $KIMIK3_TEST_FAULT_FILE, the engine step after that file appears
    raises (and consumes the file), as a device fault would."""
    import importlib.abc
    import importlib.util
    import os
    import sys

    FLAG = os.environ.get("KIMIK3_TEST_FAULT_FILE")


    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "serving.engine":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                step = module.Engine.step

                def faulty_step(self):
                    if os.path.exists(FLAG):
                        os.remove(FLAG)
                        raise RuntimeError("injected device fault")
                    return step(self)

                module.Engine.step = faulty_step

            spec.loader.exec_module = exec_module
            return spec


    if FLAG:
        sys.meta_path.insert(0, _Hook())
    '''
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rod")
    (tmp / "inject").mkdir()
    (tmp / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    port, state_file, flag = free_port(), tmp / "state.json", tmp / "fault"
    worker_args = (
        f"--dtype float32 --page-tokens {PAGE} --kda-block-tokens {4 * PAGE} --prefill-chunk-tokens 16 "
        f"--num-pages 16 --num-slots 2 --kernels reference --no-warmup"
    )
    redis = ["--redis"] if shutil.which("redis-server") else []
    env = dict(child_env(), JAX_PLATFORMS="cpu", KIMIK3_TEST_FAULT_FILE=str(flag))
    env["PYTHONPATH"] = str(tmp / "inject") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.launch", "--config", "tiny", "--port", str(port), "--prefill", "0"]
        + ["--decode", "1", "--no-store", "--gpus", "none", "--state-file", str(state_file), *redis]
        + ["--log-dir", str(tmp / "logs"), "--worker-args", worker_args, "--max-restarts", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not state_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "launch did not come up"
            time.sleep(0.25)
        from serving import internal_auth

        yield {
            "proc": proc,
            "state_file": state_file,
            "flag": flag,
            "base": f"http://127.0.0.1:{port}",
            "auth": internal_auth.headers(env[internal_auth.ENV]),
        }
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _names(r, field) -> bool:
    """Whether a router's 400 names `field` (OpenAI's shape: in its message or as its param)."""
    err = r.json()["error"]
    return r.status_code == 400 and (field in err["message"] or (err["param"] or "").startswith(field))


def _state(d) -> dict:
    return json.loads(d["state_file"].read_text())


def _oracle(prompt, n):
    """The workers' answer: tiny's weights from seed 0 (`serving.worker.build_engine`)."""
    import jax

    from kimik3 import config, model

    return generate(model.init_params(config.tiny(), jax.random.PRNGKey(0), "float32"), config.tiny(), prompt, n)


def test_every_numeric_field_out_of_range_is_a_400_naming_it(deployment):
    """Through the router's /v1/chat/completions (and /v1/completions' prompt) and through a
    worker's own /generate: 2^31, 2^63, -1, NaN and a 5,000-digit literal in every numeric field."""
    base, worker = deployment["base"], _state(deployment)["decode"][0]
    chat = '{"model": "kimik3-tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "%s": %s}'
    with httpx.Client(timeout=30) as c:

        def post(url, raw, **headers):
            return c.post(url, content=raw, headers={"content-type": "application/json", **headers})

        for field, value in _cases(ROUTER_FIELDS):
            r = post(base + "/v1/chat/completions", chat % (field, _literal(field, BAD[value])))
            assert _names(r, field), (field, value, r.text[:300])
        for field, value in _cases(["prompt", "max_tokens", "logprobs", "best_of"]):
            raw = '{"model": "kimik3-tiny", "prompt": [1, 2], "%s": %s}' % (field, _literal(field, BAD[value]))
            if field == "prompt":
                raw = '{"model": "kimik3-tiny", "prompt": %s}' % _literal(field, BAD[value])
            r = post(base + "/v1/completions", raw)
            assert _names(r, field), (field, value, r.text[:300])
        # the request of death itself (at the worker, top_k's 2^31 and 2^63 below)
        r = c.post(
            base + "/v1/chat/completions",
            json={"model": "kimik3-tiny", "messages": [{"role": "user", "content": "hi"}], "top_k": 1000000000000},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
        submitted = c.get(worker + "/load").json()["submitted"]
        for field, value in _cases(WORKER_FIELDS):
            raw = '{"prompt": [1, 2, 3], "max_tokens": 2, "%s": %s}' % (field, _literal(field, BAD[value]))
            if field in ("prompt", "max_tokens"):
                raw = '{"prompt": %s, "max_tokens": %s}' % (
                    _literal(field, BAD[value]) if field == "prompt" else "[1, 2, 3]",
                    BAD[value] if field == "max_tokens" else "2",
                )
            r = post(worker + "/generate", raw, **deployment["auth"])
            assert r.status_code == 400 and field in r.json()["error"], (field, value, r.text[:300])
            assert r.json().get("retriable") is False
        assert c.get(worker + "/health").json()["status"] == "ok"
        assert c.get(worker + "/load").json()["submitted"] == submitted  # none of them reached the engine


def test_a_failed_worker_is_restarted_and_serves_again(deployment):
    """An engine fault fails the worker's request (retriable), the worker exits, `launch` restarts
    it, and it serves the oracle's tokens again; a Redis L1 that exits is restarted too."""
    state = _state(deployment)
    worker, old = state["decode"][0], state["pids"]["decode-0"]
    deployment["flag"].write_text("")
    with (
        httpx.Client(timeout=120) as c,
        c.stream(
            "POST", worker + "/generate", headers=deployment["auth"], json={"prompt": [5, 6, 7], "max_tokens": 4}
        ) as r,
    ):
        events = [json.loads(x) for x in r.iter_lines() if x]
    assert events[-1]["code"] == "engine_fault" and events[-1]["retriable"] is True, events
    deadline = time.monotonic() + 120
    while _state(deployment)["pids"]["decode-0"] == old:
        assert deployment["proc"].poll() is None, deployment["proc"].stdout.read()
        assert time.monotonic() < deadline, "launch did not restart the failed worker"
        time.sleep(0.25)
    wait_healthy(worker, None, 120)
    prompt = [1, 9, 9, 4, 20, 30]
    r = httpx.post(
        deployment["base"] + "/v1/completions",
        timeout=120,
        json={"model": "kimik3-tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _oracle(prompt, 3).tokens.tolist()
    if "redis" in state["pids"]:
        old_redis = state["pids"]["redis"]
        os.kill(old_redis, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _state(deployment)["pids"]["redis"] == old_redis:
            assert time.monotonic() < deadline, "launch did not restart redis"
            time.sleep(0.25)
        # the router's health follows its shared L1: ok again once redis is back
        while httpx.get(deployment["base"] + "/health", timeout=10).json().get("l1") != "ok":
            assert time.monotonic() < deadline, "the router's health did not see redis back"
            time.sleep(0.25)


def test_concurrent_requests_of_other_tenants_are_unaffected_by_a_bad_one(deployment):
    """A bad request and good ones at once through the router: the bad one is a 400, the good
    ones get the oracle's tokens."""
    base = deployment["base"]
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11]]
    got = {}

    def good(i):
        r = httpx.post(
            base + "/v1/completions",
            timeout=120,
            json={"model": "kimik3-tiny", "prompt": prompts[i], "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        )
        got[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=good, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    bad = httpx.post(
        base + "/v1/completions",
        timeout=60,
        content='{"model": "kimik3-tiny", "prompt": [1, 2], "top_k": %s}' % BIG,
        headers={"content-type": "application/json"},
    )
    for t in threads:
        t.join(120)
    assert _names(bad, "top_k"), bad.text
    for i, p in enumerate(prompts):
        assert got[i][0] == 200, got[i]
        assert got[i][1]["choices"][0]["token_ids"] == _oracle(p, 3).tokens.tolist()


def test_requests_refused_for_their_images_never_hold_a_place_in_the_queue(tiny_cfg, tiny_params):
    """More bad-image requests than the queue holds, each a 400 naming its images; the queue is as
    empty after them as before, so the next request is served (not a 429)."""
    from fastapi.testclient import TestClient

    from serving.worker import EngineLoop, create_app

    eng = _engine(tiny_params, tiny_cfg, num_pages=24, num_slots=2, num_snapshots=8, prefill_chunk_tokens=32)
    loop = EngineLoop(eng, worker_id="w0", max_waiting=2)
    info = {"role": "both", "worker_id": "w0", "max_context": 256, "page_tokens": PAGE, "namespace": "t"}
    with TestClient(create_app(loop, info, keepalive_s=0.2)) as c:
        for bad in (["not base64!"], ["AAAA"]) * 3:  # undecodable, then the wrong size
            r = c.post("/generate", json={"prompt": [1, 2, 3], "max_tokens": 2, "images": bad})
            assert r.status_code == 400 and "image" in r.json()["error"], r.text
        assert c.get("/load").json()["inflight"] == 0
        with c.stream("POST", "/generate", json={"prompt": [1, 2, 3], "max_tokens": 2}) as r:
            assert r.status_code == 200
            events = [json.loads(x) for x in r.iter_lines() if x]
        assert [e["token"] for e in events if "token" in e] == generate(
            tiny_params, tiny_cfg, [1, 2, 3], 2
        ).tokens.tolist()
