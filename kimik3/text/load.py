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
    """ "byte" (or None): `ByteTokenizer`; a ``tokenizer.json``: `BPETokenizer`; a ``*.tiktoken`` or
    ``tiktoken.model`` file: `TiktokenTokenizer`; a directory holding one of them.  A
    ``tokenizer_config.json`` beside it may give "chat_template" (Jinja), "roles" (role -> special
    token name, e.g. {"eos": "<|im_end|>"}), and for tiktoken files "pat_str" and
    "added_tokens_decoder" ({id: {"content": name, "special": true}}, Hugging Face's form)."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    if not os.path.exists(spec):
        raise FileNotFoundError(
            f"no tokenizer at {spec!r} (give 'byte', a tokenizer.json, a tiktoken file or a directory holding one)"
        )
    if os.path.isdir(spec):
        directory, path = spec, _tokenizer_file(spec)
    else:
        directory, path = os.path.dirname(spec) or ".", spec
    if path is None:
        raise FileNotFoundError(f"{directory} holds no tokenizer.json, tiktoken.model or *.tiktoken")
    cfg = _config(directory)
    kw = {
        "chat_template": cfg.get("chat_template") or _template_file(directory),
        "role_names": cfg.get("roles") or _hf_roles(directory, cfg),
    }
    if path.endswith(".json"):
        from kimik3.text.bpe import BPETokenizer

        return BPETokenizer(path, **kw)
    from kimik3.text.tiktoken_file import DEFAULT_PATTERN, TiktokenTokenizer

    special = None
    if "added_tokens_decoder" in cfg:
        special = {t["content"]: int(i) for i, t in cfg["added_tokens_decoder"].items() if t.get("special", True)}
    return TiktokenTokenizer(path, pattern=cfg.get("pat_str", DEFAULT_PATTERN), special=special, **kw)


def _template_file(directory: str) -> str | None:
    """A ``chat_template.jinja`` beside the tokenizer (where transformers writes the template)."""
    path = os.path.join(directory, "chat_template.jinja")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _token_name(value) -> str | None:
    """A tokenizer_config.json token entry: a name, or {"content": name}."""
    return value.get("content") if isinstance(value, dict) else value


def _hf_roles(directory: str, cfg: dict) -> dict[str, str] | None:
    """Roles of a Hugging Face model directory's special tokens: end of sequence is the model's
    ``eos_token_id`` (config.json; Kimi's <|im_end|>, not the tokenizer's [EOS]) where it names an
    added token, else tokenizer_config's ``eos_token``; beginning of sequence its ``bos_token``.
    None where neither says (the byte tokenizer's names then apply)."""
    names = {int(i): t["content"] for i, t in cfg.get("added_tokens_decoder", {}).items()}
    roles = {}
    model_cfg = os.path.join(directory, "config.json")
    if os.path.exists(model_cfg):
        with open(model_cfg, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and eos in names:
            roles["eos"] = names[eos]
    if "eos" not in roles and _token_name(cfg.get("eos_token")):
        roles["eos"] = _token_name(cfg["eos_token"])
    if _token_name(cfg.get("bos_token")):
        roles["bos"] = _token_name(cfg["bos_token"])
    return roles or None


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
        raise ValueError(
            f"the tokenizer {tok.name} has {tok.vocab_size} ids; the model's vocabulary only {model_vocab_size}"
        )
    return tok
