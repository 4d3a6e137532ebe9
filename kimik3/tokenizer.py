"""Byte-level tokenizer with special tokens and a multi-turn chat template.

Ids 0..255 are the UTF-8 bytes; special tokens follow from 256.  Deterministic,
stateless, identical on every host.  Chat template, per message::

    <|role|> content-bytes <|end_turn|>

after one leading <|bos|>.  An image inside a message is
``<|image_start|> <|image|> * tokens_per_image <|image_end|>``; the ViT's
embeddings replace the <|image|> placeholders in order.  With
``add_generation_prompt`` the prompt ends in ``<|assistant|>``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end_turn|>",
    "<|image_start|>",
    "<|image|>",
    "<|image_end|>",
)
N_BYTES = 256
SPECIAL_IDS = {name: N_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = N_BYTES + len(SPECIAL_TOKENS)

PAD_ID = SPECIAL_IDS["<|pad|>"]
BOS_ID = SPECIAL_IDS["<|bos|>"]
EOS_ID = SPECIAL_IDS["<|eos|>"]
END_TURN_ID = SPECIAL_IDS["<|end_turn|>"]
IMAGE_ID = SPECIAL_IDS["<|image|>"]
IMAGE_START_ID = SPECIAL_IDS["<|image_start|>"]
IMAGE_END_ID = SPECIAL_IDS["<|image_end|>"]
ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Message:
    """One chat turn.  `n_images` images are placed before the text."""

    role: str
    content: str
    n_images: int = 0


def encode(text: str) -> list[int]:
    """UTF-8 bytes of `text` as ids (no special tokens)."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int], *, skip_special: bool = True) -> str:
    """Ids back to text; invalid UTF-8 becomes U+FFFD.

    Ids at or above VOCAB_SIZE (a model's vocabulary may be larger than the
    tokenizer's) render as ``<|unused_N|>``, or are skipped with `skip_special`.
    """
    out = bytearray()
    parts: list[str] = []
    for i in ids:
        i = int(i)
        if i < 0:
            raise ValueError(f"negative token id {i}")
        if i < N_BYTES:
            out.append(i)
        elif not skip_special:
            parts.append(out.decode("utf-8", errors="replace"))
            out.clear()
            parts.append(SPECIAL_TOKENS[i - N_BYTES] if i < VOCAB_SIZE else f"<|unused_{i}|>")
    parts.append(out.decode("utf-8", errors="replace"))
    return "".join(parts)


def token_bytes(i: int) -> bytes:
    """The bytes one id stands for: its byte, or a special token's name (``<|unused_N|>`` beyond the
    tokenizer's ids), as OpenAI's logprobs report a token's ``bytes``."""
    i = int(i)
    if i < 0:
        raise ValueError(f"negative token id {i}")
    if i < N_BYTES:
        return bytes([i])
    return (SPECIAL_TOKENS[i - N_BYTES] if i < VOCAB_SIZE else f"<|unused_{i}|>").encode()


def image_tokens(tokens_per_image: int) -> list[int]:
    return [IMAGE_START_ID] + [IMAGE_ID] * tokens_per_image + [IMAGE_END_ID]


def apply_chat_template(
    messages: Sequence[Message], *, tokens_per_image: int = 0, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids for a conversation (see the module docstring)."""
    ids = [BOS_ID]
    for m in messages:
        if m.role not in ROLES:
            raise ValueError(f"unknown role {m.role!r}; roles are {ROLES}")
        if m.n_images and tokens_per_image <= 0:
            raise ValueError("message has images but tokens_per_image is not set (the config has no ViT?)")
        ids.append(SPECIAL_IDS[f"<|{m.role}|>"])
        for _ in range(m.n_images):
            ids.extend(image_tokens(tokens_per_image))
        ids.extend(encode(m.content))
        ids.append(END_TURN_ID)
    if add_generation_prompt:
        ids.append(SPECIAL_IDS["<|assistant|>"])
    return ids
