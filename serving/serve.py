"""`kimik3 serve MODEL`: one model behind the OpenAI API in one command, with vLLM's flag names.

    kimik3 serve tiny --port 8000 --max-model-len 1024 --max-num-seqs 8
    kimik3 serve runs/mini/checkpoint --api-key @key.txt --speculative-config \\
        '{"method": "eagle3", "model": "runs/eagle/draft", "num_speculative_tokens": 3}'

MODEL is a preset of `kimik3.config` (random weights), a `kimik3 train` / `kimik3 quantize`
checkpoint directory or a Hugging Face Kimi-Linear directory.  It runs `kimik3 launch` with one
colocated worker (role both) behind the router and no store (`--prefill 0 --decode 1`), the
router on `--host` (127.0.0.1 unless told) and `--port`, every other socket on 127.0.0.1, and
the children's logs on this terminal (each worker's stats line among them) unless `--log-dir`.
Every launch flag applies (`--prefill 1` gives a P/D pair, `--store` a Mooncake store).

vLLM's flags: `--host`, `--port`, `--served-model-name`, `--max-model-len`, `--max-num-seqs`
(`--num-slots`), `--max-num-batched-tokens` (`--max-step-tokens`), `--block-size`
(`--page-tokens`), `--enable-prefix-caching` / `--no-enable-prefix-caching`,
`--tensor-parallel-size`, `--data-parallel-size` (more devices than this machine has is a
one-line error naming the flag), `--enable-expert-parallel`, `--gpu-memory-utilization` (the
share of each GPU the worker's JAX may take), `--speculative-config` (EAGLE-3 only; other keys
are refused by name), `--api-key @FILE` (the key read from a file, or `$KIMIK3_API_KEY`: a key on
the command line shows in the process list, so it is refused) and `--log-stats-interval-s`.
Every `serving.engine_config.EngineConfig` field is a flag too (`serving.flags`).
"""

from __future__ import annotations

import argparse
import os
import sys

from kimik3 import config
from serving import launch
from serving.cli import standalone_main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launch.add_arguments(parser, serve=True)


def resolve_model(args) -> None:
    """MODEL -> `args.checkpoint` (a directory) or `args.config` (a preset); ValueError otherwise."""
    if os.path.isdir(args.model):
        args.checkpoint = args.model
    elif args.model in config.PRESETS:
        args.config = args.model
    else:
        raise ValueError(
            f"MODEL {args.model!r} is neither a directory (a kimik3 or Hugging Face checkpoint) nor a "
            f"preset of kimik3.config ({', '.join(sorted(config.PRESETS))})"
        )


def run(args) -> int:
    try:
        resolve_model(args)
    except ValueError as e:
        print(f"kimik3 serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    return launch.run(args, prog="kimik3 serve")


def main(argv=None) -> int:
    return standalone_main("kimik3 serve", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
