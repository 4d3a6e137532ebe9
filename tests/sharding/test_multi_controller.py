"""One model across processes, on JAX's multi-controller runtime with 2 processes x 4
CPU devices, every listener of the group on loopback (`python -m harness.multiprocess_engine_check`,
the sharded steps' check of `sharding.multiprocess_check` and then the engine's):

* the sharded steps: TP2/EP2 prefill over a rank in each process and DP8/EP8 decode over all
  eight devices give the logits, caches and greedy tokens of one process alone (and the oracle's);
* the serving engine as a process group: each process owns its devices' ranks (pools per rank)
  and serves requests of its own, the engines decode together over the whole mesh, and every
  request, through prefix hits, preemption and host-tier hits, gets the oracle's tokens."""

import json
import subprocess
import sys
import time

import psutil

from serving.launch import child_env, free_port


def _loopback(addr) -> bool:
    return addr.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _run_group(module: str, out, *extra: str) -> list[dict]:
    """Run `python -m module` as a 2-process group of 4 CPU devices each; (the listeners it opened,
    each process's JSON result)."""
    port = free_port()
    env = dict(child_env(), JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--cpu-devices",
                "4",
                "--out",
                str(out),
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    listeners = set()
    deadline = time.monotonic() + 300
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "the group did not finish"
            for p in procs:
                try:
                    listeners |= {
                        c.laddr for c in psutil.Process(p.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN
                    }
                except psutil.Error:
                    pass
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p in procs:
        assert p.wait() == 0, p.stdout.read()[-3000:]
    assert listeners and all(_loopback(a) for a in listeners), listeners  # the coordinator, gloo
    return [json.loads((out / f"process-{i}.json").read_text()) for i in range(2)]


def test_a_two_process_group_runs_the_sharded_steps_and_serves_as_one_engine(tmp_path):
    results = _run_group("harness.multiprocess_engine_check", tmp_path, "--ep", "2", "--engine-devices", "2")
    # the sharded steps
    for i, r in enumerate(results):
        assert (r["process"], r["processes"], r["devices"], r["local_devices"]) == (i, 2, 8, 4)
        assert r["prefill_ranks"] == [0, 1]  # the prefill mesh spans the two processes
        assert max(r["logit_errors"]) < 1e-4 and r["cache_error"] < 1e-4, r
        assert r["tokens"] == r["ref_tokens"]
        assert [step[0] for step in r["tokens"]] == r["oracle_row0"]  # row 0: the no-cache oracle's tokens
    assert results[0]["tokens"] == results[1]["tokens"]
    # each process holds its own devices' decode rows (DP attention: the cache lives with its requests)
    assert results[0]["decode_rows_held"] == [0, 1, 2, 3] and results[1]["decode_rows_held"] == [4, 5, 6, 7]
    # the engine as the same group, on DP4/EP2 over two devices of each process: pools per rank,
    # each process its own requests
    engines = [r["engine"] for r in results]
    for i, r in enumerate(engines):
        assert r["ranks"] == list(range(2 * i, 2 * i + 2))  # its own devices' ranks
        assert r["pools_on_own_devices"] and r["released"]
        for req in r["requests"]:
            assert req["error"] is None and req["equal"], (i, req)  # the oracle's tokens
            assert req["rank"] in r["ranks"]
        assert all(r["sessions_kept_their_rank"])
        assert all(q["cached"] >= 32 for q in r["requests"] if q["kind"] in ("second", "third"))  # prefix hits
    busy, idle = engines
    # process 0's ranks each preempted within their own pools and resumed from the host tier; its
    # evicted session came back from the host tier.  Process 1 decoded padding rows meanwhile.
    assert busy["preemptions"] >= 2 and busy["offloaded_resumes"] == busy["preemptions"]
    assert {q["rank"] for q in busy["requests"] if q["kind"] == "grown"} == {0, 1}
    assert [q["cached_host"] > 0 for q in busy["requests"] if q["kind"] == "third"] == [True]
    assert idle["preemptions"] == 0 and len(idle["requests"]) == 3
