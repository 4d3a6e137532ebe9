"""The router's security properties, against a real tiny worker and a real router process.

One worker (colocated, `--role both`, tiny config on the CPU) and one router that reads three API
keys from a key file (two of tenant "acme", one a tenant of its own) serve the checks that run in
order inside `test_router_security_against_a_real_worker_and_router`: tenants from
authentication, the operator's routes, over-long integer literals, a real worker's refusal not
retried, /health under a flood of 31 MB bodies, and an outside fuzzer (schemathesis) over the
router's and the worker's OpenAPI schemas.  The key file's format, the body's value counter and
the retry rule against stub workers (which only count attempts) are tests of their own.
"""

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from serving import internal_auth
from serving.launch import child_env, free_port, stop_process, wait_healthy
from tests.serving.test_router import CACHE_DIR, PAGE, WORKER_ARGS, chat_body, chat_prompt

KEY_A, KEY_A2, KEY_B = "sk-acme-one", "sk-acme-two", "sk-loner"
KEY_FILE = f"""# the test deployment's clients
{KEY_A} acme   # two keys of one tenant share its caches
{KEY_A2} acme
{KEY_B}
"""
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
INTERNAL = internal_auth.headers(child_env()[internal_auth.ENV])
BIG = 31 << 20  # bodies a little under the router's default 32 MiB cap


