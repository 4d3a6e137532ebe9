"""`kimik3.LLM`: offline inference gives what the server gives.

One `LLM("tiny")` (random weights from seed 0, the worker's defaults) serves every test.  Its
greedy tokens are the oracle's (`kimik3.generate.generate`, fp32: tiny is an fp32 config); its
prompt ids are the router's own rendering of the same request (`Router.parse`); its stop strings
cut the text where the text says; its streams join to its outputs; and a real `kimik3 launch
--config tiny` deployment answers the same prompts with the same tokens and text.
"""

import json
import os
import signal
import subprocess
import sys
import time
import tomllib

import httpx
import jax
import numpy as np
import pytest

import kimik3
from kimik3 import config, model
from kimik3.generate import generate
from serving import llm as llm_mod
from serving.launch import child_env, free_port

GREEDY = kimik3.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["Hello, Kimi!", "Tell a story"]  # one length: one oracle program
CONVERSATION = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
]


@pytest.fixture(scope="module")
def llm():
    return kimik3.LLM("tiny")


@pytest.fixture(scope="module")
def params():
    """The weights `LLM("tiny")` and `kimik3 worker --config tiny` build: tiny's from seed 0, fp32."""
    assert config.tiny().dtype == "float32"
    return model.init_params(config.tiny(), jax.random.PRNGKey(0), "float32")


@pytest.fixture(scope="module")
def router():
    """The router's request handling (validation, chat template, tokenizer), without workers."""
    from serving.router import Router, RouterConfig

    return Router(RouterConfig(decode=["http://127.0.0.1:9"], config="tiny"))


def test_import_kimik3_is_cheap_and_names_the_public_surface():
    code = "import sys, kimik3; print(kimik3.__version__); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    with open(os.path.join(os.path.dirname(kimik3.__file__), "..", "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert out == [version, "False"]
    assert kimik3.LLM is llm_mod.LLM and kimik3.SamplingParams is llm_mod.SamplingParams
    assert kimik3.get_config("tiny") == config.tiny() and kimik3.ModelConfig is config.ModelConfig
    assert kimik3.init_params is model.init_params and kimik3.forward is model.forward
    assert kimik3.generate.generate is generate  # the module, as `from kimik3 import generate` gives it
    assert set(kimik3.__all__) <= set(dir(kimik3))
    with pytest.raises(AttributeError):
        _ = kimik3.no_such_name


def test_greedy_generate_is_the_oracles_tokens_for_the_routers_prompt_ids(llm, params, router):
    ids = router.parse("completion", json.dumps({"model": "kimik3-tiny", "prompt": PROMPTS[1]})).prompt
    outs = llm.generate([*PROMPTS, ids], GREEDY)  # text prompts and a prompt of ids, in one batch
    assert [o.prompt for o in outs] == [*PROMPTS, None]
    for text, o in zip(PROMPTS, outs):
        body = json.dumps({"model": "kimik3-tiny", "prompt": text})
        assert list(o.prompt_token_ids) == router.parse("completion", body).prompt
    assert outs[2].prompt_token_ids == outs[1].prompt_token_ids and outs[2].token_ids == outs[1].token_ids
    for o in outs:
        assert list(o.token_ids) == generate(params, config.tiny(), list(o.prompt_token_ids), 8).tokens.tolist()
        assert o.text == llm.tokenizer.decode(o.token_ids) and o.finish_reason == "length" and o.logprobs is None
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == outs[0].token_ids  # one prompt, not a list


def test_chat_renders_the_conversation_as_the_router_does(llm, router):
    outs = llm.chat([CONVERSATION, CONVERSATION[1:2]], GREEDY)
    for conv, o in zip([CONVERSATION, CONVERSATION[1:2]], outs):
        want = router.parse("chat", json.dumps({"model": "kimik3-tiny", "messages": conv})).prompt
        assert list(o.prompt_token_ids) == want
        assert o.token_ids == llm.generate(want, GREEDY)[0].token_ids  # the oracle's (above)
        assert o.prompt == llm.tokenizer.decode(want, skip_special=False)
    assert llm.chat(CONVERSATION[1:2], GREEDY)[0] == outs[1]  # one conversation, not a list


def test_chat_images_reach_the_engine_as_the_router_sends_them(llm, router):
    import base64

    from tests.serving.test_router import png_data_url

    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    image = {"type": "image_url", "image_url": {"url": png_data_url(pixels)}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "look"}]}]
    prepared = llm._prepare("chat", messages, GREEDY)
    parsed = router.parse("chat", json.dumps({"model": "kimik3-tiny", "messages": messages}))
    assert prepared.ids == parsed.prompt and prepared.images.shape == (1, 16, 16, 3)
    assert prepared.images.tobytes() == base64.b64decode(parsed.images_b64[0])  # what the worker decodes


def test_stop_strings_and_stop_tokens_cut_the_text_as_the_server_does(llm):
    full = llm.generate(PROMPTS[0], kimik3.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = full.text
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = llm.generate(PROMPTS[0], kimik3.SamplingParams(temperature=0, max_tokens=24, stop=[stop, "\ufffe"]))[0]
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]  # the token that completed it included
    # a stop token: generation ends there, its own text left out
    tid = full.token_ids[4]
    at = full.token_ids.index(tid)
    by_id = llm.generate(PROMPTS[0], kimik3.SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tid]))[0]
    assert by_id.token_ids == full.token_ids[: at + 1] and by_id.finish_reason == "stop"
    assert by_id.text == llm.tokenizer.decode(full.token_ids[:at])


