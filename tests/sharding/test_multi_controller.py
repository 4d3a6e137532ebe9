"""One model across processes (issue 23): a group of 2 processes x 4 CPU devices on JAX's
multi-controller runtime runs TP2/EP2 prefill over a rank in each process and DP8/EP8 decode
over all eight devices, and gives the logits, caches and greedy tokens of one process alone
(and the oracle's); every listener of the group is on loopback."""

import json
import subprocess
import sys
import time

import psutil

from serving.launch import child_env, free_port


def _loopback(addr) -> bool:
    return addr.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def test_a_two_process_group_runs_the_sharded_steps_as_one_process_does(tmp_path):
    port = free_port()
    env = dict(child_env(), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "sharding.multiprocess_check", "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i), "--cpu-devices",
                               "4", "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    listeners = set()
    deadline = time.monotonic() + 300
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "the group did not finish"
            for p in procs:
                try:
                    listeners |= {c.laddr for c in psutil.Process(p.pid).net_connections("tcp")
                                  if c.status == psutil.CONN_LISTEN}
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
    results = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2)]
    for i, r in enumerate(results):
        assert (r["process"], r["processes"], r["devices"], r["local_devices"]) == (i, 2, 8, 4)
        assert r["prefill_ranks"] == [0, 1]  # the prefill mesh spans the two processes
        assert max(r["logit_errors"]) < 1e-4 and r["cache_error"] < 1e-4, r
        assert r["tokens"] == r["ref_tokens"]
        assert [step[0] for step in r["tokens"]] == r["oracle_row0"]  # row 0: the no-cache oracle's tokens
    assert results[0]["tokens"] == results[1]["tokens"]
    # each process holds its own devices' decode rows (DP attention: the cache lives with its requests)
    assert results[0]["decode_rows_held"] == [0, 1, 2, 3] and results[1]["decode_rows_held"] == [4, 5, 6, 7]
