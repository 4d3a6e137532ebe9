"""`load_tokenizer`: a tokenizer from "byte", a file, or a checkpoint's directory."""

from __future__ import annotations

import json
import os

from kimik3.text.base import BaseTokenizer
from kimik3.text.byte import ByteTokenizer

TIKTOKEN_NAMES = ("tiktoken.model",)


def _config(directory: str) -> dict:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    return cfg


def load_tokenizer(spec: str | None) -> BaseTokenizer:
    """"byte" (or None): `ByteTokenizer`; a ``tokenizer.json``: `BPETokenizer`; a ``*.tiktoken`` or
    ``tiktoken.model`` file: `TiktokenTokenizer`; a directory holding one of them.  A
    ``tokenizer_config.json`` beside it may give "chat_template" (Jinja), "roles" (role -> special
    token name, e.g. {"eos": "<|im_end|>"}), and for tiktoken files "pat_str" and
    "added_tokens_decoder" ({id: {"content": name, "special": true}}, Hugging Face's form)."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    if not os.path.exists(spec):
        raise FileNotFoundError(f"no tokenizer at {spec!r} (give 'byte', a tokenizer.json, a tiktoken file or a "
                                f"directory holding one)")
    if os.path.isdir(spec):
        directory, path = spec, _tokenizer_file(spec)
    else:
        directory, path = os.path.dirname(spec) or ".", spec
    if path is None:
        raise FileNotFoundError(f"{directory} holds no tokenizer.json, tiktoken.model or *.tiktoken")
    cfg = _config(directory)
    kw = {"chat_template": cfg.get("chat_template"), "role_names": cfg.get("roles")}
    if path.endswith(".json"):
        from kimik3.text.bpe import BPETokenizer

        return BPETokenizer(path, **kw)
    from kimik3.text.tiktoken_file import DEFAULT_PATTERN, TiktokenTokenizer

    special = None
    if "added_tokens_decoder" in cfg:
        special = {t["content"]: int(i) for i, t in cfg["added_tokens_decoder"].items() if t.get("special", True)}
    return TiktokenTokenizer(path, pattern=cfg.get("pat_str", DEFAULT_PATTERN), special=special, **kw)


def _tokenizer_file(directory: str) -> str | None:
    """The tokenizer file a directory holds: tokenizer.json, tiktoken.model, else the first *.tiktoken."""
    for name in ("tokenizer.json",) + TIKTOKEN_NAMES:
        if os.path.exists(os.path.join(directory, name)):
            return os.path.join(directory, name)
    found = sorted(n for n in os.listdir(directory) if n.endswith(".tiktoken"))
    return os.path.join(directory, found[0]) if found else None


def holds_tokenizer(directory: str) -> bool:
    return os.path.isdir(directory) and _tokenizer_file(directory) is not None


def load_serving_tokenizer(spec: str | None, checkpoint: str | None, model_vocab_size: int) -> BaseTokenizer:
    """The tokenizer a server uses: `spec` (`load_tokenizer`), or with None the checkpoint
    directory's own tokenizer when it holds one, else the byte tokenizer.  ValueError when its ids
    do not fit the model's vocabulary."""
    if spec is None:
        spec = checkpoint if checkpoint and holds_tokenizer(checkpoint) else "byte"
    tok = load_tokenizer(spec)
    if tok.vocab_size > model_vocab_size:
        raise ValueError(f"the tokenizer {tok.name} has {tok.vocab_size} ids; the model's vocabulary only "
                         f"{model_vocab_size}")
    return tok