def test_stream_pieces_join_to_generates_text(llm):
    for sp in (GREEDY, kimik3.SamplingParams(seed=3, max_tokens=12, logprobs=2)):
        want = llm.generate(PROMPTS[0], sp)[0]
        stream = llm.stream(PROMPTS[0], sp)
        pieces = []
        while True:
            try:
                pieces.append(next(stream))
            except StopIteration as end:
                out = end.value
                break
        assert all(pieces) and "".join(pieces) == want.text
        assert out.token_ids == want.token_ids and out.finish_reason == want.finish_reason
    assert len(out.logprobs) == len(out.token_ids) and all(len(lp.top) == 2 for lp in out.logprobs)
    assert "".join(llm.stream_chat(CONVERSATION, GREEDY)) == llm.chat(CONVERSATION, GREEDY)[0].text
    # a stream closed early ends its request: the engine is left with nothing to do
    stream = llm.stream(PROMPTS[1], kimik3.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_work()


def test_sampling_defaults_are_the_servers(llm):
    from serving.openai_api import CompletionRequest, sampling_options

    server = sampling_options(CompletionRequest(model="kimik3-tiny", prompt="hi"))
    prep = llm._prepare("completion", "hi", None)
    assert {k: v for k, v in server.items() if k != "seed"} == {
        k: getattr(prep.sampling, k) for k in server if k != "seed"
    }
    assert prep.sampling.temperature == 1.0 and prep.sampling.top_p == 1.0 and prep.stop_at_eos
    assert prep.max_tokens == 256  # the router's default budget
    seeds = {llm._prepare("completion", "hi", None).sampling.seed for _ in range(4)}
    assert len(seeds) == 4  # a fresh seed per request
    # a given seed: the same sample each time
    sp = kimik3.SamplingParams(seed=11, max_tokens=10, top_k=20)
    assert llm.generate(PROMPTS[1], sp)[0].token_ids == llm.generate(PROMPTS[1], sp)[0].token_ids


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 2**31}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_values_the_server_refuses_are_a_valueerror_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        kimik3.SamplingParams(**kw)


def test_requests_the_server_refuses_are_a_valueerror_before_anything_runs(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hi", kimik3.SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="context length"):
        llm.generate("hi", kimik3.SamplingParams(max_tokens=llm.max_context))
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "wizard", "content": "hi"}])
    assert not llm.engine.has_work()


def test_bad_engine_options_are_a_valueerror_naming_them_before_weights_load(monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(llm_mod, "_load_params", no_weights)
    with pytest.raises(ValueError, match="num_pagez"):
        kimik3.LLM("tiny", num_pagez=64)
    with pytest.raises(ValueError, match="num_slots"):
        kimik3.LLM("tiny", num_slots=0)
    with pytest.raises(ValueError, match="scan_layers"):
        kimik3.LLM("tiny", scan_layers="sometimes")
    with pytest.raises(ValueError, match="role"):
        kimik3.LLM("tiny", role="prefill")
    with pytest.raises(ValueError, match="no_such_preset"):
        kimik3.LLM("no_such_preset")


def _launch(tmp_path):
    """`kimik3 launch --config tiny` started: one colocated worker (the worker's defaults, no
    warm-up: it compiles what requests need), no store, the router; (process, state file, base URL)."""
    port, state = free_port(), tmp_path / "state.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.launch", "--config", "tiny", "--port", str(port), "--prefill", "0"]
        + ["--decode", "1", "--no-store", "--gpus", "none", "--state-file", str(state)]
        + ["--log-dir", str(tmp_path / "logs"), "--worker-args=--no-warmup"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(child_env(), JAX_PLATFORMS="cpu"),
        start_new_session=True,
    )
    return proc, state, f"http://127.0.0.1:{port}"


def test_a_launched_servers_answers_are_llms(llm, tmp_path):
    """The same requests through a real `kimik3 launch --config tiny` (HTTP, router, worker process)
    and through `LLM("tiny")`: the same token ids, text and finish reasons, greedy and seeded."""
    proc, state, base = _launch(tmp_path)  # it starts while this process computes its own answers
    try:
        full = llm.generate(PROMPTS[0], kimik3.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        cases = [  # (kind, prompt or messages, sampling fields: the request's and SamplingParams')
            ("completion", PROMPTS[0], {"temperature": 0, "max_tokens": 8, "ignore_eos": True}),
            ("completion", PROMPTS[1], {"temperature": 0}),  # the server's budget: to the end of sequence or 256
            ("completion", PROMPTS[0], {"temperature": 0, "max_tokens": 24, "stop": full.text[3:5]}),
            ("chat", CONVERSATION, {"temperature": 0, "max_tokens": 12}),
            ("chat", CONVERSATION[1:2], {"seed": 5, "max_tokens": 12}),  # sampled at the default temperature 1
        ]
        ours = [
            (llm.chat if kind == "chat" else llm.generate)(item, kimik3.SamplingParams(**fields))[0]
            for kind, item, fields in cases
        ]
        deadline = time.monotonic() + 300
        while not state.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "launch did not come up"
            time.sleep(0.2)
        with httpx.Client(timeout=120) as c:
            for (kind, item, fields), want in zip(cases, ours):
                key = "messages" if kind == "chat" else "prompt"
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                r = c.post(base + path, json={"model": "kimik3-tiny", key: item, **fields})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                text = choice["message"]["content"] if kind == "chat" else choice["text"]
                got = (tuple(choice["token_ids"]), text, choice["finish_reason"])
                assert got == (want.token_ids, want.text, want.finish_reason), (kind, item, fields)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
