"""A Hugging Face ``tokenizer.json`` (the `tokenizers` library) behind the `Tokenizer` protocol,
and `train_bpe`: a byte-level BPE trained on a corpus, laid out as the byte tokenizer extended.

The trained layout keeps ids 0..255 for the bytes and 256..266 for `kimik3.tokenizer`'s special
tokens (what the engine and the model know: <|eos|>, <|image|>, ...); the merges follow in the
order the trainer learnt them.  So a model sized for the byte tokenizer's ids keeps working, and
its vocab_size only has to cover the merges too.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Iterable

from kimik3 import tokenizer as byte_level
from kimik3.text.base import BaseTokenizer

log = logging.getLogger(__name__)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class BPETokenizer(BaseTokenizer):
    """A ``tokenizer.json``.  Special tokens: its added tokens marked special, as transformers
    reads them: `added_tokens` (``tokenizer_config.json``'s ``added_tokens_decoder``, id ->
    {"content", "special", "lstrip", ...}) re-marks the file's tokens, and a named token
    (`token_names`: eos_token, ...) the vocabulary holds is special too.  `roles`,
    `eos_token_id`, `token_names`: `BaseTokenizer`."""

    def __init__(
        self,
        path: str,
        *,
        chat_template: str | None = None,
        added_tokens: dict[int, dict] | None = None,
        roles: dict[str, str] | None = None,
        eos_token_id: int | None = None,
        token_names: dict[str, str] | None = None,
    ):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer  # on use: kimik3.text imports light

        self.name = f"bpe:{path}"
        self._tok = HFTokenizer.from_file(path)
        for i, entry in sorted((added_tokens or {}).items()):
            content = entry.get("content")
            if self._tok.token_to_id(content) != int(i):  # transformers would append it under a new id
                log.warning("%s: added token %r (id %s) is not in tokenizer.json; left out", path, content, i)
                continue
            fields = ("single_word", "lstrip", "rstrip", "normalized", "special")
            self._tok.add_tokens([AddedToken(content, **{k: bool(entry[k]) for k in fields if k in entry})])
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        for name in dict.fromkeys((token_names or {}).values()):  # transformers makes every named token special
            if name in added:
                continue
            if self._tok.token_to_id(name) is None:  # transformers would append it under a new id
                log.warning("%s: special token %r is not in its vocabulary; left out", path, name)
                continue
            self._tok.add_tokens([AddedToken(name, special=True)])
        self._tok.encode_special_tokens = True  # plain text: a special token's name is encoded as text
        # template text: special tokens' names are their ids (a second core: the flag is per tokenizer)
        self._template_tok = HFTokenizer.from_str(self._tok.to_str())
        self._template_tok.encode_special_tokens = False
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_names = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        for name in (token_names or {}).values():  # a named token that is a non-special added one
            if name in added:
                self.special_names.setdefault(name, self._tok.token_to_id(name))
        self._byte_level = "ByteLevel" in json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        vocab = self._tok.get_vocab(with_added_tokens=False)
        self._pieces = {i: p for p, i in vocab.items()}
        super().__init__(chat_template, roles=roles, eos_token_id=eos_token_id, token_names=token_names)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_specials(self, text: str) -> list[int]:
        return self._template_tok.encode(text, add_special_tokens=False).ids

    def _regular_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            return self._tok.decode([token_id], skip_special_tokens=False).encode()
        if self._byte_level:
            table = unicode_to_bytes()
            return bytes(table[c] for c in piece)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str) -> BPETokenizer:
    """Train a byte-level BPE of `vocab_size` ids on `texts` and write it to `out_path`
    (``tokenizer.json``): ids 0..255 the bytes, then `kimik3.tokenizer`'s special tokens, then the
    merges in the order they were learnt."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers  # on use, as above

    n_fixed = byte_level.VOCAB_SIZE
    if vocab_size <= n_fixed:
        raise ValueError(f"vocab_size must exceed the byte tokenizer's {n_fixed} ids; got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(byte_level.SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer)
    spec = json.loads(tok.to_str())
    learnt = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    vocab.update(byte_level.SPECIAL_IDS)  # in the model's vocabulary too, or the library renumbers them
    vocab.update((p, n_fixed + k) for k, (p, _) in enumerate(q for q in learnt if q[0] not in vocab))
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [
        {
            "id": i,
            "content": name,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for name, i in byte_level.SPECIAL_IDS.items()
    ]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    log.info(
        "trained a byte-level BPE of %d ids (%d merges) into %s", len(vocab), len(spec["model"]["merges"]), out_path
    )
    return BPETokenizer(out_path)
