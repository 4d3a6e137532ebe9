"""`kimik3 worker`: one `Engine` in its own process behind a small HTTP API.

    python -m serving.worker --role prefill --port 8101 --config tiny \
        --mooncake-master 127.0.0.1:50051 --mooncake-metadata http://127.0.0.1:8080/metadata

The engine is not thread-safe, so exactly one background thread owns it (`EngineLoop`):
HTTP handlers (asyncio, uvicorn) hand it commands through a queue and get their tokens
back through per-request asyncio queues.  Endpoints:

* ``POST /generate`` ``{"prompt": [ids], "max_tokens": n, "stop_at_eos": bool, "request_id": str,
  "cache_salt": str}``: NDJSON stream (``cache_salt``, the tenant's: prefix hits only among requests
  with the same salt; `serving.engine_config.check_cache_salt`).  First line ``{"accepted": true, ...}``
  once the engine took the request, then
  one ``{"token": id, "index": i}`` line per token (with ``"logprob"`` and ``"top_logprobs":
  [[id, logprob], ...]`` when the request asked for ``logprobs``: `serving.sampling.TokenLogprobs`),
  ``{"keepalive": true}`` lines while nothing else happens (a live worker is never silent for
  more than `keepalive_s`), and a last line ``{"done": true, "finish_reason": ..., "cached_tokens":
  ..., "cached_tokens_host": ...}`` or ``{"error": msg, "status": int, "retriable": bool, "code": str}``
  (see "Failures" below).  Closing the connection cancels the request.
* ``POST /prefill``: the same request with one token, answered as one JSON object; with
  ``"hold_kv": true`` (a prefill worker) the prompt's KV is kept under a one-time handle for a
  decode worker to pull (``GET /kv/<handle>``, internal token; `serving.kv_handoff`), and
  ``POST /adopt?kv_from=URL&kv_handle=H`` makes this worker pull it and decode: direct P/D
  with the KV moving worker to worker.  With a
  shared store (`--mooncake-master`) every finished request's pages and KDA snapshots are
  published there (`Engine(publish_to_host=True)`), so a decode worker (or this worker after a
  restart) finds the prompt's prefix in the store.
* ``GET /health`` (200 ok or degraded: the shared store is not answering and its lookups are
  misses, `cache.guarded_tier`; 503 draining or failed; plus the model facts a router needs),
  ``GET /load`` (queue depth, running, free pages and sessions, KV use), ``POST /drain``
  (refuse new requests, finish the admitted ones), ``POST /resume``, ``GET /metrics``.

Start-up: before /health answers, the engine compiles every step shape (`Engine.warmup`) and
every sampling variant a request may ask for (`warm_sampling_variants`: sampled, penalties,
logprobs), so no request waits for a compile (`--no-warmup`: compile on first use).  Every
`--log-stats-interval-s` (default 10 s) the worker logs vLLM's stats line (`StatsLogger`).  Every
`serving.engine_config.EngineConfig` field is a flag (`serving.flags`).

Status codes: 400 for a request the engine can never serve (every field is bounded where it
enters: the error names it, as ``"param"``), 429 when the waiting queue is full (try another
worker), 503 while draining or after an engine fault.

Failures.  A request's failure is that request's: when its own work inside the engine raises
(`serving.engine.Engine.fail_request`), it alone ends with ``{"error": ..., "status": 400 (a value
it carries could not be used) or 500, "retriable": false, "code": "request_failed"}`` -- another
worker would fail it the same way, so a router must not carry it there -- and the engine goes on
serving the others.  Only a fault of a step itself (a device program) is an engine fault: every
request here then ends with ``{"error": ..., "status": 500, "retriable": true, "code":
"engine_fault"}``, /health says "failed", and the process exits with `EXIT_ENGINE_FAULT` so that
its supervisor (`kimik3 launch`) restarts it.
"""


# Layout (one concern a module):
#
# * `config`: the command line's flags (`add_arguments`) and the constants the parts share;
# * `build`: the engine from the flags (weights, draft, KV pool, meshes, shared store, the facts
#   /health reports) and the sampling programs compiled before the first request;
# * `loop`: `EngineLoop`, the one thread that owns the engine, and a request's events;
# * `schemas`: what the HTTP API takes (`GenerateBody`, /adopt's query) and its error answers;
# * `app`: the HTTP app, a named handler per route (`WorkerApp`, `create_app`);
# * `handoff`: direct P/D handoff: the KV a prefill worker holds, a decode worker's pull;
# * `metrics`: the Prometheus series and the periodic stats line;
# * `cli`: `kimik3 worker` / ``python -m serving.worker``.
#
# The names below are the worker's public API, as importers and tests use them.

from serving.worker.app import WorkerApp, create_app
from serving.worker.build import (
    build_engine,
    default_cache_geometry,
    load_weights,
    meshes,
    pool_pages,
    warm_sampling_variants,
)
from serving.worker.cli import exit_after_fault, main, run
from serving.worker.config import EXIT_ENGINE_FAULT, KEEPALIVE_S, add_arguments
from serving.worker.handoff import Handoff
from serving.worker.loop import EngineLoop, Sub, engine_failure, request_failure
from serving.worker.metrics import STATS_LOGGER, StatsLogger, WorkerMetrics
from serving.worker.schemas import GenerateBody
