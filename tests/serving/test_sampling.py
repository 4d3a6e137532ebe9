"""Token choice: greedy is argmax; sampling follows the softmax, is reproducible per (seed, position)."""

import numpy as np
import pytest

from serving.sampling import GREEDY, SamplingParams, choose_token


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=2.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
    ],
)
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
    draws = (
        np.bincount(
            [choose_token(logits, SamplingParams(temperature=1.0, seed=0), p) for p in range(4000)], minlength=4
        )
        / 4000
    )
    np.testing.assert_allclose(draws, [0.5, 0.3, 0.15, 0.05], atol=0.03)  # ~4 sigma at n=4000
    nucleus = (
        np.bincount(
            [choose_token(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=0), p) for p in range(4000)],
            minlength=4,
        )
        / 4000
    )
    assert nucleus[2] == nucleus[3] == 0  # 0.5 + 0.3 reaches 0.7: the tail is cut
    np.testing.assert_allclose(nucleus[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)


def test_top_k_and_min_p_cut_the_distribution_and_top_p_applies_to_what_is_left():
    """vLLM's order: min-p, then top-k, then top-p on the renormalized rest."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    freq = lambda **kw: (
        np.bincount(
            [choose_token(logits, SamplingParams(temperature=1.0, seed=1, **kw), p) for p in range(3000)], minlength=4
        )
        / 3000
    )
    top2 = freq(top_k=2)
    assert top2[2] == top2[3] == 0
    np.testing.assert_allclose(top2[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.035)
    assert freq(top_k=1)[0] == 1.0 and freq(min_p=0.9)[0] == 1.0
    minp = freq(min_p=0.25)  # keeps p >= 0.125: the first three
    assert minp[3] == 0 and minp[2] > 0.1
    # top-p over the top-2 renormalized (0.625, 0.375): 0.6 is reached by the first alone; over the
    # whole distribution it would take two tokens
    assert freq(top_k=2, top_p=0.6)[0] == 1.0 and freq(top_p=0.6)[1] > 0.2
    assert np.array_equal(freq(top_k=-1), freq())  # vLLM's "off"


def test_rows_without_a_filter_draw_bit_for_bit_what_they_drew_before(rng):
    """Passing top_k 0 / min_p 0 arrays changes no draw (the decode step always passes them)."""
    import jax.numpy as jnp

    from serving.sampling import sample_tokens, seed_words

    logits = jnp.asarray(rng.standard_normal((6, 500)), jnp.float32)
    args = (
        logits,
        jnp.full(6, 0.8),
        jnp.asarray([1.0, 0.9, 0.5, 1.0, 0.7, 0.95], jnp.float32),
        jnp.asarray([seed_words(s) for s in range(6)], jnp.uint32),
        jnp.arange(6, dtype=jnp.int32),
    )
    plain = sample_tokens(*args, greedy=False)
    same = sample_tokens(*args, greedy=False, top_k_b=jnp.zeros(6, jnp.int32), min_p_b=jnp.zeros(6))
    assert np.array_equal(plain, same)


@pytest.mark.parametrize(
    "kw, words",
    [(dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p")],
)
def test_bad_filters_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)
