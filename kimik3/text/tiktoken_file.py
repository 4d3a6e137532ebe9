"""A tiktoken-format BPE file (one "base64-token rank" line per token: Kimi's ``tiktoken.model``)
behind the `Tokenizer` protocol, through the `tiktoken` library."""

from __future__ import annotations

import base64
import binascii

from kimik3 import tokenizer as byte_level
from kimik3.text.base import ROLES_OF_SPECIALS, BaseTokenizer

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
    """A tiktoken file.  special: name -> id (default: `kimik3.tokenizer`'s names after the last
    rank); pattern: the pre-tokenizer's regex."""

    def __init__(
        self,
        path: str,
        *,
        pattern: str = DEFAULT_PATTERN,
        special: dict[str, int] | None = None,
        role_names: dict[str, str] | None = None,
        chat_template: str | None = None,
    ):
        import tiktoken

        ranks = read_ranks(path)
        first = max(ranks.values()) + 1
        if special is None:
            special = {name: first + i for i, name in enumerate(byte_level.SPECIAL_TOKENS)}
        clash = set(special.values()) & set(ranks.values())
        if clash:
            raise ValueError(f"{path}: special ids {sorted(clash)[:5]} are ranks of the file's tokens")
        self.name = f"tiktoken:{path}"
        self._enc = tiktoken.Encoding(self.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
        self.vocab_size = max(first, max(special.values(), default=-1) + 1)
        self.special_names = dict(special)
        self.role_names = dict(role_names or ROLES_OF_SPECIALS)
        self._ids = set(ranks.values())
        super().__init__(chat_template)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())  # names stay text

    def _regular_bytes(self, token_id: int) -> bytes:
        if token_id not in self._ids:  # a gap in the ranks
            return f"<|unused_{token_id}|>".encode()
        return self._enc.decode_single_token_bytes(token_id)


def write_ranks(ranks: dict[bytes, int], path: str) -> None:
    """A tiktoken file of `ranks` (token bytes -> rank)."""
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
