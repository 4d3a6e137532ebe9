"""The worker API as the router speaks it: one attempt on one worker.

`stream` runs a `/generate` (or, for a direct handoff, an `/adopt`) and yields the worker's
events as they arrive; `prefill_hold` runs a direct handoff's `/prefill` with ``hold_kv`` and
returns its one answer as a done event.  Both raise `WorkerFailure` (another worker may serve
the request: `serving.router.retry.Failover` decides) or `RequestFailed` (the request's own
fault, `classify_worker_error`).  The worker API itself: `serving.worker`.
"""

from __future__ import annotations

import json

import httpx

from serving.router.registry import Worker
from serving.router.retry import RequestFailed, WorkerFailure, classify_worker_error
from serving.sampling import TokenLogprobs


async def stream(
    client: httpx.AsyncClient,
    w: Worker,
    context: list[int],
    want: int,
    opts: dict,
    rid: str,
    out: list[int],
    adopt: dict | None = None,
):
    """Stream up to `want` tokens of `context`'s continuation from `w` into `out` (yielding each);
    with `adopt` ({"kv_from", "kv_handle"}: a direct handoff's KV, held by the prefill worker)
    the worker pulls and takes over the KV instead of computing it.  `opts`: stop_at_eos and the
    sampling parameters (temperature, top_p, seed: draws are seeded per position, so a failover
    continues the same sample).  Ends with the worker's done event.  Raises WorkerFailure (try
    another worker), or RequestFailed (`classify_worker_error`: the request's own fault)."""
    if adopt is not None:
        # the decode worker pulls the KV from the prefill worker by handle (`serving.kv_handoff`);
        # the images travel inside the handoff's KV file, not in the query string
        kw = {
            "params": {
                "max_tokens": want + len(out),
                "request_id": rid,
                **adopt,
                **{k: v for k, v in opts.items() if k != "images"},
            }
        }
    else:
        # out: what earlier workers generated, now the prompt's tail (the penalties count it)
        kw = {
            "json": {
                "prompt": context,
                "max_tokens": want,
                "request_id": rid,
                **opts,
                **({"prior_output": len(out)} if out else {}),
            }
        }
    try:
        async with client.stream("POST", w.url + ("/adopt" if adopt is not None else "/generate"), **kw) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:4096].decode(errors="replace")
                err = classify_worker_error(w.url, resp.status_code, text, adopt=adopt is not None)
                if resp.status_code == 503 and "draining" in text:
                    w.draining = True
                raise err
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                ev = json.loads(line)
                if "token" in ev:
                    out.append(int(ev["token"]))
                    yield ev
                elif "done" in ev:
                    yield ev
                    return
                elif "error" in ev:
                    if ev.get("retriable") is False:  # the request's own fault: no other worker gets it
                        status = ev.get("status")
                        status = status if isinstance(status, int) and 400 <= status < 600 else 500
                        raise RequestFailed(
                            status,
                            f"the worker failed the request: {str(ev['error'])[:500]}",
                            type="invalid_request_error" if status < 500 else "server_error",
                            param=ev["param"] if isinstance(ev.get("param"), str) else None,
                            code="worker_refused",
                        )
                    raise WorkerFailure(f"{w.url}: {ev['error']}", engine_fault=ev.get("code") == "engine_fault")
            raise WorkerFailure(f"{w.url} closed the stream early")
    except (httpx.TransportError, json.JSONDecodeError) as e:
        raise WorkerFailure(f"{w.url}: {type(e).__name__}: {e}") from e


async def prefill_hold(client: httpx.AsyncClient, w: Worker, body: dict, timeout: httpx.Timeout) -> dict:
    """A direct handoff's prefill on `w` (`body`: the /prefill request, ``hold_kv`` set): its done
    event, {"done", "token": the first token, "kv_from", "kv_handle": where a decode worker pulls
    the prompt's KV, "cached_tokens", "cached_tokens_host", "kv_bytes"; "logprobs": the first
    token's `TokenLogprobs` where asked}.  One answer, no keepalives: hence its own `timeout`."""
    try:
        r = await client.post(w.url + "/prefill", json=body, timeout=timeout)
    except httpx.TransportError as e:
        raise WorkerFailure(f"{w.url}: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise classify_worker_error(w.url, r.status_code, r.text[:4096])
    a = r.json()
    done = {
        "done": True,
        "token": int(a["token"]),
        "kv_from": w.url,
        "kv_handle": a["kv_handle"],
        "cached_tokens": int(a["cached_tokens"]),
        "cached_tokens_host": int(a["cached_tokens_host"]),
        "kv_bytes": int(a["kv_bytes"]),
    }
    if "logprobs" in a:
        done["logprobs"] = TokenLogprobs.from_json(a["logprobs"])
    return done
