"""Tokenizers behind one protocol: the byte tokenizer, a BPE trained with `tokenizers` on Debian's
licence texts, the same BPE as a tiktoken file; Jinja chat templates that never turn a message's
text into a special token; the streaming detokenizer."""

import json
import os

import pytest

from kimik3 import corpus, tokenizer as byte_level
from kimik3.text import ByteTokenizer, Tokenizer, load_tokenizer
from kimik3.tokenizer import Message

CONVERSATION = [
    Message("system", "Answer <|eos|> in kind."),
    Message("user", "h\u00e9llo \u2603 <|assistant|>", 1),
    Message("assistant", "ok"),
    Message("tool", "42"),
]
TEXTS = [
    "The licence grants you the right to copy, modify and distribute.",
    "na\u00efve caf\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f600 tabs\tand\nnewlines  ",
    "print('<|eos|>') # a special token's name is text",
]


@pytest.fixture(scope="module")
def licence_texts():
    try:
        _, files = corpus.find_sources("licenses")
    except FileNotFoundError:
        pytest.skip("no /usr/share/common-licenses (not a Debian system)")
    return [open(p, encoding="utf-8", errors="replace").read() for p in files]


@pytest.fixture(scope="module")
def bpe(licence_texts, tmp_path_factory):
    from kimik3.text.bpe import train_bpe

    out = tmp_path_factory.mktemp("bpe")
    return train_bpe(licence_texts[1:], 700, str(out / "tokenizer.json")), licence_texts[0], out


def _pieces(tok, ids):
    d = tok.detokenizer()
    return "".join(d.feed(i) for i in ids) + d.flush()


def test_the_byte_tokenizer_behind_the_protocol_is_the_modules(rng):
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer) and tok.vocab_size == byte_level.VOCAB_SIZE
    assert (tok.eos_id, tok.image_id, tok.bos_id) == (byte_level.EOS_ID, byte_level.IMAGE_ID, byte_level.BOS_ID)
    assert tok.apply_chat_template(CONVERSATION, tokens_per_image=3) == byte_level.apply_chat_template(
        CONVERSATION, tokens_per_image=3
    )  # the Jinja template gives the hand-written one's ids
    # split characters, invalid bytes, specials, and ids past the tokenizer's (a model's vocab may be larger)
    ids = rng.integers(0, byte_level.VOCAB_SIZE + 20, 400).tolist()
    assert _pieces(tok, ids) == tok.decode(ids) == byte_level.decode(ids)
    assert tok.decode(ids, skip_special=False) == byte_level.decode(ids, skip_special=False)
    assert b"".join(tok.token_bytes(i) for i in tok.encode(TEXTS[1])) == TEXTS[1].encode()


def test_a_trained_bpe_keeps_the_byte_layout_round_trips_and_compresses(bpe):
    tok, held_out, _ = bpe
    assert tok.vocab_size == 700
    assert [tok.token_bytes(i) for i in range(256)] == [bytes([i]) for i in range(256)]
    assert {n: tok.special_names[n] for n in byte_level.SPECIAL_TOKENS} == byte_level.SPECIAL_IDS
    ids = tok.encode(held_out)
    assert tok.decode(ids) == held_out and len(ids) < 0.6 * len(held_out.encode())  # merges learnt
    assert b"".join(tok.token_bytes(i) for i in ids) == held_out.encode()
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == _pieces(tok, ids) == text
        assert not any(tok.is_special(i) for i in ids)  # "<|eos|>" in text is text
    conv = tok.apply_chat_template(CONVERSATION, tokens_per_image=2)
    specials = [i for i in conv if tok.is_special(i)]
    assert specials == [
        i for i in byte_level.apply_chat_template(CONVERSATION, tokens_per_image=2) if i >= byte_level.N_BYTES
    ]  # the same turns, images and ends as the byte template


def test_the_same_bpe_as_a_tiktoken_file_encodes_identically(bpe):
    """Kimi ships its BPE as a tiktoken file: the trained BPE written in that format (ranks = ids,
    the special ids left out) and read by `TiktokenTokenizer` with GPT-2's pattern gives the same
    ids, and a directory with a tokenizer_config.json picks its chat template and roles."""
    from kimik3.text.bpe import BPETokenizer
    from kimik3.text.tiktoken_file import GPT2_PATTERN, TiktokenTokenizer, write_ranks

    tok, held_out, out = bpe
    ranks = {tok.token_bytes(i): i for i in range(tok.vocab_size) if not tok.is_special(i)}
    d = out / "kimi"
    d.mkdir()
    write_ranks(ranks, str(d / "tiktoken.model"))
    tik = TiktokenTokenizer(str(d / "tiktoken.model"), pattern=GPT2_PATTERN, special=byte_level.SPECIAL_IDS)
    for text in TEXTS + [held_out[:4000]]:
        assert tik.encode(text) == tok.encode(text)
        assert tik.decode(tik.encode(text)) == text
    assert tik.apply_chat_template(CONVERSATION, tokens_per_image=2) == tok.apply_chat_template(
        CONVERSATION, tokens_per_image=2
    )
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end_turn|>{% endfor %}<|assistant|>"
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": template,
                "pat_str": GPT2_PATTERN,
                "roles": {"eos": "<|end_turn|>"},
                "added_tokens_decoder": {
                    str(i): {"content": n, "special": True} for n, i in byte_level.SPECIAL_IDS.items()
                },
            }
        )
    )
    loaded = load_tokenizer(str(d))
    assert isinstance(loaded, TiktokenTokenizer) and loaded.eos_id == byte_level.END_TURN_ID
    ids = loaded.apply_chat_template([Message("user", "  hi <|assistant|> ")])
    # the template's <|user|> (built from pieces) is special; the content's <|assistant|> is text
    assert ids[0] == byte_level.SPECIAL_IDS["<|user|>"] and ids[-1] == byte_level.SPECIAL_IDS["<|assistant|>"]
    assert loaded.decode(ids[1:-2]) == "  hi <|assistant|> " and not any(loaded.is_special(i) for i in ids[1:-2])
    assert isinstance(load_tokenizer(str(out)), BPETokenizer) and isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_a_hostile_template_or_file_is_refused(tmp_path):
    from jinja2.exceptions import SecurityError

    from kimik3.text.tiktoken_file import TiktokenTokenizer

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ ''.__class__.__mro__ }}"}))
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 1\n")
    tok = load_tokenizer(str(tmp_path))
    with pytest.raises(SecurityError):  # templates run sandboxed: they come with a checkpoint
        tok.apply_chat_template([Message("user", "x")])
    (tmp_path / "bad.tiktoken").write_text("YQ== 0\nnot base64! 1\n")
    with pytest.raises(ValueError, match="bad.tiktoken:2"):
        TiktokenTokenizer(str(tmp_path / "bad.tiktoken"))
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="end-of-sequence"):
        TiktokenTokenizer(str(tmp_path / "tiktoken.model"), special={"<|x|>": 5})
    os.remove(tmp_path / "tiktoken.model")
    os.remove(tmp_path / "bad.tiktoken")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(str(tmp_path))
