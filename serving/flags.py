"""The serving commands' shared flags: one per `EngineConfig` field, made from the dataclass, and
vLLM's option names that `kimik3 serve` and `kimik3 launch` read.

* `add_engine_flags(parser)`: a flag per field of `serving.engine_config.EngineConfig`, named as
  the field with dashes (``--prefill-chunk-tokens``), typed by its annotation (an ``int | None``
  field takes an integer; a bool field is a ``--x`` / ``--no-x`` pair), its default the
  dataclass's unless the worker sizes the field itself (`WORKER_DEFAULTS`), and its help the
  field's ``metadata["help"]`` (plus vLLM's aliases: ``--max-num-seqs`` for ``--num-slots``, ...).
  With ``forward=True`` (a launcher) every default is None: a flag left unset is not passed on.
* `engine_flag_argv(args)`: the engine flags a user set, as command-line words again (what a
  launcher hands each worker).
* `speculative_argv(text)`: vLLM's ``--speculative-config`` JSON as the worker's EAGLE-3 flags.
* `read_api_key(value)`: ``--api-key @FILE``, the key read from a file (a key written on a
  command line would show in the process list).

Building the flags imports no JAX (the choices are `serving.engine_config`'s own).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing

from serving.engine_config import EngineConfig

__all__ = [
    "WORKER_DEFAULTS",
    "add_engine_flags",
    "engine_flag_argv",
    "engine_fields",
    "flag_name",
    "read_api_key",
    "speculative_argv",
]

# Fields the worker sizes from its model, its pool and its other flags unless given: (default, what
# that default is).  Every other field's default is the dataclass's.
WORKER_DEFAULTS: dict[str, tuple[object, str]] = {
    "num_pages": (None, "256, or what --gpu-memory-utilization leaves after the weights"),
    "num_snapshots": (None, "4 per slot"),
    "page_tokens": (None, "the config's: 32 on tiny, else 128"),
    "kda_block_tokens": (None, "the config's: 128 on tiny, else 1536"),
    "max_pages_per_request": (None, "what --max-model-len needs, within the pool"),
    "prefill_chunk_tokens": (64, "64"),
    "namespace": (None, "config/dtype/weights"),
    "publish_to_host": (None, "on when the worker has a shared store"),
    "draft_tokens": (None, "3 with --speculative eagle3, else 0"),
    "eos_id": (None, "the tokenizer's"),
}


def engine_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(EngineConfig))


def flag_name(field: str) -> str:
    """``max_step_tokens`` -> ``--max-step-tokens``."""
    return "--" + field.replace("_", "-")


def _base_type(annotation) -> type:
    """int, str or bool from a field's annotation (``int | None`` -> int)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if base not in (int, str, bool):
        raise TypeError(f"no flag type for {annotation!r}")
    return base


def add_engine_flags(
    parser: argparse.ArgumentParser,
    *,
    defaults: dict[str, tuple[object, str]] | None = None,
    skip: tuple[str, ...] = (),
    forward: bool = False,
) -> argparse._ArgumentGroup:
    """Add one flag per `EngineConfig` field (but `skip`) to `parser`, in a group of their own.
    defaults: field -> (default, its description) where the consumer's default is not the
    dataclass's (`WORKER_DEFAULTS` for a worker).  forward: every flag defaults to None and its
    help names the default the worker takes, so that only the flags a user set are passed on
    (`engine_flag_argv`).  Returns the group."""
    defaults = WORKER_DEFAULTS if defaults is None else defaults
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group(
        "engine (serving.engine_config.EngineConfig)" + (": passed to every worker" if forward else "")
    )
    for f in engine_fields():
        if f.name in skip:
            continue
        kind = _base_type(hints[f.name])
        if f.name in defaults:
            default, described = defaults[f.name]
        else:
            default = None if f.default is dataclasses.MISSING else f.default
            described = None if default is None else {True: "on", False: "off"}.get(default, str(default))
        help_ = f.metadata.get("help") or f.name.replace("_", " ")
        if forward:
            help_ += f" (default: the worker's, {described})" if described else " (default: the worker's)"
            default = None
        elif f.name in defaults:
            help_ += f" (default: {described})"
        names = [flag_name(f.name), *f.metadata.get("aliases", ())]
        if kind is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            group.add_argument(
                *names,
                dest=f.name,
                type=kind,
                default=default,
                choices=f.metadata.get("choices"),
                metavar=None if f.metadata.get("choices") else ("N" if kind is int else "NAME"),
                help=help_,
            )
    return group


def engine_flag_argv(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    """The engine flags set in `args` (not None), as command-line words: ``--name value``, and
    ``--name`` / ``--no-name`` for a bool field."""
    out = []
    for f in engine_fields():
        value = getattr(args, f.name, None)
        if f.name in skip or value is None:
            continue
        if isinstance(value, bool):
            out.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        else:
            out += [flag_name(f.name), str(value)]
    return out


# vLLM's --speculative-config keys this engine honours; any other key is refused by name
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens")
SPECULATIVE_METHODS = ("eagle3",)


def speculative_argv(text: str) -> list[str]:
    """vLLM's ``--speculative-config`` JSON (``{"method": "eagle3", "model": DRAFT_DIR,
    "num_speculative_tokens": K}``) as the worker's flags (``--speculative eagle3
    --draft-checkpoint DRAFT_DIR --draft-tokens K``).  ValueError naming what it cannot honour:
    malformed JSON, a key other than `SPECULATIVE_KEYS`, a method other than EAGLE-3, no draft."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError('--speculative-config takes a JSON object, e.g. {"method": "eagle3", "model": "DIR"}')
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: {', '.join(map(repr, unknown))} not supported (the keys are "
            f"{', '.join(SPECULATIVE_KEYS)})"
        )
    method = spec.get("method", "eagle3")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not supported (only eagle3)")
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError('--speculative-config needs "model": the EAGLE-3 draft\'s directory (`kimik3 train-eagle`)')
    argv = ["--speculative", method, "--draft-checkpoint", os.path.abspath(model)]
    k = spec.get("num_speculative_tokens")
    if k is not None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1; got {k!r}")
        argv += ["--draft-tokens", str(k)]
    return argv


def read_api_key(value: str) -> str:
    """The key of ``--api-key @FILE``: the file's one word.  A key itself on the command line is
    refused (any user sees it in the process list): ValueError saying what to pass instead."""
    if not value.startswith("@"):
        raise ValueError(
            "--api-key takes @FILE, a file holding the key (a key written on the command line shows "
            "in the process list); or set $KIMIK3_API_KEY"
        )
    path = value[1:]
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError as e:
        raise ValueError(f"--api-key {value}: {e.strerror or e}") from None
    if len(words) != 1:
        raise ValueError(f"--api-key {value}: the file must hold one key (found {len(words)} words)")
    return words[0]
