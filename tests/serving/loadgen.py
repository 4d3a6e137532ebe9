"""Bursty load against a router's /v1/completions, from its own process (used by test_router.py).

    python tests/serving/loadgen.py --url http://127.0.0.1:8000 --bursts 2 --burst-size 8

Each burst sends `burst-size` requests at once (streaming and not, alternating), bursts `gap-s`
apart; every request is bounded by `timeout-s`.  Prints one JSON object: one row per request
(status, tokens, error type, latency) so the caller can check that none was lost.
"""

import argparse
import asyncio
import json
import sys
import time

import httpx


async def one(client, url, i, args):
    body = {
        "model": args.model,
        "prompt": f"request {i}: " + "load " * (5 + i % 7),
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": bool(i % 2),
        "temperature": 0,
    }
    t0 = time.monotonic()
    row = {"i": i, "status": None, "tokens": 0, "error": None}
    try:
        if body["stream"]:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                row["status"] = r.status_code
                if r.status_code != 200:
                    row["error"] = json.loads(await r.aread())["error"]["code"]
                else:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                row["error"] = ev["error"]["code"]
                            else:
                                row["tokens"] += sum(len(c.get("token_ids", [])) for c in ev["choices"])
        else:
            r = await client.post(url + "/v1/completions", json=body)
            row["status"] = r.status_code
            if r.status_code == 200:
                row["tokens"] = r.json()["usage"]["completion_tokens"]
            else:
                row["error"] = r.json()["error"]["code"]
                row["retry_after"] = r.headers.get("retry-after")
    except httpx.HTTPError as e:
        row["error"] = f"client: {type(e).__name__}"
    row["latency_s"] = time.monotonic() - t0
    return row


async def main(args):
    async with httpx.AsyncClient(timeout=args.timeout_s) as client:
        tasks = []
        for b in range(args.bursts):
            for k in range(args.burst_size):
                tasks.append(asyncio.create_task(one(client, args.url, b * args.burst_size + k, args)))
            await asyncio.sleep(args.gap_s)
        rows = await asyncio.gather(*tasks)
    print(json.dumps({"sent": len(tasks), "rows": rows}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", default="kimik3-tiny")
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--burst-size", type=int, default=8)
    p.add_argument("--gap-s", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=60.0)
    asyncio.run(main(p.parse_args()))
    sys.exit(0)
