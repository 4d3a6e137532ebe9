"""A store fault drill against a whole deployment (issue 17 #4): kill the Mooncake master mid-service.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fault_drill.py [--config tiny] [--requests 6] [--out DIR]

Starts `kimik3 launch` (1 prefill + 1 decode worker, the store, the router; CPU by default),
then times short requests (non-streamed, two new tokens: the prefill worker's first, then the
decode worker's after the KV handoff, so the latency is about the TTFT plus one step) in three
phases: normal; right after SIGKILL of `mooncake_master` (the launcher restarts it within a
second, the workers' store breakers stay open for their cooldown, so lookups are misses);
after the cooldown (hits from the store again).  Prints one markdown table: per phase the
latency p50 / max, the workers' /health statuses, and the router's store-served prompt tokens
(its handoff counter).  Nothing here asserts a time: the drill reports them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from serving.launch import child_env, free_port, wait_healthy  # noqa: E402


def handoff_tokens(base: str) -> float:
    import httpx

    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^kimik3_router_handoff_cached_tokens_total (\S+)$", text, re.M))


def phase(base: str, state: dict, name: str, prompts: list[str], model: str = "tiny") -> dict:
    import httpx

    times = []
    for p in prompts:
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
            "model": f"kimik3-{model}", "messages": [{"role": "user", "content": p}], "max_tokens": 2,
            "ignore_eos": True, "temperature": 0})
        times.append(time.monotonic() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"{name}: {r.status_code} {r.text[:200]}")
    statuses = []
    for url in state["prefill"] + state["decode"]:
        statuses.append(httpx.get(url + "/health", timeout=10).json()["status"])
    return {"phase": name, "requests": len(prompts), "latency_p50_ms": 1e3 * statistics.median(times),
            "latency_max_ms": 1e3 * max(times), "worker_health": "/".join(statuses)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--cooldown-s", type=float, default=5.0, help="the workers' --store-cooldown-s")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kimik3-drill-")
    port, state_file = free_port(), os.path.join(tmp, "state.json")
    worker_args = f"--store-cooldown-s {args.cooldown_s} --num-pages 96 --num-slots 4"
    env = child_env()
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.Popen([sys.executable, "-m", "serving.launch", "--config", args.config, "--port", str(port),
                             "--prefill", "1", "--decode", "1", "--store-mb", "128", "--state-file", state_file,
                             "--log-dir", os.path.join(tmp, "logs"), "--worker-args", worker_args],
                            env=env, cwd=ROOT, start_new_session=True)
    rows = []
    try:
        deadline = time.monotonic() + 900
        while not os.path.exists(state_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"launch did not come up (logs in {tmp}/logs)")
            time.sleep(0.5)
        state = json.load(open(state_file))
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, None, 60)
        text = "a short question about caches, number {}: " + "the same long system prompt " * 12
        phase(base, state, "warm-up", [text.format(-1)], model=args.config)
        before = handoff_tokens(base)
        rows.append(phase(base, state, "normal", [text.format(i) for i in range(args.requests)], model=args.config))
        rows[-1]["store_served_prompt_tokens"] = handoff_tokens(base) - before
        os.kill(state["pids"]["mooncake_master"], signal.SIGKILL)
        before = handoff_tokens(base)
        rows.append(phase(base, state, "master killed (breaker open)",
                          [text.format(100 + i) for i in range(args.requests)], model=args.config))
        rows[-1]["store_served_prompt_tokens"] = handoff_tokens(base) - before
        time.sleep(args.cooldown_s + 1.0)  # the launcher restarted the master; the breakers probe again
        state = json.load(open(state_file))
        before = handoff_tokens(base)
        rows.append(phase(base, state, "after restart + cooldown", [text.format(200 + i) for i in range(args.requests)], model=args.config))
        rows[-1]["store_served_prompt_tokens"] = handoff_tokens(base) - before
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    keys = list(rows[0])
    table = "\n".join(["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
                      + ["| " + " | ".join(f"{r.get(k):.1f}" if isinstance(r.get(k), float) else str(r.get(k))
                                           for k in keys) + " |" for r in rows])
    print(table, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fault_drill.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
