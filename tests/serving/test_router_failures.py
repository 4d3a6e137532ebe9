"""The router's failure paths, against fake workers and no model.

A fake worker is an HTTP server on 127.0.0.1 that answers the worker API (`serving.worker`:
``/health``, ``/generate``, ``/prefill`` with ``hold_kv``, ``/adopt``, ``/kv/<handle>``) from a
script -- a refusal, a 5xx, a connection dropped before any answer or cut mid-stream, a stream
that ends early or with a retriable error -- and records every request it gets.  The router runs
in-process (`fastapi.testclient.TestClient` over `Router.create_app`); its backoff waits are
recorded in the same log as the workers' requests instead of slept, and its circuit breakers
read a clock the test moves.  A worker's ``/health`` reports a queue depth of its `rank`, so the
router prefers the workers in rank order and every scenario is deterministic.

The fake workers all "generate" one text, TEXT (the byte tokenizer: a token per byte): a request
whose context ends in the first k tokens of TEXT (``prior_output`` k; for ``/adopt``, the handed-over
first token) gets the next ones, as a real worker's greedy continuation would.  A client that
receives TEXT exactly was sent no token twice and lost none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import pytest
from fastapi.testclient import TestClient

from kimik3 import tokenizer
from serving.router import Router, RouterConfig

TEXT = "The quick brown fox jumps over the lazy dog."
TOKENS = list(TEXT.encode())
PROMPT = "Say the pangram."
BASE_S, MAX_S = 0.05, 1.0  # the router's backoff: attempt n waits up to min(MAX_S, BASE_S * 2**(n-1))

SERVE = ("serve",)  # /generate, /adopt: continue TEXT to the budget; /prefill: hold the KV, answer its handle


def refuse(status: int, body) -> tuple:
    """Answer `status` with `body` (JSON, or text as it is)."""
    return ("refuse", status, body)


DROP = ("drop",)  # close the connection without an answer


def broken(after: int, end: str) -> tuple:
    """Stream `after` tokens, then end: "cut" (the connection closes mid-body), "eof" (the body
    ends without a done line) or "error" (a retriable error line)."""
    return ("stream", after, end)


@dataclasses.dataclass
class Call:
    worker: str
    path: str
    query: dict
    body: dict | None


class Fakes:
    """The fake workers of one test: one ordered log of their requests (`Call`s) and of the
    router's backoff waits (("wait", seconds)), and the clock of the router's breakers."""

    def __init__(self):
        self.lock = threading.Lock()
        self.log: list = []
        self.now = 0.0
        self.workers: list[FakeWorker] = []

    def add(self, name: str, rank: int = 0, **script) -> FakeWorker:
        w = FakeWorker(self, name, rank, script)
        self.workers.append(w)
        return w

    def record(self, item) -> None:
        with self.lock:
            self.log.append(item)

    def calls(self, path: str | None = None) -> list[Call]:
        with self.lock:
            return [c for c in self.log if isinstance(c, Call) and (path is None or c.path == path)]

    def posts(self) -> list[Call]:
        return [c for c in self.calls() if not c.path.startswith("/kv/")]

    def waits(self) -> list[float]:
        with self.lock:
            return [x[1] for x in self.log if isinstance(x, tuple) and x[0] == "wait"]

    def sequence(self) -> list[str]:
        """The log's posts and waits in order: "worker path" and "wait"."""
        with self.lock:
            log = list(self.log)
        return [
            "wait" if isinstance(x, tuple) else f"{x.worker} {x.path}"
            for x in log
            if isinstance(x, tuple) or not x.path.startswith("/kv/")
        ]

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
            w.server_close()


