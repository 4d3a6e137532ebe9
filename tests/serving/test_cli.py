"""The command line: `kimik3 generate` and `kimik3 info` work as the README says."""

import os
import subprocess
import sys

from harness import commands
from serving import cli


def test_generate_prints_tokens_and_text(capsys):
    assert (
        cli.main(["generate", "--config", "tiny", "--prompt", "Hello", "--max-new-tokens", "5", "--random-images", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "tokens: [" in out and "text: " in out and "config=tiny" in out


def test_info_reports_kimi_k3_size(capsys):
    assert cli.main(["info", "--config", "kimi_k3"]) == 0
    out = capsys.readouterr().out
    assert "params        2," in out and "kimi_k3_mxfp4" in out


def test_bad_arguments_give_an_error_not_a_traceback(capsys):
    assert cli.main(["generate", "--config", "huge"]) == 2
    assert "unknown config" in capsys.readouterr().err


def test_console_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "serving.cli", "info", "--config", "tiny"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "layers        4 (3 KDA, 1 MLA)" in out.stdout


def test_commands_grow_gpu_memory_on_demand_unless_the_user_chose():
    """JAX reserves 75% of a GPU by default, ~3.4 GiB of host memory on an H200: the entry
    points (and the workers they start, through the environment) allocate on demand instead."""
    code = (
        "import os, sys; from serving import cli; cli.main(['info', '--config', 'tiny']); "
        "sys.stderr.write(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
    )
    for env, want in (({}, "false"), ({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, "true")):
        base = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**base, **env}
        )
        assert out.returncode == 0 and out.stderr.endswith(want), out.stderr[-500:]


def test_demo_runs_without_the_http_stack_and_serving_commands_say_what_is_missing(monkeypatch, capsys):
    """The GPU image has no fastapi: `kimik3 demo` must still parse, and `kimik3 router` must
    name the missing package instead of a traceback."""
    import importlib

    real = importlib.import_module

    def no_http(name, *a, **k):
        if name in ("serving.router", "serving.worker", "serving.launch"):
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", no_http)
    args = cli.build_parser("demo").parse_args(["demo", "--config", "tiny"])
    assert args.func is commands.run_demo
    assert cli.main(["router", "--port", "8000"]) == 2
    assert "needs the Python package 'fastapi'" in capsys.readouterr().err


def test_quantize_then_generate_and_info_by_manifest(tmp_path, capsys):
    """`kimik3 quantize` writes one checkpoint; `generate --manifest` loads it; a wrong pairing
    of checkpoint and manifest is a one-line error, not a traceback."""
    import jax

    from kimik3 import checkpoint, config, model, quantization

    cfg = config.tiny()
    checkpoint.save(tmp_path / "ckpt", model.init_params(cfg, jax.random.PRNGKey(0)), cfg)
    assert cli.main(["quantize", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "fp8_attn, mxfp8_attn" in out and "stored once each" in out
    assert (
        cli.main(["generate", "--checkpoint", str(tmp_path / "q"), "--manifest", "mxfp8_attn", "--max-new-tokens", "3"])
        == 0
    )
    assert "as mxfp8_attn" in capsys.readouterr().out
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "q")]) == 2
    assert "pass --manifest" in capsys.readouterr().err
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "q"), "--manifest", "fp8_attn_bf16_moe"]) == 2
    assert "--keep-bf16-experts" in capsys.readouterr().err
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--manifest", "fp8_attn"]) == 2
    assert "not a quantized checkpoint" in capsys.readouterr().err
    assert cli.main(["info", "--config", "small"]) == 0
    assert "mxfp8_attn" in capsys.readouterr().out
    # the CLI's manifest names (kept there so --help imports no model) are the library's
    assert cli.SERVING_MANIFESTS == quantization.SERVING_MANIFESTS
    assert set(cli.MANIFEST_NAMES) == set(quantization.MANIFESTS)


# In a fresh interpreter the HTTP stack is made unimportable (as on a machine without the `serve`
# extra), then the command runs; it reports which heavy modules it imported.
_WITHOUT_HTTP = """
import sys
for name in ("fastapi", "uvicorn", "httpx", "starlette"):
    sys.modules[name] = None  # `import fastapi` now raises ModuleNotFoundError
from serving import cli
try:
    rc = cli.main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print("IMPORTED", sorted(m for m in ("jax", "serving.router", "serving.worker", "sharding.plan") if m in sys.modules))
sys.exit(rc)
"""


def _without_http(*argv):
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_HTTP, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )


def test_help_and_info_run_without_the_http_stack_and_import_only_what_they_use():
    """`kimik3 --help` lists every command without importing one (no JAX, no fastapi);
    `kimik3 info` runs without fastapi; a serving command names the package it misses."""
    out = _without_http("--help")
    assert out.returncode == 0 and "launch" in out.stdout and "IMPORTED []" in out.stdout, out.stdout + out.stderr
    out = _without_http("info", "--config", "tiny")
    assert out.returncode == 0 and "params" in out.stdout and "serving.router" not in out.stdout, out.stderr
    out = _without_http("router", "--port", "1")
    assert out.returncode == 2 and "needs the Python package" in out.stderr and "[serve]" in out.stderr, out.stderr


def test_every_flag_has_help_and_v_works_after_the_command(capsys):
    """`kimik3 CMD --help` documents every flag; `-v` is accepted after the subcommand too."""
    import argparse

    for command in (
        "generate",
        "demo",
        "quantize",
        "coverage",
        "media-bench",
        "train",
        "eagle-ab",
        "train-eagle",
        "info",
        "plan",
        "router",
        "launch",
        "worker",
        "serve",
    ):
        parser = cli.build_parser(command)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        undocumented = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
        assert not undocumented, (command, undocumented)
    args = cli.build_parser("info").parse_args(["info", "--config", "tiny", "-v"])
    assert args.verbose and args.config == "tiny"
