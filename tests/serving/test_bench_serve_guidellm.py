"""`kimik3 bench serve`'s numbers against an outside client's: guidellm (its CLI, a subprocess)
and our benchmark load the same `kimik3 serve tiny` at the same time, each one request at a time
(guidellm's synchronous profile, our max concurrency 1), greedy, with the same 16 chat requests
(24 to 72 characters in, 16 to 48 tokens out, ignore_eos; ours in another order), and report the
same request throughput, output token throughput and median TTFT within the tolerances below.

Why at the same time: the suite shares a 2-core machine with other tests, and back-to-back runs of
one client vary by 2 to 4x as that load comes and goes; two clients in one window see the same load.
Why in another order, of lengths that differ: two one-at-a-time clients of equal requests lock into
step, and the one that resends sooner (ours) always finds the engine idle while the other waits for
its prefill (guidellm's median TTFT came out 1.7 to 2.3 times ours in five of six such runs). Why
these prompts: guidellm times the first chunk that carries text, we (as vLLM) the first that carries
a token; tiny's random weights often start with a token of no text of its own (a UTF-8 lead byte, an
id past the byte tokenizer's), so the prompts are those whose greedy first token is text, where the
two definitions coincide.

Tolerances, from 14 runs of this setup on that machine while other suites ran (load average 6 to 14
on 2 cores), guidellm over ours: request and output token throughput 0.83 to 1.13; median TTFT 0.41
to 2.53 over prompt sets and orders (each client's reading of its first chunk waits for a CPU, and
which stream's prefill waits for the other's step follows from the order of lengths: this test's own
set gave 1.62 to 1.84 in its four runs, other sets went below 1 as often); two copies of our own
client in one window: 1.01 to 1.09 and 0.86 to 1.01. Against a server of fixed timing (first token
at 200 ms, then one every 10 ms) the two clients' median TTFTs agree within 4% (202 against 207 and
209 ms), so the spread is the machine's and the engine's. Throughput must agree within a factor of
1.5 and the median TTFT within 4, which a TTFT of another definition stays far outside (to the chat
stream's role chunk instead of the first token: ~1 ms against ~100 ms); the output token counts,
which no load moves, must be equal (counted as text chunks they would be about two in three).

guidellm comes with the ``reference`` extra; CI sets KIMIK3_REQUIRE_REFERENCE=1, so a missing
guidellm fails there instead of skipping.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from serving import bench_data, bench_serve

from .test_serve import KEY, MODEL, served  # noqa: F401  (the module's deployment: kimik3 serve tiny)

GUIDELLM = shutil.which("guidellm", path=os.path.dirname(sys.executable)) or shutil.which("guidellm")
if GUIDELLM is None and not os.environ.get("KIMIK3_REQUIRE_REFERENCE"):
    pytest.skip("guidellm is not installed (pip install -e '.[reference]')", allow_module_level=True)

REQUESTS = 16
THROUGHPUT_FACTOR = 1.5
TTFT_FACTOR = 4.0


def _text_first_prompts(base: str) -> list[bench_data.SampleRequest]:
    """REQUESTS chat requests (48 +- 24 random printable characters, 32 +- 16 tokens out) whose
    greedy first token is text."""
    kept = []
    candidates = bench_data.random_requests(8 * REQUESTS, 48, 32, endpoint=bench_data.CHAT, range_ratio=0.5, seed=7)
    for s in candidates:
        body = {"model": MODEL, "messages": s.prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(base + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, json=body, timeout=60)
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["message"]["content"]:
            kept.append(s)
        if len(kept) == REQUESTS:
            return kept
    pytest.fail(f"only {len(kept)} of {8 * REQUESTS} prompts start with a text token")


def _guidellm_argv(base: str, data: str, out: str) -> list[str]:
    # continuous_usage_stats: guidellm asks for vLLM's per-chunk usage, which this server refuses
    # by name (only its default, false, is served); the final usage chunk carries the counts
    backend = f"kind=openai_http,target={base},request_format=/v1/chat/completions,api_key={KEY}"
    backend += ",extras.body.stream_options.continuous_usage_stats=false,extras.body.temperature=0"
    return [
        GUIDELLM,
        "run",
        "--backend",
        backend,
        "--profile",
        "kind=synchronous",
        "--constraint",
        f"kind=max_requests,count={REQUESTS}",
        "--data",
        f"kind=json_file,path={data}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console",
    ]


def test_throughput_and_ttft_agree_with_guidellm_on_the_same_server_at_the_same_time(served, tmp_path):  # noqa: F811
    assert GUIDELLM, "KIMIK3_REQUIRE_REFERENCE is set: guidellm (the reference extra) must be installed"
    prompts = _text_first_prompts(served.base)
    data, out = tmp_path / "prompts.jsonl", tmp_path / "guidellm.json"
    data.write_text(
        "".join(
            json.dumps({"prompt": s.prompt[0]["content"], "output_tokens_count": s.output_len}) + "\n" for s in prompts
        )
    )
    worker = served.state["decode"][0]
    submitted = lambda: httpx.get(worker + "/health", timeout=10).json()["load"]["submitted"]
    target = bench_serve.Target(served.base, bench_data.CHAT, MODEL, KEY, ignore_eos=True, temperature=0.0)
    load = bench_serve.LoadConfig(max_concurrency=1, num_warmups=0)
    before = submitted()
    env = dict(os.environ, HF_HUB_OFFLINE="1", GUIDELLM__MAX_WORKER_PROCESSES="1")
    with open(tmp_path / "guidellm.log", "w") as log:
        proc = subprocess.Popen(_guidellm_argv(served.base, str(data), str(out)), stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 180
        while submitted() == before:  # ours starts with guidellm's first request
            assert proc.poll() is None, (tmp_path / "guidellm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "guidellm sent nothing in 180 s"
            time.sleep(0.01)
        half = REQUESTS // 2  # another order: the two clients' requests do not end in step
        ours = asyncio.run(bench_serve.benchmark(target, prompts[half:] + prompts[:half], load))
        assert proc.wait(180) == 0, (tmp_path / "guidellm.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    bench = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    theirs = {k: bench[k]["successful"] for k in bench if isinstance(bench[k], dict) and "successful" in bench[k]}
    assert theirs["request_totals"] == REQUESTS and ours["completed"] == REQUESTS
    assert (
        theirs["output_token_count"]["total_sum"] == ours["total_output_tokens"] == sum(s.output_len for s in prompts)
    )
    pairs = {
        "request throughput": (theirs["requests_per_second"]["mean"], ours["request_throughput"], THROUGHPUT_FACTOR),
        "output token throughput": (
            theirs["output_tokens_per_second"]["mean"],
            ours["output_throughput"],
            THROUGHPUT_FACTOR,
        ),
        "median TTFT": (theirs["time_to_first_token_ms"]["median"], ours["median_ttft_ms"], TTFT_FACTOR),
    }
    report = {name: f"guidellm {a:.3f}, ours {b:.3f}" for name, (a, b, _) in pairs.items()}
    print(report)  # the numbers compared, for the log
    for name, (a, b, factor) in pairs.items():
        assert 1 / factor <= a / b <= factor, (name, report)
