"""The `Tokenizer` protocol and what every backend shares: decoding through each id's bytes, the
streaming detokenizer, special-token parsing of template text, the chat template."""

from __future__ import annotations

import codecs
from typing import Protocol, Sequence, runtime_checkable

from kimik3.text.chat_template import ChatTemplate
from kimik3.text.specials import ROLES_OF_SPECIALS


@runtime_checkable
class Tokenizer(Protocol):
    """What serving needs of a tokenizer (`BaseTokenizer` implements all but the backend's core)."""

    name: str
    vocab_size: int  # ids lie in [0, vocab_size)
    specials: dict[str, int]  # role ("eos", "image", "user", ...: ROLES_OF_SPECIALS) -> id
    token_names: dict[str, str]  # transformers' special_tokens_map: "eos_token" -> its name, ...

    def encode(self, text: str) -> list[int]: ...  # plain text: special-token names stay text
    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def detokenizer(self) -> "IncrementalDetokenizer": ...
    def apply_chat_template(
        self, messages, *, tokens_per_image: int = 0, add_generation_prompt: bool = True
    ) -> list[int]: ...


class IncrementalDetokenizer:
    """Text from a stream of ids, a piece per id: bytes go through an incremental UTF-8 decoder (a
    character split over ids comes out whole with the id that completes it; invalid bytes are
    U+FFFD), special tokens (and ids past the tokenizer's, which a larger model vocabulary may
    emit) are left out.  The concatenated pieces plus `flush()` equal
    `decode(ids)`."""

    def __init__(self, tok: "BaseTokenizer"):
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_id: int) -> str:
        if self._tok.is_special(token_id) or token_id >= self._tok.vocab_size:  # as `decode` skips them
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class BaseTokenizer:
    """A tokenizer from a backend's core: `encode` (plain text), `_regular_bytes(id)` (the bytes
    of an id that is not special), `vocab_size` and `special_names` (name -> id).

    roles: role -> special token name over `ROLES_OF_SPECIALS` (a role whose name the tokenizer
    lacks has no id).  eos_token_id: the model's end of sequence (``generation_config.json`` /
    ``config.json``), which names the "eos" role where it is one of the special ids.
    token_names: transformers' ``special_tokens_map`` (``bos_token``, ``eos_token``, ... -> name),
    what a chat template sees under those names (None: bos, eos and pad as `roles` names them)."""

    name = "tokenizer"
    vocab_size: int
    special_names: dict[str, int]

    def __init__(
        self,
        chat_template: str | None = None,
        *,
        roles: dict[str, str] | None = None,
        eos_token_id: int | None = None,
        token_names: dict[str, str] | None = None,
    ):
        self._special_ids = {i: n for n, i in self.special_names.items()}
        self.role_names = {**ROLES_OF_SPECIALS, **(roles or {})}
        if eos_token_id is not None and eos_token_id in self._special_ids:
            self.role_names["eos"] = self._special_ids[eos_token_id]
        self.specials = {r: self.special_names[n] for r, n in self.role_names.items() if n in self.special_names}
        if "eos" not in self.specials:
            raise ValueError(
                f"{self.name}: no end-of-sequence token: {self.role_names['eos']!r} is not among its special "
                f"tokens (name one with eos_token in tokenizer_config.json)"
            )
        bad = [i for i in self._special_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"{self.name}: special ids {bad} lie outside the vocabulary [0, {self.vocab_size})")
        if token_names is None:
            token_names = {f"{r}_token": self.role_names[r] for r in ("bos", "eos", "pad") if r in self.specials}
        self.token_names = dict(token_names)
        self.template = ChatTemplate(self, chat_template)

    # ---- special tokens ----------------------------------------------------------------------
    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    @property
    def bos_id(self) -> int | None:
        return self.specials.get("bos")

    @property
    def eos_id(self) -> int:
        return self.specials["eos"]

    @property
    def image_id(self) -> int | None:
        """The image placeholder's id (None: the tokenizer has none)."""
        return self.specials.get("image")

    def encode_with_specials(self, text: str) -> list[int]:
        """Template text: every special token's name becomes its id, the rest is `encode`d (what
        transformers' ``tokenizer(text, add_special_tokens=False)`` gives)."""
        out, i = [], 0
        names = sorted(self.special_names, key=len, reverse=True)
        while i < len(text):
            j = min((k for k in (text.find(n, i) for n in names) if k >= 0), default=len(text))
            if j > i:
                out += self.encode(text[i:j])
            if j == len(text):
                break
            name = next(n for n in names if text.startswith(n, j))
            out.append(self.special_names[name])
            i = j + len(name)
        return out

    # ---- ids to text ---------------------------------------------------------------------------
    def _regular_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (a special token: its name's)."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            if token_id >= 0:  # a model's vocabulary may be larger than its tokenizer's
                return f"<|unused_{token_id}|>".encode()
            raise ValueError(f"negative token id {token_id}")
        name = self._special_ids.get(token_id)
        return name.encode() if name is not None else self._regular_bytes(token_id)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Ids back to text; invalid UTF-8 becomes U+FFFD; special tokens left out, or (skip_special
        False) written as their names."""
        parts, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 0:
                raise ValueError(f"negative token id {i}")
            if self.is_special(i) or i >= self.vocab_size:
                if not skip_special:
                    parts.append(buf.decode("utf-8", errors="replace"))
                    buf.clear()
                    parts.append(self.token_bytes(i).decode())
                continue
            buf += self._regular_bytes(i)
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    def apply_chat_template(
        self, messages, *, tokens_per_image: int = 0, add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of a conversation (`kimik3.tokenizer.Message`s) through the chat template."""
        return self.template.render(
            messages, tokens_per_image=tokens_per_image, add_generation_prompt=add_generation_prompt
        )

    def describe(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id, "image_id": self.image_id}
