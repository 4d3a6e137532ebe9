"""The byte-level tokenizer (`kimik3.tokenizer`) behind the `Tokenizer` protocol."""

from __future__ import annotations

from kimik3 import tokenizer as byte_level
from kimik3.text.base import BaseTokenizer


class ByteTokenizer(BaseTokenizer):
    """Ids 0..255 are the UTF-8 bytes, `kimik3.tokenizer.SPECIAL_TOKENS` follow."""

    name = "byte"
    vocab_size = byte_level.VOCAB_SIZE
    special_names = dict(byte_level.SPECIAL_IDS)

    def encode(self, text: str) -> list[int]:
        return byte_level.encode(text)

    def _regular_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])
