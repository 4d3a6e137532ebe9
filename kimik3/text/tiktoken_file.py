"""A tiktoken-format BPE file (one "base64-token rank" line per token: Kimi's ``tiktoken.model``)
behind the `Tokenizer` protocol, through the `tiktoken` library."""

from __future__ import annotations

import base64
import binascii

from kimik3 import tokenizer as byte_level
from kimik3.text.base import BaseTokenizer

# cl100k's pre-tokenizer pattern; a tokenizer_config.json's "pat_str" replaces it (Kimi's is its own)
DEFAULT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def read_ranks(path: str) -> dict[bytes, int]:
    """token bytes -> rank from a tiktoken file; ValueError naming the first bad line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error) as e:
                raise ValueError(f"{path}:{n}: not a 'base64-token rank' line ({e})") from None
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: two tokens share a rank")
    return ranks


class TiktokenTokenizer(BaseTokenizer):
    """A tiktoken file.  special: special token name -> id (default: `kimik3.tokenizer`'s names
    after the last rank); added: the other added tokens (name -> id; plain text holding one's name
    encodes to its id, as transformers' added tokens do); pattern: the pre-tokenizer's regex.
    `roles`, `eos_token_id`, `token_names`: `BaseTokenizer`."""

    def __init__(
        self,
        path: str,
        *,
        pattern: str = DEFAULT_PATTERN,
        special: dict[str, int] | None = None,
        added: dict[str, int] | None = None,
        chat_template: str | None = None,
        roles: dict[str, str] | None = None,
        eos_token_id: int | None = None,
        token_names: dict[str, str] | None = None,
    ):
        import tiktoken  # on use: kimik3.text imports light

        ranks = read_ranks(path)
        first = max(ranks.values()) + 1
        if special is None:
            special = {name: first + i for i, name in enumerate(byte_level.SPECIAL_TOKENS)}
        added = {n: i for n, i in (added or {}).items() if n not in special}
        every = {**special, **added}
        clash = set(every.values()) & set(ranks.values())
        if clash:
            raise ValueError(f"{path}: special ids {sorted(clash)[:5]} are ranks of the file's tokens")
        self.name = f"tiktoken:{path}"
        self._enc = tiktoken.Encoding(self.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=every)
        self._added = set(added)
        self.vocab_size = max(first, max(every.values(), default=-1) + 1)
        self.special_names = dict(special)
        self._ids = set(ranks.values()) | set(added.values())
        super().__init__(chat_template, roles=roles, eos_token_id=eos_token_id, token_names=token_names)

    def encode(self, text: str) -> list[int]:
        # special tokens' names stay text; other added tokens' names are their ids
        return self._enc.encode(text, allowed_special=self._added, disallowed_special=())

    def encode_with_specials(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all", disallowed_special=())

    def _regular_bytes(self, token_id: int) -> bytes:
        if token_id not in self._ids:  # a gap in the ranks
            return f"<|unused_{token_id}|>".encode()
        return self._enc.decode_single_token_bytes(token_id)


def write_ranks(ranks: dict[bytes, int], path: str) -> None:
    """A tiktoken file of `ranks` (token bytes -> rank)."""
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