class Deployment:
    def __init__(self, tmp):
        self.tmp, self.procs = tmp, {}

    def spawn(self, name: str, argv: list[str], **env) -> int:
        port = free_port()
        log = open(os.path.join(self.tmp, f"{name}.log"), "a")
        self.procs[name] = subprocess.Popen(
            argv + ["--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(child_env(), JAX_PLATFORMS="cpu", **env),
            start_new_session=True,
        )
        log.close()
        return port

    def start(self) -> "Deployment":
        os.makedirs(CACHE_DIR, exist_ok=True)
        wport = self.spawn("worker", [sys.executable, "-m", "serving.worker", "--role", "both"] + WORKER_ARGS)
        self.worker = f"http://127.0.0.1:{wport}"
        wait_healthy(self.worker, self.procs["worker"], 400)
        keys = os.path.join(self.tmp, "keys")
        with open(os.open(keys, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(KEY_FILE)
        rport = self.spawn(
            "router",
            [
                sys.executable,
                "-m",
                "serving.router",
                "--config",
                "tiny",
                "--decode",
                self.worker,
                "--log-level",
                "info",
            ],
            KIMIK3_API_KEY_FILE=keys,
        )
        self.router = f"http://127.0.0.1:{rport}"
        wait_healthy(self.router, self.procs["router"], 60)
        return self

    def stop(self) -> None:
        for p in self.procs.values():
            stop_process(p, timeout_s=10)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(str(tmp_path_factory.mktemp("security")))
    try:
        yield d.start()
    finally:
        d.stop()


def test_the_key_file_format_and_the_salt_of_a_tenant(tmp_path):
    from serving import router_auth as ra

    keys = ra.parse_key_file(KEY_FILE + "\n   \n#" + "x" * 10 + "\n")
    assert keys == {KEY_A: "acme", KEY_A2: "acme", KEY_B: ra.key_tenant(KEY_B)}
    assert KEY_B not in ra.key_tenant(KEY_B)  # a key's own tenant names its hash, never the key
    for bad, why in [("k1 t1 extra", ":1: expected"), ("# only comments\n", "no keys"), ("k t1\nk t2", ":2: a key")]:
        with pytest.raises(ValueError, match=why):
            ra.parse_key_file(bad)
    path = tmp_path / "keys"
    path.write_text("k-env-too mine\n")
    ring = ra.KeyRing.from_config("k-env", str(path))
    assert "k-env" not in repr(ring) and len(ring) == 2
    assert ring.tenant("Bearer k-env") == ra.key_tenant("k-env") and ring.tenant("bearer  k-env-too ") == "mine"
    assert ring.tenant("Bearer k-env-to") is None and ring.tenant(None) is None and ring.tenant("k-env") is None
    assert ra.KeyRing().tenant(None) == ra.ANONYMOUS  # no key: everyone is the anonymous tenant
    salts = {ra.cache_salt(t, s) for t in ("acme", "other", ra.ANONYMOUS) for s in (None, "x", "y")}
    assert len(salts) == 9 and ra.cache_salt(ra.ANONYMOUS, None) is None  # distinct, but the shared cache's
    assert ra.cache_salt("acme", None) == ra.cache_salt("acme", None) and len(ra.cache_salt("acme", "x")) == 32


def test_the_value_counter_sees_only_separators_outside_strings():
    from serving.router_body import ValueCounter, loads
    from serving.openai_api import APIError

    text = json.dumps([1, "a,b", '\\"', {"k,": ["\\", 2]}, '\\\\"x,']).encode()
    for step in (1, 2, 3, 7, len(text)):
        counter = ValueCounter()
        for i in range(0, len(text), step):
            counter.feed(text[i : i + step])
        assert counter.separators == 5, step
    with pytest.raises(APIError, match="nested too deeply"):
        loads(b"[" * 100_000)
    with pytest.raises(APIError) as e:
        loads(b'{"a": [{"b": 1}, {"c": %s}]}' % (b"1" * 4301))
    assert e.value.param == "a.1.c" and "4301 digits" in e.value.message


def _cached(base: str, text: str, authorization: str, **kw) -> tuple[int, list[int]]:
    r = httpx.post(
        base + "/v1/chat/completions",
        json=chat_body(text, 2, **kw),
        headers={"Authorization": authorization},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["token_ids"]


def check_each_key_authenticates_as_a_tenant_and_tenants_share_no_cache(deployment):
    """The second tenant's client sees cached_tokens 0 for the first tenant's prompt, whose own repeat
    hits (through another key of the same tenant too); `user` does not split a tenant's cache,
    `cache_salt` does (and two tenants with one `cache_salt` still share nothing); the bearer
    scheme is case-insensitive."""
    base = deployment.router
    text = f"system: tenant acme's secret plan {time.time_ns()}. " * 3
    full = (len(chat_prompt(text)) // PAGE - 1) * PAGE  # the whole pages a repeat hits, at least

    first, want = _cached(base, text, f"Bearer {KEY_A}")
    assert first == 0
    got, tokens = _cached(base, text, f"Bearer {KEY_B}")
    assert got == 0 and tokens == want  # the other tenant: no hit, the same answer
    assert _cached(base, text, f"bearer {KEY_A}")[0] >= full  # lower-case scheme; the tenant's own repeat
    assert _cached(base, text, f"BEARER {KEY_A2}")[0] >= full  # another key of tenant acme
    assert _cached(base, text, f"Bearer {KEY_A}", user="alice")[0] >= full
    assert _cached(base, text, f"Bearer {KEY_A}", user="bob")[0] >= full  # `user` does not narrow
    assert _cached(base, text, f"Bearer {KEY_A}", cache_salt="project-x")[0] == 0
    assert _cached(base, text, f"Bearer {KEY_A}", cache_salt="project-x")[0] >= full
    assert _cached(base, text, f"Bearer {KEY_B}", cache_salt="project-x")[0] == 0  # not across tenants
    for bad in ("Bearer sk-nobody", KEY_A, f"Basic {KEY_A}", ""):
        r = httpx.post(base + "/v1/chat/completions", json=chat_body(text, 2), headers={"Authorization": bad})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (bad, r.text)


def check_the_operators_routes_need_an_api_key_or_the_internal_token(deployment):
    base = deployment.router
    for path in ("/admin/workers", "/docs", "/openapi.json"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(base + path, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
        for headers in ({"Authorization": f"bearer {KEY_B}"}, INTERNAL):
            assert httpx.get(base + path, headers=headers, timeout=10).status_code == 200, (path, headers)
    assert httpx.get(base + "/redoc", timeout=10).status_code == 404
    workers = httpx.get(base + "/admin/workers", headers=AUTH_A, timeout=10).json()["workers"]
    assert [w["url"] for w in workers] == [deployment.worker]
    open_health = httpx.get(base + "/health", timeout=10)
    assert open_health.status_code == 200 and "workers" not in open_health.json()  # status only, no URLs or pids
    assert httpx.get(base + "/health", headers=AUTH_A, timeout=10).json()["workers"][0]["url"] == deployment.worker
    # draining changes the deployment: the internal token only (a tenant's key is not enough)
    r = httpx.post(base + "/admin/drain", json={"url": deployment.worker}, headers=AUTH_A, timeout=10)
    assert r.status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": f"bEaReR {KEY_A}"}).status_code == 200


def _rss_peak_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM"))


_LOADER = """
import http.client, sys, time
port, path, body_file, key, until = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
body, statuses = open(body_file, "rb").read(), set()
while time.time() < until:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, body=body, headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    r = c.getresponse()
    statuses.add(r.status)
    r.read()
    c.close()
print(sorted(statuses))
"""


def check_health_answers_promptly_while_four_clients_send_31_mb_bodies(deployment):
    """Four client processes send 31 MB bodies back to back (two a long text, two a prompt of
    millions of token ids: the JSON whose parse would hold the interpreter longest); all are 400s;
    50 /health probes meanwhile answer within 100 ms at p99 (asserted looser: CI machines are
    noisy) and the router's peak memory grows by far less than the bodies would cost parsed (a
    single 31 MB text body tokenized once cost 556 MB)."""
    base, port = deployment.router, int(deployment.router.rsplit(":", 1)[1])
    text = os.path.join(deployment.tmp, "text.json")
    with open(text, "wb") as f:
        f.write(json.dumps(chat_body("a" * BIG, 3)).encode())
    ids = os.path.join(deployment.tmp, "ids.json")
    with open(ids, "wb") as f:
        f.write(b'{"model": "kimik3-tiny", "max_tokens": 3, "prompt": [' + b"1," * (BIG // 2) + b"1]}")
    pid = deployment.procs["router"].pid
    peak_before = _rss_peak_mib(pid)
    until = time.time() + 6
    loaders = [
        subprocess.Popen(
            [sys.executable, "-c", _LOADER, str(port), path, str(body), KEY_B, str(until)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for path, body in [("/v1/chat/completions", text), ("/v1/completions", ids)] * 2
    ]
    try:
        time.sleep(1.0)  # the bodies are on their way
        latencies = []
        with httpx.Client(timeout=30) as c:
            for _ in range(50):
                t0 = time.perf_counter()
                assert c.get(base + "/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
    finally:
        statuses = [p.communicate(timeout=120)[0].strip() for p in loaders]
    latencies.sort()
    p99_ms = 1000 * latencies[int(0.99 * len(latencies))]
    grew = _rss_peak_mib(pid) - peak_before
    print(
        f"/health under 4 x 31 MB bodies: p50 {1000 * latencies[25]:.1f} ms, p99 {p99_ms:.1f} ms; peak RSS +{grew} MiB"
    )
    assert statuses == ["[400]"] * 4, statuses
    assert p99_ms < 400, latencies  # 100 ms is the goal: CI machines running other tests meanwhile are noisy
    assert grew < 1024, grew


def check_an_integer_literal_past_pythons_conversion_limit_is_a_400_naming_its_field(deployment):
    huge = "9" * 5000
    cases = [
        ("/v1/chat/completions", '{"model": "kimik3-tiny", "messages": [], "max_tokens": %s}' % huge, "max_tokens"),
        (
            "/v1/completions",
            '{"model": "kimik3-tiny", "prompt": "hi", "stop_token_ids": [1, -%s]}' % huge,
            "stop_token_ids.1",
        ),
    ]
    for path, body, field in cases:
        r = httpx.post(deployment.router + path, content=body, headers=AUTH_A, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"] and "5000 digits" in err["message"], err


def check_a_request_a_real_worker_refuses_is_not_retried(deployment):
    """A router whose model config admits token ids the worker's does not (`--config small`: a
    larger vocabulary) passes a prompt the real worker refuses with a 400 marked not retriable: the
    client gets that 400 (naming the field), the router sent the request once (with --retries 3
    a retry would come back to the only worker) and its circuit breaker counted nothing."""
    from fastapi.testclient import TestClient

    from serving.router import Router, RouterConfig

    cfg = RouterConfig(decode=[deployment.worker], config="small", model_name="kimik3-tiny", retries=3, l1_bytes=0)
    router = Router(cfg)
    sent = []

    async def count(request):
        if request.method == "POST":
            sent.append(request.url.path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(internal_auth.ENV, child_env()[internal_auth.ENV])  # what the router sends its workers
        with TestClient(router.create_app()) as c:
            router.client.event_hooks = {"request": [count], "response": []}
            body = {"model": "kimik3-tiny", "prompt": [1, 300, 2], "max_tokens": 2}
            r = c.post("/v1/completions", json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["retriable"] is False and err["param"] == "prompt.1", r.text
            assert "token ids must lie in" in err["message"]
            assert sent == ["/generate"]
            assert router.decode[0].breaker.failures == 0 and router.decode[0].breaker.state == "closed"
            assert c.post("/v1/completions", json={**body, "prompt": [1, 2, 3]}).status_code == 200  # still served


class _StubWorker(ThreadingHTTPServer):
    """An HTTP server standing in for a worker only to count the attempts a router makes: /health
    passes, every /generate answers as `mode` says."""

    daemon_threads = True

    def __init__(self, mode: str):
        self.mode, self.calls = mode, 0
        super().__init__(("127.0.0.1", 0), _StubHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _StubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        health = {"status": "ok", "max_context": 752, "tokenizer": {"eos_id": 258}, "load": {}}
        self._send(200, json.dumps(health).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.calls += 1
        mode = self.server.mode
        if mode == "refuse":
            self._send(400, json.dumps({"error": "prompt too long for this worker", "retriable": False}).encode())
        elif mode == "fault":
            self._send(500, json.dumps({"error": "engine fault", "retriable": True}).encode())
        elif mode == "engine_fault":  # the worker's engine failed while it held this request
            body = {"error": "engine fault", "status": 500, "retriable": True, "code": "engine_fault"}
            self._send(500, json.dumps(body).encode())
        else:  # a token, then an error the request caused (a request of death)
            lines = [{"accepted": True}, {"token": 65, "index": 0, "cached_tokens": 0, "cached_tokens_host": 0}]
            lines.append({"error": "the request crashed the engine", "status": 500, "retriable": False})
            self._send(200, "".join(json.dumps(x) + "\n" for x in lines).encode(), "application/x-ndjson")


@pytest.mark.parametrize("mode", ["refuse", "poison", "fault", "engine_fault"])
def test_a_request_a_worker_failed_for_its_own_reason_goes_to_no_other_worker(mode):
    """Two stub workers: a 400 refusal and an error event marked not retriable (after a token) reach
    the client from the first worker as they are, not retriable, with nothing counted against its
    circuit breaker; a request in flight when its worker's engine faulted (the poison-pill rule)
    is a 503 from that one worker, carried to no other; a plain retriable fault (for contrast) is
    retried on the other worker."""
    from fastapi.testclient import TestClient

    from serving.router import Router, RouterConfig

    stubs = [_StubWorker(mode), _StubWorker(mode)]
    cfg = RouterConfig(
        decode=[s.url for s in stubs], config="tiny", retries=3, backoff_base_s=0.01, l1_bytes=0, no_worker_wait_s=1
    )
    router = Router(cfg)
    try:
        with TestClient(router.create_app()) as c:
            r = c.post("/v1/chat/completions", json=chat_body("hi", 4))
            calls = [s.calls for s in stubs]
            if mode == "fault":
                assert r.status_code == 503 and sorted(calls)[0] >= 1, (r.text, calls)
                return
            if mode == "engine_fault":
                assert r.status_code == 503 and sum(calls) == 1, (r.text, calls)
                assert r.json()["error"]["code"] == "worker_failed"
                return
            assert sum(calls) == 1, calls
            err = r.json()["error"]
            assert r.status_code == (400 if mode == "refuse" else 500) and err["retriable"] is False, r.text
            assert all(w.breaker.failures == 0 for w in router.decode)
            with c.stream("POST", "/v1/chat/completions", json=chat_body("hi", 4, stream=True)) as s:
                events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
            assert sum(st.calls for st in stubs) == 2  # one more attempt, no retry
            if mode == "poison":  # streamed: the token, then the error, once
                assert events[-1]["error"]["retriable"] is False and events[-1]["error"]["tokens_sent"] == 1
    finally:
        for s in stubs:
            s.shutdown()
            s.server_close()


# ---- the outside fuzzer -------------------------------------------------------------------------------------
_WORKER_BODY = {  # the worker's /generate and /prefill body (serving.worker's GenerateBody), the tiny model's ranges
    "type": "object",
    "properties": {
        "prompt": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 287},
            "minItems": 1,
            "maxItems": 64,
        },
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 32},
        "stop_at_eos": {"type": "boolean"},
        "request_id": {"type": "string", "maxLength": 256},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": 50},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**62},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "cache_salt": {"type": "string", "minLength": 1, "maxLength": 256},
        "hold_kv": {"type": "boolean"},
    },
    "required": ["prompt", "max_tokens"],
    "additionalProperties": False,
}


def _fuzz(schema_dict: dict, base: str, headers: dict, max_examples: int, skip=()) -> dict:
    """Every operation of an OpenAPI schema, positive and negative examples (`max_examples` a mode),
    called for real; {operation: sorted status codes}; AssertionError on any 5xx."""
    import hypothesis
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(schema_dict)
    seen: dict[str, set] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.label in skip:
            continue
        strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

        @hypothesis.settings(
            max_examples=2 * max_examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(hypothesis.HealthCheck),
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        )
        @hypothesis.given(case=strategy)
        def call(case):
            response = case.call(base_url=base, headers=headers, timeout=30)
            seen.setdefault(op.label, set()).add(response.status_code)
            assert response.status_code < 500, (op.label, response.status_code, response.text[:300], case.body)

        call()
    return {k: sorted(v) for k, v in seen.items()}


def check_schemathesis_finds_no_server_error_in_the_router_or_the_worker(deployment):
    """schemathesis drives the router's schema (its /v1 bodies are the request models) with the
    API key, and the worker's (its /generate and /prefill bodies given here) with the internal
    token: no answer is a 5xx and both still answer /health afterwards.  Bounded: 50 examples a router
    operation and 20 a worker operation (positive and negative alike), about 15 s in all."""
    t0 = time.monotonic()
    router_schema = httpx.get(deployment.router + "/openapi.json", headers=AUTH_A, timeout=10).json()
    # the served model's name, so that positive examples get past the model check to the worker
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        router_schema["components"]["schemas"][name]["properties"]["model"] = {"enum": ["kimik3-tiny"]}
    seen = _fuzz(router_schema, deployment.router, AUTH_A, 25)
    assert any(200 in codes for codes in seen.values()) and any(400 in codes for codes in seen.values()), seen
    worker_schema = httpx.get(deployment.worker + "/openapi.json", timeout=10).json()
    for path in ("/generate", "/prefill"):
        worker_schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _WORKER_BODY}},
        }
    # draining would end the worker's service for the rest of the module
    worker_seen = _fuzz(worker_schema, deployment.worker, INTERNAL, 10, skip={"POST /drain", "POST /resume"})
    assert 200 in worker_seen["POST /generate"] and 400 in worker_seen["POST /generate"], worker_seen
    print(f"schemathesis: router {seen}; worker {worker_seen}; {time.monotonic() - t0:.1f} s")
    for url in (deployment.router, deployment.worker):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    for name, p in deployment.procs.items():
        assert p.poll() is None, name


def test_router_security_against_a_real_worker_and_router(deployment):
    """The checks that need the deployment, in order inside one test: `pytest -n` (xdist) cannot
    split them over two processes and start two deployments."""
    for check in (
        check_each_key_authenticates_as_a_tenant_and_tenants_share_no_cache,
        check_the_operators_routes_need_an_api_key_or_the_internal_token,
        check_an_integer_literal_past_pythons_conversion_limit_is_a_400_naming_its_field,
        check_a_request_a_real_worker_refuses_is_not_retried,
        check_health_answers_promptly_while_four_clients_send_31_mb_bodies,
        check_schemathesis_finds_no_server_error_in_the_router_or_the_worker,
    ):
        t0 = time.monotonic()
        check(deployment)
        print(f"{check.__name__}: {time.monotonic() - t0:.1f} s")