class FakeWorker(ThreadingHTTPServer):
    """One fake worker.  `script` maps a path to the actions its next requests get, in order
    (SERVE once they are spent); `always` is the action every request to a path gets instead."""

    daemon_threads = True

    def __init__(self, fakes: Fakes, name: str, rank: int, script: dict):
        self.fakes, self.name, self.rank = fakes, name, rank
        self.always = script.pop("always", {})
        self.script = {path: list(actions) for path, actions in script.items()}
        self.held: dict[str, bytes] = {}  # /prefill's KV under one-time handles
        self.handles: list[str] = []  # every handle this worker gave out
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, args=(0.01,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def next_action(self, path: str) -> tuple:
        with self.fakes.lock:
            if path in self.always:
                return self.always[path]
            queue = self.script.get(path)
            return queue.pop(0) if queue else SERVE

    def calls(self, path: str | None = None) -> list[Call]:
        return [c for c in self.fakes.calls(path) if c.worker == self.name]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked streams; every answer closes its connection (no reuse races)

    def log_message(self, *args):
        pass

    def _answer(self, status: int, body, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (json.dumps(body) if ctype == "application/json" else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def do_GET(self):
        w: FakeWorker = self.server
        if self.path == "/health":
            health = {"status": "ok", "max_context": 752, "tokenizer": {"eos_id": tokenizer.EOS_ID}}
            return self._answer(200, {**health, "load": {"waiting": w.rank}})
        if self.path.startswith("/kv/"):
            w.fakes.record(Call(w.name, self.path, {}, None))
            with w.fakes.lock:
                data = w.held.pop(self.path[len("/kv/") :], None)
            if data is None:
                return self._answer(404, {"error": "no KV held under this handle (taken, expired or dropped)"})
            return self._answer(200, data, "application/octet-stream")
        self._answer(404, {"error": "not found"})

    def do_POST(self):
        w: FakeWorker = self.server
        url = urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.loads(raw) if raw else None
        w.fakes.record(Call(w.name, url.path, dict(parse_qsl(url.query)), body))
        action = w.next_action(url.path)
        if action[0] == "refuse":
            _, status, answer = action
            return self._answer(status, answer, "application/json" if isinstance(answer, dict) else "text/plain")
        if action[0] == "drop":
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if url.path == "/prefill":
            return self._prefill(body)
        if url.path == "/generate":
            done = body.get("prior_output", 0)
            tokens = TOKENS[done : done + body["max_tokens"]]
        elif url.path == "/adopt":
            query = dict(parse_qsl(url.query))
            try:  # the one-time pull from the prefill worker, as a real decode worker makes it
                urllib.request.urlopen(f"{query['kv_from']}/kv/{query['kv_handle']}", timeout=5).read()
            except urllib.error.HTTPError as e:
                return self._answer(502, {"error": f"could not pull the KV: {e.code}", "retriable": True})
            tokens = TOKENS[1 : int(query["max_tokens"])]  # the prefill worker's token was the first
        else:
            return self._answer(404, {"error": "not found"})
        after, end = (len(tokens), "done") if action == SERVE else action[1:]
        self._stream(tokens[:after], end)

    def _prefill(self, body: dict) -> None:
        w: FakeWorker = self.server
        handle = uuid.uuid4().hex
        with w.fakes.lock:
            w.held[handle] = json.dumps({"prompt": body["prompt"], "token": TOKENS[0]}).encode()
            w.handles.append(handle)
        self._answer(
            200,
            {
                "token": TOKENS[0],
                "tokens": [TOKENS[0]],
                "done": True,
                "finish_reason": "length",
                "cached_tokens": 0,
                "cached_tokens_host": 0,
                "kv_handle": handle,
                "kv_bytes": 4096,
            },
        )

    def _stream(self, tokens: list[int], end: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def line(obj) -> None:
            data = (json.dumps(obj) + "\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        line({"accepted": True, "worker": self.server.name})
        for i, t in enumerate(tokens):
            line({"token": t, "index": i, **({"cached_tokens": 0, "cached_tokens_host": 0} if i == 0 else {})})
        if end == "cut":  # mid-body: no last chunk
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if end == "done":
            line({"done": True, "finish_reason": "length", "cached_tokens": 0, "cached_tokens_host": 0})
        elif end == "error":
            line({"error": "the engine restarted", "status": 503, "retriable": True})
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def fakes():
    f = Fakes()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def no_jitter(monkeypatch):
    """The backoff's full jitter draws its upper bound: each wait is the backoff's cap."""
    import serving.router

    monkeypatch.setattr(serving.router.random, "uniform", lambda lo, hi: hi)


@contextlib.contextmanager
def routed(fakes: Fakes, prefill=(), decode=(), **options):
    """A router over the fake workers, in-process: (router, client).  Backoff waits go to the log."""
    cfg = {
        "config": "tiny",
        "retries": 3,
        "backoff_base_s": BASE_S,
        "backoff_max_s": MAX_S,
        "health_interval_s": 3600.0,  # the start's check only: the breakers move on requests alone
        "no_worker_wait_s": 0.2,
        "request_timeout_s": 5.0,
        "handoff": "direct",
        "l1_bytes": 0,
        "l2_bytes": 0,
        **options,
    }
    router = Router(RouterConfig(prefill=[w.url for w in prefill], decode=[w.url for w in decode], **cfg))

    async def wait(seconds: float) -> None:
        fakes.record(("wait", seconds))

    router.sleep = wait
    for w in router.workers:
        w.breaker.clock = lambda: fakes.now
    with TestClient(router.create_app()) as client:
        yield router, client


def complete(client: TestClient, stream: bool = False) -> tuple[int, dict | list[dict]]:
    """/v1/completions of PROMPT for len(TOKENS) tokens: (status, the JSON answer or the SSE events)."""
    body = {"model": "kimik3-tiny", "prompt": PROMPT, "max_tokens": len(TOKENS), "stream": stream}
    if not stream:
        r = client.post("/v1/completions", json=body)
        return r.status_code, r.json()
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.headers["content-type"].startswith("application/json"):
            return r.status_code, json.loads(r.read())
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    return r.status_code, events


def streamed(events: list[dict]) -> tuple[str, list[int]]:
    """The text and token ids an SSE stream carried."""
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    ids = [t for e in events if e.get("choices") for t in e["choices"][0].get("token_ids", [])]
    return text, ids


def prompt_ids() -> list[int]:
    return [tokenizer.BOS_ID, *PROMPT.encode()]


# ---- 4xx: the request's own fault --------------------------------------------------------------------------
REFUSAL = {"error": "max_tokens must be at most 32 on this worker", "param": "max_tokens"}  # no "retriable" mark


@pytest.mark.parametrize("where", ["/generate", "/prefill", "/adopt"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_400_reaches_the_client_after_one_attempt(fakes, where, stream):
    """A worker's 400 (its error body unmarked: a 4xx alone says the request is at fault) is the
    client's answer after exactly one attempt -- colocated (/generate), at the prefill worker, or
    at the decode worker adopting a direct handoff -- with the worker's message and field, marked
    not retriable; no backoff, no second worker, nothing counted against any breaker.  Once the
    stream has begun (the handoff's first token was sent) it arrives as the stream's last event."""
    everywhere = {"always": {where: refuse(400, REFUSAL)}}
    if where == "/generate":
        prefill, decode = [], [fakes.add("d0", 0, **everywhere), fakes.add("d1", 1, **everywhere)]
    elif where == "/prefill":
        prefill, decode = [fakes.add("p0", 0, **everywhere), fakes.add("p1", 1, **everywhere)], [fakes.add("d0")]
    else:
        prefill, decode = [fakes.add("p0")], [fakes.add("d0", 0, **everywhere), fakes.add("d1", 1, **everywhere)]
    with routed(fakes, prefill, decode) as (router, client):
        status, answer = complete(client, stream)
        if stream and where == "/adopt":
            assert status == 200 and streamed(answer) == (TEXT[0], TOKENS[:1]), answer
            err = answer[-1]["error"]
            assert err["tokens_sent"] == 1
        else:
            assert status == 400, answer
            err = answer["error"]
        assert err["retriable"] is False and err["param"] == "max_tokens", err
        assert REFUSAL["error"] in err["message"] and err["code"] == "worker_refused", err
        assert [c.path for c in fakes.posts()] == (["/prefill"] if prefill else []) + (
            [where] if where != "/prefill" else []
        ), fakes.sequence()
        assert fakes.waits() == []
        assert all(w.breaker.failures == 0 and w.breaker.state == "closed" for w in router.workers)


# ---- 5xx and dropped connections: the worker's fault ---------------------------------------------------------
def test_a_5xx_or_a_dropped_connection_fails_over_once_per_worker_with_backoff_between(fakes, no_jitter):
    """A 503 (not draining) and a connection closed before any answer each count one failure
    against their worker and move the request to the next worker, a backoff wait between attempts
    and none before the first, each doubling (full jitter under a cap; here the cap); the third
    worker's answer is the client's."""
    d0 = fakes.add("d0", 0, **{"/generate": [refuse(503, {"error": "the engine step failed"})]})
    d1 = fakes.add("d1", 1, **{"/generate": [DROP]})
    d2 = fakes.add("d2", 2)
    with routed(fakes, decode=[d0, d1, d2]) as (router, client):
        status, answer = complete(client)
        assert status == 200 and answer["choices"][0]["text"] == TEXT, answer
        assert fakes.sequence() == ["d0 /generate", "wait", "d1 /generate", "wait", "d2 /generate"]
        assert fakes.waits() == [BASE_S, 2 * BASE_S]
        assert all(c.body["prompt"] == prompt_ids() and "prior_output" not in c.body for c in fakes.posts())
        assert [w.breaker.failures for w in router.decode] == [1, 1, 0]
        assert "disconnected without sending a response" in router.decode[1].last_error


def test_a_prefill_5xx_or_drop_fails_over_to_the_next_prefill_worker_whose_handle_is_adopted(fakes, no_jitter):
    """Direct handoff: a prefill worker's 503 and a dropped connection move the prompt to the next
    prefill worker after a backoff wait each; the decode worker adopts the KV of the prefill that
    answered, by its handle, pulled from that worker once."""
    p0 = fakes.add("p0", 0, **{"/prefill": [refuse(503, {"error": "the engine step failed"})]})
    p1 = fakes.add("p1", 1, **{"/prefill": [DROP]})
    p2 = fakes.add("p2", 2)
    d0 = fakes.add("d0")
    with routed(fakes, prefill=[p0, p1, p2], decode=[d0]) as (router, client):
        status, answer = complete(client)
        assert status == 200 and answer["choices"][0]["text"] == TEXT, answer
        assert fakes.sequence() == ["p0 /prefill", "wait", "p1 /prefill", "wait", "p2 /prefill", "d0 /adopt"]
        assert fakes.waits() == [BASE_S, 2 * BASE_S]
        (adopt,) = d0.calls("/adopt")
        assert adopt.query["kv_from"] == p2.url and [adopt.query["kv_handle"]] == p2.handles
        assert [c.path for c in p2.calls()] == ["/prefill", f"/kv/{p2.handles[0]}"]
        assert [w.breaker.failures for w in router.prefill] == [1, 1, 0]
        assert "disconnected without sending a response" in router.prefill[1].last_error


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_request_every_worker_fails_is_a_503_with_retry_after_after_one_attempt_per_worker(fakes, no_jitter, role):
    """With `retries` 2 and three workers that all fail (a 500, a drop, a 503), the request is
    tried once on each, with a doubling backoff wait between, and the client gets a 503 with
    Retry-After; the same whether the pool is the colocated workers or direct handoff's prefill."""
    path = "/generate" if role == "decode" else "/prefill"
    failing = [
        fakes.add("w0", 0, always={path: refuse(500, {"error": "internal error"})}),
        fakes.add("w1", 1, always={path: DROP}),
        fakes.add("w2", 2, always={path: refuse(503, "Service Unavailable")}),
    ]
    pools = {"decode": failing} if role == "decode" else {"prefill": failing, "decode": [fakes.add("d")]}
    with routed(fakes, retries=2, **pools) as (router, client):
        r = client.post("/v1/completions", json={"model": "kimik3-tiny", "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 503 and r.headers["retry-after"] == "15", r.text
        assert r.json()["error"]["code"] == "worker_failure"
        assert fakes.sequence() == [f"w0 {path}", "wait", f"w1 {path}", "wait", f"w2 {path}"]
        assert fakes.waits() == [BASE_S, 2 * BASE_S]
        assert [w.breaker.failures for w in router.workers[:3]] == [1, 1, 1]


# ---- the circuit breaker -----------------------------------------------------------------------------------
def test_a_failing_workers_breaker_opens_then_half_opens_and_a_good_trial_closes_it(fakes):
    """`breaker_threshold` 2, cooldown 5 s (doubling to at most 20): a worker that fails two
    requests in a row opens its circuit and gets no more requests; once the cooldown has passed
    it is half-open and the next request tries it; a failed trial opens it for twice as long, a
    successful one closes it (cooldown back to 5 s).  Every request the failing worker refuses is
    served by the other one."""
    a = fakes.add("a", 0, **{"/generate": [refuse(503, {"error": "step failed"})] * 3})
    b = fakes.add("b", 1)
    with routed(fakes, decode=[a, b], breaker_threshold=2, breaker_cooldown_s=5, breaker_max_cooldown_s=20) as (
        router,
        client,
    ):
        breaker = router.decode[0].breaker

        def request(a_calls: int, b_calls: int, state: str) -> None:
            status, answer = complete(client)
            assert status == 200 and answer["choices"][0]["text"] == TEXT, answer
            assert (len(a.calls()), len(b.calls())) == (a_calls, b_calls), fakes.sequence()
            assert breaker.state == state

        request(1, 1, "closed")  # a failed once: still closed
        request(2, 2, "open")  # twice in a row: open
        request(2, 3, "open")  # open: a gets nothing
        fakes.now = 5.0
        assert breaker.state == "half_open" and router.decode[0].available()
        request(3, 4, "open")  # the trial failed: open again, for 10 s
        assert breaker.cooldown_s == 10
        fakes.now = 14.0
        request(3, 5, "open")
        fakes.now = 15.0
        assert breaker.state == "half_open"
        request(4, 5, "closed")  # the trial served the request: closed
        assert breaker.failures == 0 and breaker.cooldown_s == 5
        assert len(fakes.waits()) == 3  # one backoff per failed attempt, none otherwise


# ---- streams that break --------------------------------------------------------------------------------------
BREAKS = {  # how the router saw each break
    "cut": "peer closed connection without sending complete message body",
    "eof": "closed the stream early",
    "error": "the engine restarted",
}


@pytest.mark.parametrize("end", list(BREAKS))
@pytest.mark.parametrize("stream", [True, False])
def test_a_stream_that_breaks_resumes_on_another_worker_without_repeating_a_token(fakes, end, stream):
    """A worker's stream that breaks after 5 tokens -- its connection cut, its body ended without a
    done line, or a retriable error line -- continues on the next worker from the prompt and the
    5 tokens (``prior_output`` 5) for the rest of the budget: the client receives TEXT exactly,
    each token once, streamed or not."""
    d0 = fakes.add("d0", 0, **{"/generate": [broken(5, end)]})
    d1 = fakes.add("d1", 1)
    with routed(fakes, decode=[d0, d1]) as (router, client):
        status, answer = complete(client, stream)
        assert status == 200, answer
        if stream:
            assert streamed(answer) == (TEXT, TOKENS), answer
            assert answer[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert answer["choices"][0]["text"] == TEXT and answer["choices"][0]["token_ids"] == TOKENS, answer
        assert fakes.sequence() == ["d0 /generate", "wait", "d1 /generate"]
        (resumed,) = d1.calls("/generate")
        assert resumed.body["prompt"] == prompt_ids() + TOKENS[:5] and resumed.body["prior_output"] == 5
        assert resumed.body["max_tokens"] == len(TOKENS) - 5
        assert [w.breaker.failures for w in router.decode] == [1, 0]
        assert BREAKS[end] in router.decode[0].last_error


def _assert_no_handle_reused(fakes: Fakes, prefill: FakeWorker) -> None:
    """Every handle the prefill worker gave out reached one /adopt and was pulled once."""
    adopted = [c.query["kv_handle"] for c in fakes.calls("/adopt")]
    assert adopted == prefill.handles, fakes.sequence()
    assert [c.path for c in fakes.calls() if c.path.startswith("/kv/")] == [f"/kv/{h}" for h in prefill.handles]


def test_a_direct_handoff_cut_mid_stream_recomputes_without_reusing_its_spent_handle(fakes):
    """A decode worker that adopted a direct handoff (pulled the KV by its one-time handle) and
    is cut off after 3 tokens: the next decode worker recomputes from the prompt and the 4 tokens
    so far (the prefill's and the 3) on /generate -- the spent handle goes to no second /adopt --
    and the client's stream is TEXT, each token once."""
    p = fakes.add("p")
    d0 = fakes.add("d0", 0, **{"/adopt": [broken(3, "cut")]})
    d1 = fakes.add("d1", 1)
    with routed(fakes, prefill=[p], decode=[d0, d1]) as (router, client):
        status, events = complete(client, stream=True)
        assert status == 200 and streamed(events) == (TEXT, TOKENS), events
        assert fakes.sequence() == ["p /prefill", "d0 /adopt", "wait", "d1 /generate"]
        _assert_no_handle_reused(fakes, p)
        (resumed,) = d1.calls("/generate")
        assert resumed.body["prompt"] == prompt_ids() + TOKENS[:4] and resumed.body["prior_output"] == 4
        assert resumed.body["max_tokens"] == len(TOKENS) - 4
        assert "kv_handle" not in resumed.body and "kv_from" not in resumed.body
        assert [w.breaker.failures for w in router.decode] == [1, 0]


def test_a_handoff_the_decode_worker_cannot_pull_is_recomputed_and_counts_nothing_against_it(fakes):
    """A decode worker whose pull of the handoff fails answers 502: the next decode worker
    recomputes from the prompt and the prefill's token on /generate (the handle is not offered
    again), the client gets TEXT, and the 502 counts nothing against the first one's breaker (the
    KV's source failed, not it)."""
    p = fakes.add("p")
    d0 = fakes.add("d0", 0, **{"/adopt": [refuse(502, {"error": "could not pull the KV", "retriable": True})]})
    d1 = fakes.add("d1", 1)
    with routed(fakes, prefill=[p], decode=[d0, d1]) as (router, client):
        status, answer = complete(client)
        assert status == 200 and answer["choices"][0]["text"] == TEXT, answer
        assert fakes.sequence() == ["p /prefill", "d0 /adopt", "wait", "d1 /generate"]
        assert [c.query["kv_handle"] for c in fakes.calls("/adopt")] == p.handles
        (resumed,) = d1.calls("/generate")
        assert resumed.body["prompt"] == prompt_ids() + TOKENS[:1] and resumed.body["prior_output"] == 1
        assert [w.breaker.failures for w in router.workers] == [0, 0, 0]
