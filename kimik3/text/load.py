"""`load_tokenizer`: a tokenizer from "byte", a file, or a checkpoint's directory, with the
directory's ``tokenizer_config.json`` read as transformers' ``AutoTokenizer`` reads it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from kimik3.text.base import BaseTokenizer
from kimik3.text.bpe import BPETokenizer
from kimik3.text.byte import ByteTokenizer
from kimik3.text.tiktoken_file import DEFAULT_PATTERN, TiktokenTokenizer

log = logging.getLogger(__name__)

TIKTOKEN_NAMES = ("tiktoken.model",)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' names
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens a chat template sees
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _json(path: str) -> dict:
    """A JSON object file ({} where there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a JSON object")
    return obj


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _token_name(value) -> str | None:
    """A token entry of tokenizer_config.json or special_tokens_map.json: a name, or {"content": name}."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) and value else None


@dataclasses.dataclass
class TokenizerConfig:
    """What a tokenizer directory says beside its tokenizer file.

    chat_template: the template (None: the project's default).  added_tokens: id -> entry
    ({"content", "special", ...}: ``added_tokens_decoder``).  token_names: the named special
    tokens (``eos_token`` -> "</s>", ...; None where no config names any).  roles: the project's
    role -> name map (``"roles"``), applied under the named tokens.  eos_token_id: the model's end
    of sequence (``generation_config.json``, else ``config.json``).  pat_str: a tiktoken file's
    pre-tokenizer pattern."""

    chat_template: str | None = None
    added_tokens: dict[int, dict] = dataclasses.field(default_factory=dict)
    token_names: dict[str, str] | None = None
    roles: dict[str, str] = dataclasses.field(default_factory=dict)
    eos_token_id: int | None = None
    pat_str: str | None = None

    def role_names(self) -> dict[str, str]:
        """role -> special token name: the "roles" map, with bos, eos and pad from the named
        tokens over it (the named tokens are the standard; "roles" fills what they leave)."""
        roles = dict(self.roles)
        for role in ("bos", "eos", "pad"):
            name = (self.token_names or {}).get(f"{role}_token")
            if name:
                roles[role] = name
        return roles

    def kwargs(self) -> dict:
        """The backend constructors' shared keyword arguments."""
        return {
            "chat_template": self.chat_template,
            "roles": self.role_names(),
            "eos_token_id": self.eos_token_id,
            "token_names": self.token_names,
        }


def read_config(directory: str) -> TokenizerConfig:
    """A tokenizer directory's configuration, as transformers reads it:

    * ``tokenizer_config.json``: ``added_tokens_decoder``, the named tokens (``bos_token``,
      ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``,
      ``mask_token``: a name or {"content": name}), ``chat_template`` (a string, or a list of
      {"name", "template"} of which "default" is used), and this project's ``"roles"`` and
      tiktoken ``"pat_str"``;
    * ``special_tokens_map.json`` (legacy): where tokenizer_config.json has no
      ``added_tokens_decoder``, its named tokens replace the config's;
    * ``chat_template.jinja`` and ``additional_chat_templates/NAME.jinja``: they take priority
      over the config's template (the first is the "default" one);
    * the model's end of sequence: ``generation_config.json``'s ``eos_token_id``, else
      ``config.json``'s (Kimi stops on <|im_end|>, not on its tokenizer's [EOS]); the first of a
      list."""
    cfg = _json(os.path.join(directory, "tokenizer_config.json"))
    out = TokenizerConfig(pat_str=cfg.get("pat_str"))
    decoder = cfg.get("added_tokens_decoder")
    if decoder is not None:
        if not isinstance(decoder, dict):
            raise ValueError(f"{directory}/tokenizer_config.json: added_tokens_decoder is not an object")
        out.added_tokens = {int(i): (t if isinstance(t, dict) else {"content": t}) for i, t in decoder.items()}
    named = {k: _token_name(cfg[k]) for k in NAMED_TOKENS if _token_name(cfg.get(k))}
    legacy = _json(os.path.join(directory, "special_tokens_map.json"))
    if decoder is None and legacy:
        named.update({k: _token_name(legacy[k]) for k in NAMED_TOKENS if _token_name(legacy.get(k))})
    if cfg or legacy:
        out.token_names = named
    roles = cfg.get("roles") or {}
    if not isinstance(roles, dict) or not all(isinstance(v, str) for v in roles.values()):
        raise ValueError(f'{directory}/tokenizer_config.json: "roles" must map roles to token names')
    out.roles = dict(roles)
    out.chat_template = _chat_template(directory, cfg.get("chat_template"))
    for name in ("generation_config.json", "config.json"):
        eos = _json(os.path.join(directory, name)).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int):
            out.eos_token_id = eos
            break
    return out


def _chat_template(directory: str, configured) -> str | None:
    """The default chat template: transformers' order (template files over the config's entry)."""
    templates = {}
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        try:
            templates = {t["name"]: t["template"] for t in configured}
        except (TypeError, KeyError):
            raise ValueError(
                f"{directory}/tokenizer_config.json: chat_template must be a string or a list of "
                '{"name", "template"} objects'
            ) from None
    elif configured is not None:
        raise ValueError(f"{directory}/tokenizer_config.json: chat_template must be a string or a list")
    files = {}
    extra = os.path.join(directory, CHAT_TEMPLATE_DIR)
    if os.path.isdir(extra):
        files = {
            n.removesuffix(".jinja"): _read(os.path.join(extra, n)) for n in os.listdir(extra) if n.endswith(".jinja")
        }
    if os.path.exists(os.path.join(directory, CHAT_TEMPLATE_FILE)):
        files["default"] = _read(os.path.join(directory, CHAT_TEMPLATE_FILE))
    templates = files or templates
    if not templates:
        return None
    if "default" not in templates:
        raise ValueError(
            f"{directory}: no chat template named 'default' among {sorted(templates)} (transformers' "
            "apply_chat_template would need one named)"
        )
    return templates["default"]


def load_tokenizer(spec: str | None) -> BaseTokenizer:
    """ "byte" (or None): `ByteTokenizer`; a ``tokenizer.json``: `BPETokenizer`; a ``*.tiktoken`` or
    ``tiktoken.model`` file: `TiktokenTokenizer`; a directory holding one of them.  The files
    beside it configure it as transformers' ``AutoTokenizer`` would (`read_config`): special
    tokens, the named bos / eos / pad tokens, the chat template.  Where they name none, the
    project's ``"roles"`` (role -> special token name, e.g. {"eos": "<|end_turn|>"}) and then
    `kimik3.tokenizer`'s names apply.  A tiktoken file's added tokens are the config's
    ``added_tokens_decoder`` (default: the byte tokenizer's names after its ranks), special where
    an entry says ``"special": true`` or is a named token; its pattern is ``"pat_str"``."""
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
    cfg = read_config(directory)
    if path.endswith(".json"):
        return BPETokenizer(path, added_tokens=cfg.added_tokens, **cfg.kwargs())

    special = added = None
    if cfg.added_tokens:  # an entry is special where it says so, or is a named token (transformers' rule)
        named = set((cfg.token_names or {}).values())
        special = {t["content"]: i for i, t in cfg.added_tokens.items() if t.get("special") or t["content"] in named}
        added = {t["content"]: i for i, t in cfg.added_tokens.items() if t["content"] not in special}
    return TiktokenTokenizer(path, pattern=cfg.pat_str or DEFAULT_PATTERN, special=special, added=added, **cfg.kwargs())


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
    do not fit the model's vocabulary.  A tokenizer without image tokens serves a model with a
    vision tower too: its text requests; an image request is then a ValueError naming the
    missing token (`ChatTemplate.render`)."""
    if spec is None:
        spec = checkpoint if checkpoint and holds_tokenizer(checkpoint) else "byte"
    tok = load_tokenizer(spec)
    if tok.vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer {tok.name} has {tok.vocab_size} ids; the model's vocabulary only {model_vocab_size}"
        )
    return tok
