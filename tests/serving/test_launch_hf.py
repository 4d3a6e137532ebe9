"""`kimik3 launch --model DIR` on a Hugging Face Kimi-Linear directory (Hub tensor names, sharded,
Kimi's tiktoken tokenizer layout and chat template): it serves chat completions under the
directory's name with the checkpoint's tokenizer, template and end-of-sequence id, and the tokens
are `generate`'s on those weights.  A broken directory is one line before anything starts."""

import json
import os
import signal
import subprocess
import sys

import httpx
import jax

from kimik3 import hf, model, tokenizer
from kimik3.generate import generate
from kimik3.text import load_tokenizer
from kimik3.text.tiktoken_file import write_ranks
from serving.launch import child_env, free_port, wait_healthy
from tests.kimik3.test_hf import small_kimi_linear

from .test_launch import _wait_for_state
from .test_router import CACHE_DIR, PAGE

# Kimi's special tokens after the ranks, and a template of its layout (<|im_user|>user<|im_middle|>...)
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ m.content }}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def kimi_directory(path, seed=5):
    """A random small Kimi-Linear in the Hub's layout with a Kimi-style tokenizer: (params, cfg)."""
    cfg = small_kimi_linear()
    params = model.init_params(cfg, jax.random.PRNGKey(seed), "float32")
    hf.save(str(path), params, cfg, names="hub", max_shard_bytes=20_000)
    write_ranks({bytes([i]): i for i in range(256)}, str(path / "tiktoken.model"))
    ids = {name: 256 + i for i, name in enumerate(SPECIALS)}
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": {str(i): {"content": n, "special": True} for n, i in ids.items()},
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "chat_template": TEMPLATE,
            }
        )
    )
    conf = json.loads((path / "config.json").read_text())
    conf.update(bos_token_id=ids["[BOS]"], eos_token_id=ids["<|im_end|>"])  # Kimi stops on <|im_end|>
    (path / "config.json").write_text(json.dumps(conf))
    return params, cfg


def _launch(model_dir, tmp_path, port, state_file):
    worker_args = (
        f"--dtype float32 --page-tokens {PAGE} --kda-block-tokens {4 * PAGE} --prefill-chunk-tokens 16 "
        f"--num-pages 48 --num-slots 2 --kernels reference --compile-cache {CACHE_DIR}"
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving.launch",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--prefill",
            "0",
            "--decode",
            "1",
            "--no-store",
            "--state-file",
            str(state_file),
            "--log-dir",
            str(tmp_path / "logs"),
            "--worker-args",
            worker_args,
            "--gpus",
            "none",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(child_env(), JAX_PLATFORMS="cpu"),
        start_new_session=True,
    )


def test_launch_serves_a_hf_directory_with_its_tokenizer_and_template(tmp_path):
    model_dir = tmp_path / "Kimi-Linear-small"
    model_dir.mkdir()
    params, cfg = kimi_directory(model_dir)
    tok = load_tokenizer(str(model_dir))
    assert tok.eos_id == 256 + SPECIALS.index("<|im_end|>") and tok.bos_id == 256
    messages = [tokenizer.Message("user", "hello Kimi")]
    prompt = tok.apply_chat_template(messages)
    assert prompt[:1] == [256 + SPECIALS.index("<|im_user|>")] and tok.decode(prompt) == "userhello Kimiassistant"
    want = generate(params, cfg, prompt, 5).tokens.tolist()
    port, state_file = free_port(), tmp_path / "state.json"
    proc = _launch(model_dir, tmp_path, port, state_file)
    try:
        _wait_for_state(proc, state_file)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, None, 30)
        assert [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]] == ["Kimi-Linear-small"]
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "Kimi-Linear-small",
                "messages": [{"role": "user", "content": "hello Kimi"}],
                "max_tokens": 5,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(prompt)  # the checkpoint's template and tokenizer
        assert body["choices"][0]["token_ids"] == want  # the checkpoint's weights
        assert body["choices"][0]["message"]["content"] == tok.decode(want)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_launch_refuses_a_broken_directory_in_one_line_before_starting(tmp_path):
    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    kimi_directory(model_dir)
    shard = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))[1]
    os.remove(model_dir / shard)
    proc = _launch(model_dir, tmp_path, free_port(), tmp_path / "state.json")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == [f"kimik3 launch: error: {model_dir / shard}: shard missing (named by {hf.INDEX})"], out
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "logs").exists()
