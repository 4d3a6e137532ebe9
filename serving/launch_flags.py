"""`kimik3 launch`'s flags (`add_arguments`; with ``serve=True`` `kimik3 serve`'s) and the checks
of them that run before any child starts: the model directory (`check_model`), `--max-model-len`
against the model's positions (`check_max_model_len`) and the clients' keys (`check_api_keys`).
"""

from __future__ import annotations

import argparse
import os

from kimik3 import config
from serving import flags
from serving import router_auth
from serving.cli import SERVING_MANIFESTS
from serving.deployment_env import API_KEY_FILE_ENV


def add_arguments(parser: argparse.ArgumentParser, *, serve: bool = False) -> None:
    """launch's flags; `serve`: `kimik3 serve`'s (MODEL positional in place of --config /
    --checkpoint, one colocated worker and no store by default, logs to this terminal)."""
    _model_arguments(parser, serve)
    _device_arguments(parser)
    _process_arguments(parser, serve)
    flags.add_engine_flags(parser, skip=("role",), forward=True)


def _model_arguments(parser: argparse.ArgumentParser, serve: bool) -> None:
    """The model, the router's address, the workers and what every worker serves."""
    if serve:
        parser.add_argument(
            "model",
            metavar="MODEL",
            help="a preset of kimik3.config (tiny, small, ...: random weights), a `kimik3 train` or "
            "`kimik3 quantize` checkpoint directory, or a Hugging Face Kimi-Linear directory",
        )
        parser.set_defaults(config="tiny", checkpoint=None, console_logs=True)
    else:
        parser.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
        parser.add_argument(
            "--checkpoint",
            "--model",
            dest="checkpoint",
            default=None,
            metavar="DIR",
            help="serve these weights: a Hugging Face Kimi-Linear directory, or `kimik3 train` / "
            "`kimik3 quantize`'s (overrides --config)",
        )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the router's bind address (every other socket stays on 127.0.0.1)",
    )
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0 if serve else 1,
        help="prefill workers" + (" (default: 0: the colocated worker prefills)" if serve else ""),
    )
    parser.add_argument(
        "--decode",
        type=int,
        default=1,
        help="decode workers (with no prefill workers: colocated workers, role both)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random weights from this seed (without --checkpoint)")
    parser.add_argument("--dtype", default=None, help="params dtype (default: the config's)")
    parser.add_argument(
        "--manifest",
        default=None,
        choices=SERVING_MANIFESTS,
        help="load --checkpoint's quantized weights as this manifest",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'byte', a tokenizer.json, a tiktoken file or a directory holding one, for the router "
        "and every worker (default: the checkpoint's if it has one, else 'byte')",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send, and the model_name of every vllm:* metric "
        "(default: a Hugging Face directory's name, else kimik3-<config>)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion of a request, on every worker (default: the model's positions)",
    )


def _device_arguments(parser: argparse.ArgumentParser) -> None:
    """Parallelism, speculative decoding, stats and the devices of the workers."""
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="prefill attention tensor-parallel over this many devices of each prefill (or colocated) worker "
        "(default 1)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=None,
        help="decode attention data-parallel over this many devices of each decode (or colocated) worker (default 1)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts over the same devices (EP = TP for prefill, DP for decode)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s speculative decoding options: {"method": "eagle3", "model": DRAFT_DIR, '
        '"num_speculative_tokens": K} (an EAGLE-3 draft from `kimik3 train-eagle`; other keys are refused)',
    )
    parser.add_argument(
        "--log-stats-interval-s",
        type=float,
        default=None,
        help="each worker logs a stats line this often: throughput, queue, KV use, prefix-cache hit "
        "rate (default: the worker's, 10; 0: never)",
    )
    parser.add_argument(
        "--gpus",
        default="auto",
        help="devices for the workers, in turn: ids (0,1,...), auto (every GPU nvidia-smi lists) or none",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="the share of each GPU its workers may take (split between workers on one GPU)",
    )
    parser.add_argument(
        "--decode-group",
        action="store_true",
        help="the decode workers form one process group: one DP / EP engine over all their devices "
        "(JAX's multi-controller runtime), each serving its own requests, all decoding together",
    )
    parser.add_argument(
        "--group-devices",
        type=int,
        default=1,
        help="devices per group member on CPU (--decode-group without GPUs); one GPU each on GPUs",
    )


