"""The `kimik3` command line.

kimik3 generate --config tiny --prompt "Hello"      greedy generation
kimik3 info --config kimi_k3                         sizes of a config
kimik3 train --config mini --steps 3000 --out runs/mini
                                                     train on Debian-shipped text (held-out perplexity)
kimik3 train-tokenizer --vocab-size 4096 --out runs/bpe
                                                     a byte-level BPE (tokenizer.json) on Debian-shipped text
kimik3 train-eagle --checkpoint runs/mini/checkpoint --out runs/eagle
                                                     an EAGLE-3 draft head for a trained target
kimik3 generate --checkpoint C --draft-checkpoint D --draft-tokens 3
                                                     speculative decoding (reference): acceptance
kimik3 quantize --checkpoint runs/mini/checkpoint --out runs/mini/quantized
                                                     one checkpoint for the fp8_attn / mxfp8_attn manifests
kimik3 generate --checkpoint runs/mini/quantized --manifest fp8_attn
                                                     generation on the quantized weights
kimik3 coverage --engines 3                          cache coverage: GPU / + host / + shared store
kimik3 demo                                          the agent workload end to end, 4 serving setups
kimik3 plan --config kimi_k3 --prefill tp8,ep8 --decode dp16,ep16
                                                     memory per rank and bytes per collective
kimik3 worker --role prefill|decode|both --port N    one engine in its own process (HTTP)
kimik3 router --port N --prefill URL... --decode URL...
                                                     OpenAI-compatible, load-aware router
kimik3 launch --config tiny --port N --prefill 1 --decode 1
                                                     store + workers + router in one command
kimik3 serve tiny --port N --max-model-len 1024 --max-num-seqs 8
                                                     one model behind the OpenAI API, vLLM's flags
kimik3 bench serve --base-url URL --dataset-name random|multiturn|mt-bench
                                                     load an OpenAI server: vLLM's throughput and latencies
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import sys

from kimik3 import compile_cache

# the manifest names, here so that --help needs no model import (tests/serving check them against
# kimik3.quantization)
SERVING_MANIFESTS = ("fp8_attn", "mxfp8_attn", "fp8_attn_bf16_moe", "mxfp8_attn_bf16_moe")
MANIFEST_NAMES = ("bf16", "kimi_k3_mxfp4") + SERVING_MANIFESTS

PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


def gpu_memory_on_demand() -> None:
    """The command-line entry points grow GPU memory on demand instead of JAX's default of
    reserving 75% of the card up front: the reservation costs ~3.4 GiB of host memory on an H200
    (the driver's bookkeeping for ~104 GiB; RESULTS.md, serving), more than a `small` engine's
    whole working set, and every worker process on a host pays it.  Before any backend starts;
    a value the user set wins, and children inherit it."""
    os.environ.setdefault(PREALLOCATE_ENV, "false")


def standalone_main(prog: str, doc: str | None, add_arguments, run, argv=None) -> int:
    """`python -m serving.<module>`: the module's own arguments, logging at its --log-level, run."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    gpu_memory_on_demand()
    compile_cache.enable()
    return run(args)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help (unless the help names its default, or there is none
    to show: None, a switch); descriptions (module docstrings) keep their lines."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in help_.lower():
            return help_
        return super()._get_help_string(action)


# Every subcommand, in `kimik3 --help`'s order: (the module that owns it, its help line).  Only the
# module of the command being run is imported (the serving ones pull in the HTTP stack and JAX, the
# harnesses JAX), so `kimik3 --help`, `info`, ... start fast and run without fastapi; a missing
# package is named when its command is chosen.  A module owns one command (`add_arguments(parser)`,
# `run(args)`, its docstring the command's description) or several (`COMMANDS`: name -> (add
# arguments, run)).
COMMANDS = {
    "generate": ("serving.model_commands", "greedy generation from a config (random weights) or a checkpoint"),
    "demo": ("harness.commands", "the multi-turn agent workload end to end: colocated vs P/D, +/- host tier"),
    "quantize": ("serving.model_commands", "one quantized checkpoint for the fp8_attn and mxfp8_attn manifests"),
    "coverage": ("harness.commands", "replay the agent workload through the cache tiers"),
    "media-bench": ("harness.commands", "the media cache's ablation: TTFT and hit rates, none .. all four tiers"),
    "train": (
        "serving.model_commands",
        "train a config on Debian-shipped text: held-out perplexity, an orbax checkpoint",
    ),
    "train-tokenizer": ("serving.model_commands", "train a byte-level BPE (tokenizer.json) on Debian-shipped text"),
    "eagle-ab": ("harness.commands", "the EAGLE-3 tail-block A/B (drop / no-drop / exact) on two-turn MT-Bench"),
    "train-eagle": ("serving.model_commands", "train an EAGLE-3 draft head on a trained target's continuations"),
    "info": ("serving.model_commands", "parameter count and weight bytes of a config"),
    "serve": (
        "serving.serve",
        "serve a model behind the OpenAI API with vLLM's flags: a router and one colocated worker",
    ),
    "plan": ("sharding.plan", "memory per rank and bytes per collective of TP/EP prefill and DP/EP decode meshes"),
    "worker": ("serving.worker", "one engine in its own process, behind HTTP (health, load, drain)"),
    "router": ("serving.router", "OpenAI-compatible router over prefill/decode workers"),
    "launch": ("serving.launch", "a Mooncake store, prefill/decode workers and a router in one command"),
    "bench": (
        "serving.bench_serve",
        "benchmarks against a running server: `bench serve` loads an OpenAI server and reports vLLM's metrics",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `kimik3` parser; `command`: the subcommand being run (its module is imported and its
    arguments added; the other subcommands are listed without importing their modules)."""
    # no abbreviated options: `_command_of` finds the subcommand in argv before parsing
    parser = argparse.ArgumentParser(
        prog="kimik3", description=__doc__, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help=f"persistent XLA compilation cache (default ${compile_cache.ENV} or "
        f"{compile_cache.DEFAULT_DIR}; 'off' disables)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # every subcommand: -v after it too, defaults shown in --help, its docstring's layout kept
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    add = functools.partial(sub.add_parser, parents=[common], formatter_class=HelpFormatter)

    for name, (module_name, help_) in COMMANDS.items():
        if name != command:
            add(name, help=help_)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            p = add(name, help=f"{help_} (unavailable: needs {e.name})")
            p.set_defaults(func=functools.partial(_missing, name, e.name))
            continue
        if hasattr(module, "COMMANDS"):  # one of the module's commands
            add_arguments, run = module.COMMANDS[name]
            p = add(name, help=help_)
        else:
            add_arguments, run = module.add_arguments, module.run
            p = add(name, help=help_, description=module.__doc__)
        add_arguments(p)
        p.set_defaults(func=run)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in argv (the first word that is not an option or an option's value)."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--compile-cache":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def _missing(command: str, module: str, args) -> int:
    print(
        f"kimik3: error: `kimik3 {command}` needs the Python package {module!r}, which is not installed "
        f"(pip install 'kimik3[serve]', or ./run.sh test to set up the full environment)",
        file=sys.stderr,
    )
    return 2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args.func, "func", None) is not _missing:  # only an unavailable command takes anything
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    gpu_memory_on_demand()
    compile_cache.enable(args.compile_cache)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kimik3: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
