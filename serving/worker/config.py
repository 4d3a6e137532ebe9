"""The worker's command line (`add_arguments`) and the constants its parts share.

The flags come in groups (the model and its weights; sizing and parallelism; the shared store;
serving), then one flag per `serving.engine_config.EngineConfig` field (`serving.flags`); their
order is the order `--help` lists them in.
"""

from __future__ import annotations

import argparse

from serving import flags
from serving.cli import SERVING_MANIFESTS

KEEPALIVE_S = 1.0  # a live worker's stream is never silent for longer (a router's read timeout relies on it)
EXIT_ENGINE_FAULT = 3  # the worker's exit code after an engine fault (its supervisor restarts it)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of `kimik3 worker` / ``python -m serving.worker`` on `parser`."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="the port to serve on")
    _add_model_arguments(parser)
    _add_sizing_arguments(parser)
    _add_store_arguments(parser)
    _add_serving_arguments(parser)
    flags.add_engine_flags(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model: its config or checkpoint, weights, tokenizer and speculative draft."""
    parser.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    parser.add_argument("--seed", type=int, default=0, help="random weights from this seed (every worker alike)")
    parser.add_argument("--dtype", default=None, help="params dtype (default: the config's)")
    parser.add_argument(
        "--checkpoint",
        "--model",
        dest="checkpoint",
        default=None,
        help="weights: a Hugging Face Kimi-Linear directory or `kimik3 train`'s (overrides --config)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'byte', a tokenizer.json, a tiktoken file or a directory holding one (default: the "
        "checkpoint's tokenizer if it has one, else 'byte'): its end-of-sequence id ends requests",
    )
    parser.add_argument(
        "--manifest",
        default=None,
        choices=SERVING_MANIFESTS,
        help="load --checkpoint's quantized weights (`kimik3 quantize`) as this manifest",
    )
    parser.add_argument(
        "--speculative",
        choices=("eagle3",),
        default=None,
        help="speculative decoding with an EAGLE-3 draft (colocated role 'both')",
    )
    parser.add_argument("--draft-checkpoint", default=None, metavar="DIR", help="the draft (`kimik3 train-eagle`)")
    parser.add_argument("--eagle-no-drop", action="store_true", help="the same as --eagle-tail no_drop")


def _add_sizing_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's sizing and parallelism flags, and a process group's."""
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="size the KV pool to fill this share of the memory JAX may use on the GPU (in place "
        "of --num-pages; under `kimik3 launch`, whose --gpu-memory-utilization already caps "
        "that memory, a share of the cap)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion a request may have (default: the config's positions)",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="prefill attention tensor-parallel over this many devices"
    )
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="decode attention data-parallel over this many devices"
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts over the same devices (EP = TP for prefill, DP for decode)",
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="join a process group (JAX's multi-controller runtime) whose process 0 serves the "
        "coordination service here; with --num-processes and --process-id.  The group serves "
        "as one DP engine: the decode mesh spans every process's devices, each process serves "
        "its own requests on its own devices' ranks, and all step together",
    )
    parser.add_argument("--num-processes", type=int, default=None, help="processes in the group")
    parser.add_argument("--process-id", type=int, default=None, help="this process's id in [0, num-processes)")
    parser.add_argument("--cpu-devices", type=int, default=None, help="devices per process on CPU (a group on CPU)")
    parser.add_argument(
        "--group-heartbeat-s",
        type=int,
        default=10,
        help="a group process silent this long is dead: the others stop too (their requests fail "
        "over at the router) and `kimik3 launch` restarts them",
    )


def _add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The shared store (Mooncake) and the deadline and breaker its calls run behind."""
    parser.add_argument("--mooncake-master", default=None, help="host:port of a mooncake_master (the shared store)")
    parser.add_argument("--mooncake-metadata", default=None, help="its HTTP metadata URL")
    parser.add_argument("--staging-mb", type=int, default=16, help="the store client's staging buffer")
    parser.add_argument(
        "--store-timeout-s",
        type=float,
        default=1.0,
        help="longest wait for one store call; one overrun opens the store's breaker",
    )
    parser.add_argument(
        "--store-cooldown-s",
        type=float,
        default=5.0,
        help="while the breaker is open, store lookups are misses; then one call probes",
    )


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker as a server: its name, queue, warm-up, stats line, logging."""
    parser.add_argument("--worker-id", default=None, help="its name in logs and metrics (default: ROLE-PORT)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model_name label of its vllm:* metrics, as the router's (default kimik3-<config>)",
    )
    parser.add_argument("--max-waiting", type=int, default=32, help="queued requests before answering 429")
    parser.add_argument("--no-warmup", action="store_true", help="compile step shapes lazily")
    parser.add_argument(
        "--log-stats-interval-s",
        type=float,
        default=10.0,
        help="log a line of throughput, queue, KV use and prefix-cache hit rate this often (0: never)",
    )
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="sleep after each engine step (testing)")
    parser.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache directory")
    parser.add_argument("--log-level", default="warning", help="debug | info | warning | error")