def _process_arguments(parser: argparse.ArgumentParser, serve: bool) -> None:
    """The store and Redis, extra worker and router options, the clients' keys, restarts, state and logs."""
    if serve:
        parser.add_argument(
            "--store",
            dest="no_store",
            action="store_false",
            default=True,
            help="start a Mooncake store for the workers' KV (default: none: one worker needs none)",
        )
    else:
        parser.add_argument(
            "--no-store", action="store_true", help="no Mooncake store: decode workers recompute prompts"
        )
    parser.add_argument("--store-mb", type=int, default=512, help="Mooncake memory server size")
    parser.add_argument(
        "--redis",
        action="store_true",
        help="start a redis-server on 127.0.0.1 as the router's shared L1 fetch cache for image URLs",
    )
    parser.add_argument("--redis-mb", type=int, default=256, help="its memory (LRU past it)")
    parser.add_argument(
        "--worker-args", default="", help='extra worker options, after the others, e.g. "--num-pages 128"'
    )
    parser.add_argument("--router-args", default="", help='extra router options, e.g. "--max-inflight 8"')
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="@FILE",
        help="clients must send 'Authorization: Bearer KEY', KEY the one word in FILE (default: "
        "$KIMIK3_API_KEY); the router gets it in its environment, never on a command line",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="clients' keys, a line 'KEY TENANT' (or 'KEY') each (default: $KIMIK3_API_KEY_FILE; "
        "serving.router_auth); checked at start and handed to the router in its environment",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=600.0, help="wait this long for each child's health")
    parser.add_argument("--max-restarts", type=int, default=5, help="restarts of a child that exits on its own")
    parser.add_argument(
        "--restart-backoff-s",
        type=float,
        default=1.0,
        help="a child's second restart waits this long, each later one twice the one before (at most 30 s)",
    )
    parser.add_argument("--state-file", default=None, help="write URLs and pids here (JSON) once serving")
    parser.add_argument(
        "--log-dir",
        default=None,
        help="children's logs (default: " + ("this terminal)" if serve else "a new temp directory)"),
    )
    parser.add_argument("--log-level", default="warning", help="debug | info | warning | error")


def check_api_keys(args) -> None:
    """The clients' keys are read before any child starts: `--api-key @FILE` (`serving.flags.read_api_key`:
    a key written on the command line itself is refused) and an API key file (`--api-key-file` or
    $KIMIK3_API_KEY_FILE); a missing, unreadable or malformed file is one line here
    (`serving.router_auth.load_key_file`), not a router that never comes up."""
    if args.api_key:
        flags.read_api_key(args.api_key)
    path = args.api_key_file or os.environ.get(API_KEY_FILE_ENV)
    if path:
        try:
            router_auth.load_key_file(path)
        except OSError as e:
            raise ValueError(f"--api-key-file {path}: {e.strerror or e}") from None


def check_max_model_len(args) -> None:
    """--max-model-len within the model's positions (read from the preset or the checkpoint's
    config, without its weights): ValueError naming the flag, before any child starts."""
    n = args.max_model_len
    if n is None:
        return
    if n < 1:
        raise ValueError(f"--max-model-len must be >= 1; got {n}")
    if args.checkpoint:
        from kimik3 import checkpoint  # JAX and orbax: launch stays JAX-free until a checkpoint is read

        cfg = checkpoint.load_config(args.checkpoint)
    else:
        cfg = config.get_config(args.config)
    if n > cfg.max_seq_len:
        raise ValueError(f"--max-model-len {n} is past {cfg.name}'s {cfg.max_seq_len} positions")


def check_model(args) -> None:
    """A Hugging Face directory is validated from its headers before any child starts: a missing
    shard, an unknown tensor, a wrong shape or a corrupt header is one line here, not a worker
    that dies after the router is up (`kimik3.hf.check`)."""
    from kimik3 import hf  # JAX: launch stays JAX-free until a checkpoint is checked

    if args.checkpoint and hf.is_hf_dir(args.checkpoint):
        hf.check(args.checkpoint)
    elif args.checkpoint and not os.path.isdir(args.checkpoint):
        raise ValueError(f"--model / --checkpoint {args.checkpoint}: no such directory")
