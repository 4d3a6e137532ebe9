"""Token choice: greedy is argmax; sampling follows the softmax, is reproducible per (seed, position)."""

import numpy as np
import pytest

from serving.sampling import GREEDY, SamplingParams, choose_token


@pytest.mark.parametrize("kw, words", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=2.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed")])
def test_out_of_range_parameters_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_greedy_is_argmax_and_a_tiny_nucleus_is_argmax_too(rng):
    logits = rng.standard_normal(300).astype(np.float32)
    assert choose_token(logits, GREEDY, 5) == int(np.argmax(logits))
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6, seed=3)
    assert all(choose_token(logits, nucleus, p) == int(np.argmax(logits)) for p in range(20))


def test_a_draw_depends_only_on_seed_and_position(rng):
    logits = rng.standard_normal(50)
    sp = SamplingParams(temperature=1.0, seed=11)
    a = [choose_token(logits, sp, p) for p in range(64)]
    assert a == [choose_token(logits, sp, p) for p in range(64)]
    assert a != [choose_token(logits, SamplingParams(temperature=1.0, seed=12), p) for p in range(64)]


def test_frequencies_follow_the_tempered_softmax_within_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    draws = np.bincount([choose_token(logits, SamplingParams(temperature=1.0, seed=0), p) for p in range(4000)],
                        minlength=4) / 4000
    np.testing.assert_allclose(draws, [0.5, 0.3, 0.15, 0.05], atol=0.03)  # ~4 sigma at n=4000
    nucleus = np.bincount([choose_token(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=0), p)
                           for p in range(4000)], minlength=4) / 4000
    assert nucleus[2] == nucleus[3] == 0  # 0.5 + 0.3 reaches 0.7: the tail is cut
    np.testing.assert_allclose(nucleus[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)
