"""`kimik3 worker --coordinator --num-processes --process-id` (issue 23): two worker processes of 2
CPU devices each form one DP4/EP4 engine on JAX's multi-controller runtime.  Each serves its own
HTTP requests on its own devices' ranks and the two decode together; their tokens are the
oracle's.  Killing one stops the other within the group's heartbeat (its clients' requests fail
rather than hang, and a router fails them over)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np

from kimik3 import config, model
from kimik3.generate import generate
from serving import internal_auth
from serving.launch import child_env, free_port, stop_process, wait_healthy

AUTH = internal_auth.headers(child_env()[internal_auth.ENV])


def _argv(i: int, coordinator: str, port: int) -> list[str]:
    return [sys.executable, "-m", "serving.worker", "--role", "both", "--port", str(port), "--config", "tiny",
            "--seed", "0", "--dtype", "float32", "--page-tokens", "16", "--kda-block-tokens", "64",
            "--prefill-chunk-tokens", "16", "--num-pages", "32", "--num-slots", "4", "--kernels", "reference",
            "--no-warmup", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i),
            "--cpu-devices", "2", "--data-parallel-size", "4", "--enable-expert-parallel",
            "--group-heartbeat-s", "5", "--worker-id", f"group-{i}"]


def _generate(url: str, prompt: list[int], n: int, out: dict, key) -> None:
    with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}/generate", headers=AUTH,
                                                  json={"prompt": prompt, "max_tokens": n}) as r:
        events = [json.loads(line) for line in r.iter_lines() if line]
    out[key] = events


def test_two_worker_processes_serve_as_one_dp_engine_and_stop_together(tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    ports = [free_port(), free_port()]
    env = dict(child_env(), JAX_PLATFORMS="cpu")
    procs = []
    for i in range(2):
        log = open(tmp_path / f"worker-{i}.log", "w")
        procs.append(subprocess.Popen(_argv(i, coordinator, ports[i]), stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True))
        log.close()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc, 400)
        info = httpx.get(f"{urls[0]}/health", timeout=10).json()
        assert info["capacity"]["ranks"] == 2  # this process's two devices' ranks
        rng = np.random.default_rng(4)
        prompts = {(i, j): rng.integers(0, 256, 20 + 13 * j + 7 * i).tolist() for i in range(2) for j in range(2)}
        out: dict = {}
        threads = [threading.Thread(target=_generate, args=(urls[i], p, 6, out, (i, j)))
                   for (i, j), p in prompts.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=400)
        params = model.init_params(config.tiny(), jax.random.PRNGKey(0), "float32")  # the workers' weights
        for key, prompt in prompts.items():
            events = out[key]
            assert events[-1].get("done"), (key, events[-3:])
            tokens = [e["token"] for e in events if "token" in e]
            assert tokens == generate(params, config.tiny(), prompt, 6).tokens.tolist(), key
            assert events[-1]["worker"] == f"group-{key[0]}"
        # one process dies mid-request: the other fails its requests (retriable: a router fails them
        # over) and stops, instead of waiting on it forever
        long = threading.Thread(target=_generate, args=(urls[0], prompts[(0, 0)], 200, out, "long"))
        long.start()
        deadline = time.monotonic() + 120
        while httpx.get(f"{urls[0]}/load", timeout=10).json().get("running", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(procs[1].pid, signal.SIGKILL)
        long.join(timeout=120)
        assert out["long"][-1].get("error") and out["long"][-1]["retriable"], out["long"][-2:]
        assert procs[0].wait(timeout=120) != 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            stop_process(p, timeout_s=5)
    assert "process group step failed" in (tmp_path / "worker-0.log").read_text()
