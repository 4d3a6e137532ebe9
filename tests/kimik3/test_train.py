"""`kimik3.corpus` and `kimik3.train`: a split that is a function of the text, and a short CPU run
on real Debian-shipped text that learns, checkpoints, and serves from its checkpoint."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import checkpoint, corpus, model, tokenizer, train


def _write(tmp_path, docs):
    for name, text in docs.items():
        (tmp_path / name).write_text(text)
    return str(tmp_path)


def test_the_split_is_by_block_deterministic_and_keeps_every_byte(tmp_path, rng):
    texts = {
        f"doc{i}.txt": "".join(chr(97 + c) for c in rng.integers(0, 26, 3 * corpus.BLOCK_BYTES + 17 * i))
        for i in range(12)
    }
    d = _write(tmp_path, texts)
    a, b = corpus.load(d, held_out_fraction=0.3), corpus.load(d, held_out_fraction=0.3)
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.held_out, b.held_out)
    assert a.held_out.size > 0 and a.train.size > 0 and a.documents == 12
    # every block once, EOS after each, and the ids are the tokenizer's
    total = sum(len(t) for t in texts.values())
    blocks = sum(-(-len(t) // corpus.BLOCK_BYTES) for t in texts.values())
    assert a.train.size + a.held_out.size == total + blocks
    assert (np.concatenate([a.train, a.held_out]) == tokenizer.EOS_ID).sum() == blocks
    first = a.train[: a.train.tolist().index(tokenizer.EOS_ID)]
    assert tokenizer.decode(first.tolist()) in "".join(texts.values())


def test_a_missing_corpus_names_what_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="python3.11-doc"):
        corpus.find_sources("python-doc", root=str(tmp_path))


def test_windows_come_in_full_batches_of_seq_len_plus_one():
    tokens = np.arange(1000, dtype=np.int32)
    ds = train.batches(tokens, 4, 31, seed=0)
    it = iter(ds.to_iter_dataset())
    seen = [next(it) for _ in range(20)]  # past one epoch (32 windows): reshuffled, never short
    assert all(b.shape == (4, 32) for b in seen)
    assert all((np.diff(b, axis=1) == 1).all() and (b[:, 0] % 31 == 0).all() for b in seen)
    with pytest.raises(ValueError, match="a batch needs 64"):
        train.batches(tokens, 64, 31, seed=0)


# `trained_tiny` (tests/conftest.py): trained once a run, shared with tests/kimik3/test_eagle.py
@pytest.fixture
def trained(trained_tiny):
    return trained_tiny


def test_a_short_run_on_real_text_lowers_the_held_out_loss(trained):
    tc, result, _ = trained
    # bytes of English start near ln(288) = 5.66 nats and a unigram model is ~3.1: 60 steps get past it
    assert result["initial_held_out_loss"] > 5.0 and result["held_out_loss"] < 3.0
    assert [e["step"] for e in result["evals"]] == [0, 30, 60]
    with open(os.path.join(tc.out, "train.json")) as f:
        assert json.load(f)["held_out_loss"] == result["held_out_loss"]
    assert os.path.getsize(os.path.join(tc.out, "loss.png")) > 0


def test_the_checkpoint_serves_the_trained_weights(trained, tiny_cfg):
    tc, result, params = trained
    restored, cfg = checkpoint.restore(result["checkpoint"])
    assert cfg == tiny_cfg
    toks = jnp.asarray([tokenizer.encode("The licence grants")], jnp.int32)
    want, _ = model.forward(params, cfg, toks)
    got, _ = model.forward(restored, cfg, toks)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # and it has learned English bytes: a space or a letter after "grants"
    assert chr(int(np.argmax(np.asarray(want)[0, -1]))) in " abcdefghijklmnopqrstuvwxyz,."


def test_train_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="warmup_steps"):
        train.TrainConfig(steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="batch"):
        train.TrainConfig(batch=0)
    with pytest.raises(ValueError, match="max_seconds"):
        train.TrainConfig(max_seconds=0)


def test_a_time_limit_the_set_up_used_up_stops_before_the_first_step_with_a_checkpoint(tmp_path):
    tc = train.TrainConfig(
        config="tiny",
        steps=500,
        batch=2,
        seq_len=16,
        eval_every=100,
        eval_batches=1,
        corpus="licenses",
        out=str(tmp_path),
        progress=False,
        max_seconds=1e-3,
    )
    result, _ = train.train(tc)
    assert result["stopped_early"] and result["steps_done"] == 0 and result["tokens"] == 0
    assert [e["step"] for e in result["evals"]] == [0] and result["history"] == []
    assert result["seconds"] >= result["setup_seconds"] > 1e-3
    checkpoint.restore(result["checkpoint"])


def test_a_copy_of_the_corpus_directory_splits_the_same(tmp_path, rng):
    texts = {f"d{i}.txt": "x" * int(rng.integers(1, 4 * corpus.BLOCK_BYTES)) + str(i) for i in range(20)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = corpus.load(_write(tmp_path / "a", texts), held_out_fraction=0.2)
    b = corpus.load(_write(tmp_path / "b", texts), held_out_fraction=0.2)
    np.testing.assert_array_equal(a.held_out, b.held_out)
