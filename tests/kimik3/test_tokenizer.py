"""Tokenizer: byte-level, lossless on text, deterministic chat template."""

import pytest

from kimik3 import tokenizer as tok


def test_text_round_trips_through_bytes():
    text = "Kimi-K3 ✓ naïve 日本語"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_chat_template_structure():
    msgs = [tok.Message("system", "be brief"), tok.Message("user", "hi", n_images=1)]
    ids = tok.apply_chat_template(msgs, tokens_per_image=4)
    assert ids[0] == tok.BOS_ID and ids[-1] == tok.SPECIAL_IDS["<|assistant|>"]
    assert ids.count(tok.IMAGE_ID) == 4 and ids.count(tok.END_TURN_ID) == 2
    assert tok.decode(ids, skip_special=False) == (
        "<|bos|><|system|>be brief<|end_turn|><|user|><|image_start|>"
        + "<|image|>" * 4
        + "<|image_end|>hi<|end_turn|><|assistant|>"
    )
    assert ids == tok.apply_chat_template(msgs, tokens_per_image=4)  # deterministic


def test_ids_beyond_the_tokenizer_render_as_unused():
    assert tok.decode([104, tok.VOCAB_SIZE + 3], skip_special=False) == f"h<|unused_{tok.VOCAB_SIZE + 3}|>"
    assert tok.decode([104, tok.VOCAB_SIZE + 3]) == "h"


def test_bad_messages_raise():
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([tok.Message("robot", "x")])
    with pytest.raises(ValueError, match="tokens_per_image"):
        tok.apply_chat_template([tok.Message("user", "x", n_images=1)])
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])
