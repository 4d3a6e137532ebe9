"""What each special token is for (its role: "eos", "user", "image", ...) and its name in the byte
tokenizer, the names a tokenizer's roles default to (`BaseTokenizer`, the chat template)."""

from __future__ import annotations

from kimik3 import tokenizer as byte_level

# What each special token is for -> its name in the byte tokenizer (the default names).
ROLES_OF_SPECIALS = {
    "pad": "<|pad|>",
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
    "end_turn": "<|end_turn|>",
    "image_start": "<|image_start|>",
    "image": "<|image|>",
    "image_end": "<|image_end|>",
}
assert tuple(ROLES_OF_SPECIALS.values()) == byte_level.SPECIAL_TOKENS
