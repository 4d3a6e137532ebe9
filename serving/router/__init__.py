"""`kimik3 router`: an OpenAI-compatible gateway over prefill and decode worker processes.

    python -m serving.router --port 8000 --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8201 \
        [--mooncake-master 127.0.0.1:50051 --mooncake-metadata http://127.0.0.1:8080/metadata]

A request is tokenized and validated here (nothing invalid reaches a worker), admitted under a
bound (`--max-inflight` running, `--max-queue` waiting at most `--queue-timeout-s`; beyond that
429), then:

1. prefill: a prefill worker runs the prompt and returns the first token; its engine publishes
   the prompt's pages and KDA snapshots to the shared store (`serving.worker`);
2. decode: a decode worker gets prompt + tokens so far, finds the prefix in the store (it
   recomputes at most the last partial page) and streams the remaining tokens.

With `--handoff direct` (the default when the workers have no store) the prefill worker keeps
the prompt's KV (page contents + KDA state, `/prefill` with `hold_kv`) under a one-time handle,
and the decode worker's `/adopt` pulls it from the prefill worker by that handle and continues
without computing the prompt: the KV moves worker to worker, the router carries the handle
(`serving.kv_handoff`).  With no prefill workers (`both` workers under `--decode`) the whole request goes
to one worker.

Choice of worker: the lowest load score, ``router in-flight + worker queue depth + KV use``,
among workers whose health check passes, that are not draining and whose circuit is closed
(or half-open).  Prefix affinity (prefill only): the router remembers which worker prefilled
each block hash; a prompt whose deepest known prefix is *not* in the shared store goes to the
worker that holds it in its GPU pool, unless that worker is busier than the best by more than
`--affinity-slack`.  A prefix that is in the store is served equally well by any worker, so
then load alone decides.

Faults: connection errors, timeouts (workers send a keepalive line every second, so
`--read-timeout-s` of silence means a hung worker), 5xx and broken streams are retried on
another worker with exponential backoff and full jitter, at most `--retries` times; each counts
against that worker's circuit breaker (`--breaker-threshold` consecutive failures open it for
`--breaker-cooldown-s`, doubling while it keeps failing; a passing health check or request
after the cooldown closes it).  A decode worker that dies mid-stream is replaced by another
that continues from prompt + the tokens already sent: nothing is sent twice.  When no worker
of a role is available at all (down, drained, circuit open), a request waits up to
`--no-worker-wait-s` for one to come back (a worker restart), then gets a 503.  When every
attempt fails, the client gets 503 (or, once streaming, a final SSE error event) marked
retriable, with `Retry-After`.

Poison pills: a request that failed on a worker for a reason of its own is never sent to another
worker.  A worker's 4xx answer (other than 429 full, and 401 / 403, which say the router's
internal token is wrong: a deployment fault), and an error the worker marks ``"retriable":
false`` (in its answer or its stream), go back to the client as they are, with the worker's
status, marked not retriable, and count nothing against the worker's circuit breaker.

Bodies: capped at `--max-body-bytes` (413: refused on the Content-Length before reading, and
while reading a body that states none) and due whole within `--body-timeout-s` (408).  Parsing,
validation and tokenization run on worker threads, never on the event loop (bodies over 1 MiB
`--large-body-parsers` at a time), so a flood of large bodies does not stall `/health`.  Two
checks spare the work a body that cannot fit would cost: one that holds more JSON values than 4
per context token is a 400 as it arrives, before it is read whole or parsed
(`serving.router_body.ValueCounter`), and a prompt whose text is longer than the context could
hold even at the tokenizer's longest token is a 400 before it is tokenized.  Malformed JSON,
including an integer literal over Python's 4,300-digit conversion limit (named by its field),
is a 400.

Authentication (`serving.router_auth`): with API keys (``$KIMIK3_API_KEY`` / ``--api-key``,
``$KIMIK3_API_KEY_FILE`` / ``--api-key-file``) every /v1/* request needs ``Authorization:
Bearer KEY`` (the scheme in any case), and the key's tenant salts every cache namespace the
request touches: the workers' prefix cache, KDA snapshots and encoder cache (``cache_salt``),
this router's affinity hashes and the media cache's L1 and L2.  A single key is one tenant for
all its clients; no key (loopback development) makes every client the anonymous tenant.  The
operator's routes (``/admin/workers``, ``/docs``, ``/openapi.json``, and the worker details in
``/health``) need an API key or the deployment's internal token when either is configured;
``/admin/drain`` and ``/admin/resume`` need the internal token (an API key where the deployment
has no internal token).  ``/health``'s status and ``/metrics`` stay open, as vLLM's do; ``/metrics``
carries the workers' engine series too (KV use, the prefix cache, preemptions), labelled by worker
and scraped when it is read (`Router.scrape_workers`).

Layout (one concern a module):

* `config`: `RouterConfig`, its flags and config file;
* `registry`: the workers by role, their health checks; `breaker`: each worker's circuit breaker;
* `policy`: which worker gets an attempt (load, prefix affinity, the shared store's probe);
* `retry`: the one retry loop (failover, backoff, breakers, the poison-pill rule) every stage runs in;
  `upstream`: one attempt on one worker (the worker API as the router speaks it);
* `core`: `Router`, the parts wired together and a request's stages (prefill, handoff, decode);
* `intake`: a /v1 body to a validated, tokenized request; `admission`: the bound on requests at once;
* `app`: the HTTP app, a named handler per route; `access`: who may call which route;
  `streaming`: one request's OpenAI answer, whole or as server-sent events;
* `metrics`: the Prometheus series and the workers' federated behind /metrics;
* `cli`: `kimik3 router` / ``python -m serving.router``.
"""

# `random` is the backoff's jitter source (`retry.Failover.backoff` draws from the module):
# `serving.router.random` is the handle tests pin the jitter through
import random

from serving.router.admission import Admission, Overloaded
from serving.router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from serving.router.cli import main, run
from serving.router.config import (
    API_KEY_ENV,
    API_KEY_FILE_ENV,
    DISCONNECT_POLL_S,
    LARGE_BODY_BYTES,
    RETRY_AFTER,
    RouterConfig,
    add_arguments,
    config_from_args,
)
from serving.router.core import Router
from serving.router.intake import Parsed, max_token_bytes, read_body
from serving.router.metrics import RouterMetrics
from serving.router.policy import PrefixAffinity, StoreProbe
from serving.router.registry import Worker, WorkerPools
from serving.router.retry import Failover, RequestFailed, WorkerFailure, classify_worker_error
from serving.router.streaming import RequestStream
