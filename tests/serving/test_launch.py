"""`kimik3 launch` brings up store + workers + router in one command and stops them all on SIGINT."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from serving.launch import child_env, free_port, wait_healthy

from .test_router import CACHE_DIR, PAGE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_for_state(proc, state_file, timeout_s: float = 400) -> dict:
    """The state file a launch writes once it serves (failing if it exits or takes too long)."""
    deadline = time.monotonic() + timeout_s
    while not state_file.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "launch did not come up"
        time.sleep(0.25)
    return json.loads(state_file.read_text())


def test_launch_serves_and_stops_everything_on_sigint(tmp_path):
    from cache.mooncake_tier import TierError, _binary

    try:
        _binary("mooncake_master")
    except TierError as e:
        if os.environ.get("KIMIK3_REQUIRE_MOONCAKE"):
            raise
        pytest.skip(f"Mooncake unavailable: {e}")
    # trained weights (here: tiny at another seed) served from a checkpoint, workers spread
    # over two (named) GPUs: the environment each is given says which
    import jax

    from kimik3 import checkpoint, config, model, tokenizer
    from kimik3.generate import generate

    cfg = config.tiny()
    checkpoint.save(tmp_path / "ckpt", model.init_params(cfg, jax.random.PRNGKey(7), "float32"), cfg)
    params, _ = checkpoint.restore(tmp_path / "ckpt")
    # and its own tokenizer: a BPE with the byte layout and 21 merges (tiny's 288 ids), which the
    # router and the workers pick up from the checkpoint's directory
    from kimik3 import corpus
    from kimik3.text.bpe import train_bpe

    _, files = corpus.find_sources("licenses")
    tok = train_bpe(
        [open(f, encoding="utf-8", errors="replace").read() for f in files],
        cfg.vocab_size,
        str(tmp_path / "ckpt" / "tokenizer.json"),
    )
    prompt = tok.apply_chat_template([tokenizer.Message("user", "launched the licence")])
    assert len(prompt) < len(tokenizer.apply_chat_template([tokenizer.Message("user", "launched the licence")]))
    want = generate(params, cfg, prompt, 4).tokens.tolist()  # what `kimik3 generate --checkpoint` prints
    port, state_file = free_port(), tmp_path / "state.json"
    worker_args = (
        f"--dtype float32 --page-tokens {PAGE} --kda-block-tokens {4 * PAGE} --prefill-chunk-tokens 16 "
        f"--num-pages 48 --num-slots 2 --kernels reference --compile-cache {CACHE_DIR}"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving.launch",
            "--config",
            "tiny",
            "--port",
            str(port),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--store-mb",
            "64",
            "--state-file",
            str(state_file),
            *(["--redis"] if shutil.which("redis-server") or os.environ.get("KIMIK3_REQUIRE_MOONCAKE") else []),
            "--log-dir",
            str(tmp_path / "logs"),
            "--worker-args",
            worker_args,
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--gpus",
            "0,1",
            "--gpu-memory-utilization",
            "0.8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(child_env(), JAX_PLATFORMS="cpu"),
        start_new_session=True,
    )
    try:
        state = _wait_for_state(proc, state_file)
        base = f"http://127.0.0.1:{port}"
        assert state["router"] == base + "/v1" and len(state["prefill"]) == len(state["decode"]) == 1
        assert {"router", "prefill-0", "decode-0", "mooncake_master", "mooncake_memory_server"} <= set(state["pids"])
        wait_healthy(base, None, 30)
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "kimik3-tiny",
                "messages": [{"role": "user", "content": "launched the licence"}],
                "max_tokens": 4,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)  # the BPE encoded the conversation
        assert r.json()["choices"][0]["token_ids"] == want  # the checkpoint's weights, not random ones
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)  # and detokenized the stream
        assert httpx.get(state["decode"][0] + "/health", timeout=10).json()["tokenizer"]["name"].startswith("bpe:")
        env_of = lambda pid: dict(
            kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv
        )
        assert [env_of(state["pids"][n]).get("CUDA_VISIBLE_DEVICES") for n in ("prefill-0", "decode-0", "router")] == [
            "0",
            "1",
            "",
        ]
        assert env_of(state["pids"]["decode-0"])["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8000"
        # every listening socket of the deployment is on loopback (the workers' and
        # the router's store clients and the memory server embed Mooncake's transfer engine, which
        # binds every interface unless `cache.loopback`'s shim is preloaded).
        import psutil

        listening = {
            name: {
                c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
            }
            for name, pid in state["pids"].items()
        }
        assert all(listening[n] for n in ("router", "prefill-0", "decode-0", "mooncake_memory_server")), listening
        assert "redis" in listening or not shutil.which("redis-server")  # the shared L1, on loopback too
        assert set().union(*listening.values()) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening
        # a store master that dies is restarted (and reaped), and the state
        # file follows the live pids.
        old_master = state["pids"]["mooncake_master"]
        os.kill(old_master, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while json.loads(state_file.read_text())["pids"]["mooncake_master"] == old_master:
            assert time.monotonic() < deadline, "the launcher did not restart the store's master"
            time.sleep(0.25)
        state = json.loads(state_file.read_text())
        assert not _alive(old_master) and _alive(state["pids"]["mooncake_master"])
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "kimik3-tiny",
                "messages": [{"role": "user", "content": "after the store restarted"}],
                "max_tokens": 3,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert f"kimik3: serving {tmp_path / 'ckpt'} at {base}/v1" in out
        assert "kimik3 launch: starting 2 worker(s)" in out and "kimik3 launch: decode-0 ready after" in out
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in state["pids"].values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [n for n, p in state["pids"].items() if _alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_workers_share_the_gpus_in_turn_and_split_the_memory_of_a_shared_one(tmp_path):
    import argparse

    from serving.launch import Deployment, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = lambda *a: parser.parse_args(["--log-dir", str(tmp_path), "--prefill", "2", "--decode", "1", *a])
    d = Deployment(args("--gpus", "3,5"))
    assert [d.worker_env(i) for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "3", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4500"},
        {"CUDA_VISIBLE_DEVICES": "5", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9000"},
        {"CUDA_VISIBLE_DEVICES": "3", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4500"},
    ]
    assert d._router_env()["CUDA_VISIBLE_DEVICES"] == ""
    assert Deployment(args("--gpus", "none")).worker_env(0) == {}


def test_the_api_key_reaches_the_router_in_its_environment_only(tmp_path, monkeypatch):
    """`kimik3 launch --api-key @FILE` (or $KIMIK3_API_KEY) hands the key to the router through its
    environment: no process list (argv) shows it, launch's own included (a key written on the
    command line itself is refused)."""
    import argparse

    from serving.launch import Deployment, add_arguments, check_api_keys

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv("KIMIK3_API_KEY", raising=False)
    (tmp_path / "key").write_text("s3cret\n")
    d = Deployment(parser.parse_args(["--port", "1", "--api-key", f"@{tmp_path / 'key'}", "--log-dir", str(tmp_path)]))
    assert d._router_env() == {"KIMIK3_API_KEY": "s3cret"}
    with pytest.raises(ValueError, match="--api-key takes @FILE"):
        check_api_keys(parser.parse_args(["--api-key", "s3cret"]))
    with pytest.raises(ValueError, match="one key"):
        (tmp_path / "two").write_text("a b")
        check_api_keys(parser.parse_args(["--api-key", f"@{tmp_path / 'two'}"]))
    monkeypatch.setenv("KIMIK3_API_KEY", "from-env")
    assert Deployment(parser.parse_args(["--port", "1", "--log-dir", str(tmp_path)]))._router_env() == {
        "KIMIK3_API_KEY": "from-env"
    }
    assert "s3cret" not in " ".join(d._worker_argv("decode", 0, 2))
    # one served model name for the router and the workers' vllm:* metrics
    named = Deployment(parser.parse_args(["--log-dir", str(tmp_path), "--served-model-name", "kimi"]))
    argv = named._worker_argv("decode", 0, 2)
    assert argv[argv.index("--served-model-name") + 1] == "kimi"


@pytest.mark.slow  # ~60-80 s of the 2-core suite; the group's engine is checked in tests/sharding/test_multi_controller.py
def test_a_decode_process_group_serves_through_the_router_and_restarts_as_one(tmp_path):
    """`--decode-group`: two decode workers of one CPU device each are one DP2/EP2 engine.
    Requests through the router get the oracle's tokens; when one member is killed mid-request,
    the other fails its requests (retriable) and stops, and the launcher restarts the whole group,
    which then serves again."""
    import threading

    import jax

    from kimik3 import config, model
    from kimik3.generate import generate
    from serving import internal_auth

    port, state_file = free_port(), tmp_path / "state.json"
    worker_args = (
        f"--dtype float32 --page-tokens {PAGE} --kda-block-tokens {4 * PAGE} --prefill-chunk-tokens 16 "
        f"--num-pages 16 --num-slots 2 --kernels reference --no-warmup --group-heartbeat-s 5"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving.launch",
            "--config",
            "tiny",
            "--port",
            str(port),
            "--prefill",
            "0",
            "--decode",
            "2",
            "--decode-group",
            "--group-devices",
            "1",
            "--no-store",
            "--gpus",
            "none",
            "--state-file",
            str(state_file),
            "--log-dir",
            str(tmp_path / "logs"),
            "--worker-args",
            worker_args,
            "--max-restarts",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(child_env(), JAX_PLATFORMS="cpu"),
        start_new_session=True,
    )
    params = model.init_params(config.tiny(), jax.random.PRNGKey(0), "float32")  # the workers' weights (seed 0)
    base = f"http://127.0.0.1:{port}"

    def complete(ids, n):
        r = httpx.post(
            base + "/v1/completions",
            timeout=300,
            json={"model": "kimik3-tiny", "prompt": ids, "max_tokens": n, "ignore_eos": True, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    try:
        state = _wait_for_state(proc, state_file)
        assert len(state["decode"]) == 2
        health = httpx.get(state["decode"][1] + "/health", timeout=10).json()
        assert health["capacity"]["ranks"] == 1  # its own device's rank of the group's two
        prompts = [list(range(3 + i, 40 + 5 * i)) for i in range(4)]
        got = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, complete(prompts[i], 5))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for i, p in enumerate(prompts):
            assert got[i] == generate(params, config.tiny(), p, 5).tokens.tolist(), i
        # decode-1 dies while decode-0 serves a long request: decode-0 fails it (retriable) and stops too
        auth = internal_auth.headers(child_env()[internal_auth.ENV])
        events = []

        def long_request():
            with (
                httpx.Client(timeout=300) as c,
                c.stream(
                    "POST",
                    state["decode"][0] + "/generate",
                    headers=auth,
                    json={"prompt": prompts[0], "max_tokens": 150},
                ) as r,
            ):
                events.extend(json.loads(line) for line in r.iter_lines() if line)

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 300
        while httpx.get(state["decode"][0] + "/load", timeout=10).json().get("running", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        old = {n: state["pids"][n] for n in ("decode-0", "decode-1")}
        os.killpg(old["decode-1"], signal.SIGKILL)
        t.join(120)
        assert events and events[-1].get("error") and events[-1]["retriable"], events[-2:]
        # the launcher restarts both members (new pids), and the group serves again
        deadline = time.monotonic() + 120
        while any(json.loads(state_file.read_text())["pids"][n] == old[n] for n in old):
            assert time.monotonic() < deadline, "the launcher did not restart the group"
            time.sleep(0.25)
        state = json.loads(state_file.read_text())
        for url in state["decode"]:
            wait_healthy(url, None, 300)
        assert complete(prompts[2], 4) == generate(params, config.tiny(), prompts[2], 4).tokens.tolist()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_launch_takes_serves_flags_and_hands_them_to_its_workers(tmp_path):
    """`kimik3 launch` reads the flags `kimik3 serve` does (vLLM's names, and every EngineConfig
    field generated from the dataclass) and passes those set to each worker, whose own parser
    reads them back; tensor parallelism goes to prefill workers, data parallelism to decode ones,
    both to a colocated worker; `--worker-args` still comes last and wins."""
    import argparse

    from serving import worker
    from serving.launch import Deployment, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = '{"method": "eagle3", "model": "/drafts/d", "num_speculative_tokens": 2}'
    common = ["--log-dir", str(tmp_path), "--max-model-len", "1024", "--max-num-seqs", "8", "--block-size", "16"]
    common += ["--prefill-chunk-tokens", "16", "--no-enable-prefix-caching", "--log-stats-interval-s", "5"]
    a = parser.parse_args(
        [*common, "--prefill", "0", "--speculative-config", spec, "--worker-args", "--num-slots 4", "--gpus", "none"]
    )
    d = Deployment(a)
    argv = d._worker_argv("decode", 0, 1234)
    w_parser = argparse.ArgumentParser()
    worker.add_arguments(w_parser)
    w = w_parser.parse_args(argv[3:])  # past `python -m serving.worker`
    assert (w.role, w.max_model_len, w.page_tokens, w.prefill_chunk_tokens, w.prefix_caching) == (
        "both",
        1024,
        16,
        16,
        False,
    )
    assert w.num_slots == 4 and w.log_stats_interval_s == 5  # --worker-args wins over --max-num-seqs 8
    assert (w.speculative, w.draft_checkpoint, w.draft_tokens) == ("eagle3", "/drafts/d", 2)
    assert "--num-pages" not in argv and "--prefill-batch" not in argv  # unset flags keep the worker's defaults
    # P/D on four GPUs: tp to the prefill worker, dp to the decode worker, each its own GPUs
    pd = Deployment(
        parser.parse_args([*common, "--gpus", "0,1,2,3", "--tensor-parallel-size", "2", "--data-parallel-size", "2"])
    )
    pre, dec = pd._worker_argv("prefill", 0, 1), pd._worker_argv("decode", 0, 2)
    assert "--tensor-parallel-size" in pre and "--data-parallel-size" not in pre
    assert "--data-parallel-size" in dec and "--tensor-parallel-size" not in dec
    assert [pd.worker_env(i)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0,1", "2,3"]
    pd.check()
    for argv, message in (
        (["--gpus", "none", "--data-parallel-size", "2"], "--data-parallel-size 2: a worker would span"),
        (["--gpus", "0", "--tensor-parallel-size", "2"], "--tensor-parallel-size 2"),
        (["--gpus", "none", "--speculative-config", spec], "colocated workers"),
    ):
        with pytest.raises(ValueError, match=message):
            Deployment(parser.parse_args([*common, *argv])).check()
