"""The oracle (no cache, fp32, full recompute) and the cached path agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import model, tokenizer
from kimik3.generate import generate


def _chat(cfg, n_images=0):
    msgs = [
        tokenizer.Message("system", "You are Kimi."),
        tokenizer.Message("user", "Describe the picture, then count to five.", n_images=n_images),
    ]
    return tokenizer.apply_chat_template(msgs, tokens_per_image=cfg.vit.tokens_per_image)


@pytest.mark.parametrize("n_images", [0, 1])
def test_cached_generate_equals_the_oracle_for_64_tokens(rng, tiny_cfg, tiny_params, n_images):
    images = rng.random((n_images, 16, 16, 3)).astype(np.float32) if n_images else None
    prompt = _chat(tiny_cfg, n_images)
    oracle = generate(tiny_params, tiny_cfg, prompt, 64, images=images, use_cache=False)
    cached = generate(tiny_params, tiny_cfg, prompt, 64, images=images, use_cache=True)
    np.testing.assert_array_equal(cached.tokens, oracle.tokens)
    # fp32 both ways, different summation orders (chunked prefill + recurrent decode against a
    # full chunked recompute): ~1e-5 at most steps, 3.6e-4 at the worst of these 128 (KDA's
    # gated state amplifies rounding); a bf16 or TF32 slip would be ~1e-2.
    np.testing.assert_allclose(cached.logits, oracle.logits, atol=5e-4, rtol=0)
    assert oracle.tokens.shape == (64,) and oracle.logits.shape == (64, tiny_cfg.vocab_size)


def test_oracle_runs_in_fp32_whatever_the_params_dtype(tiny_cfg, tiny_params):
    prompt = _chat(tiny_cfg)
    bf16 = model.cast_params(tiny_params, jnp.bfloat16)
    # The oracle casts to fp32 first: bf16 params give what their values give in fp32, exactly.
    ref = generate(model.cast_params(bf16, jnp.float32), tiny_cfg, prompt, 8)
    from_bf16 = generate(bf16, tiny_cfg, prompt, 8)
    assert from_bf16.logits.dtype == np.float32
    np.testing.assert_array_equal(from_bf16.tokens, ref.tokens)
    np.testing.assert_array_equal(from_bf16.logits, ref.logits)


def _sharpened_mla(cfg, params, q_gain: float = 4.0, out_gain: float = 6.0):
    """`params` with every MLA layer's queries scaled by q_gain (its q-latent norm) and its output
    by out_gain.  At random init MLA's attention is near uniform and its output small next to the
    residual stream, so its softmax scale hardly reaches the logits (a 25% error in it moves them
    by about as much as bf16 rounding does); sharpened and amplified, it does."""
    out = jax.tree_util.tree_map(lambda x: x, params)
    for i in range(cfg.n_layers):
        if cfg.mixer_kind(i) == "mla":
            mla = dict(out[f"layer_{i}"]["mla"])
            mla["q_norm"] = mla["q_norm"] * q_gain
            mla["w_o_hvd"] = mla["w_o_hvd"] * out_gain
            out[f"layer_{i}"] = dict(out[f"layer_{i}"], mla=mla)
    return out


# Max |cached - forward| over the 4 steps' logits in bf16 (same precision, another order), measured
# with `_sharpened_mla` over 16 param seeds: 0.027 to 0.071 (this fixture's: 0.027).  With the MLA
# decode's softmax scale off by 25% the same measure is 0.18 to 1.0.
BF16_CACHED_ATOL = 0.1


def test_bf16_cached_path_agrees_with_the_bf16_forward_at_every_step(tiny_cfg, tiny_params):
    """The cached path in bf16 (chunked prefill, then recurrent KDA and absorbed MLA decode
    steps) against the no-cache bf16 forward over the same tokens: the same precision, another
    order, so they agree to bf16 precision (`BF16_CACHED_ATOL`), and a decode step's attention
    that differs from the forward's (a wrong softmax scale) does not.  Its distance to the fp32
    oracle is not bounded here: a random model's bf16 routing flips at some positions (up to 1.2
    relative error in the no-cache forward itself)."""
    prompt = _chat(tiny_cfg)
    bf16 = model.cast_params(_sharpened_mla(tiny_cfg, tiny_params), jnp.bfloat16)
    cached = generate(bf16, tiny_cfg, prompt, 4, use_cache=True)
    seq = np.concatenate([prompt, cached.tokens[:3]])
    full = model.forward(bf16, tiny_cfg, jnp.asarray([seq]), kernels="reference")[0][0, len(prompt) - 1 :]
    np.testing.assert_allclose(cached.logits, np.asarray(full, np.float32), atol=BF16_CACHED_ATOL, rtol=0)


def test_bad_generate_arguments(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_params, tiny_cfg, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_params, tiny_cfg, [1, 2], 0)
    with pytest.raises(ValueError, match="context limit"):
        generate(tiny_params, tiny_cfg, [1] * tiny_cfg.max_seq_len, 1)


def test_cached_generate_through_the_pallas_kernels_equals_the_oracle(tiny_cfg, tiny_params, monkeypatch):
    """The GPU path (Pallas KDA prefill + fused decode; MLA: the prompt as a prefill chunk over
    the cache, `mla_prefill_chunk`, then the paged absorbed decode kernel; interpret mode
    here) keeps the oracle's tokens."""
    from pallas_kernels import kda, mla

    jax.clear_caches()  # a cached trace would bypass the spies below
    calls = []
    for module, name in [
        (kda, "chunk_kda"),
        (kda, "fused_recurrent_kda"),
        (mla, "mla_decode"),
        (mla, "mla_prefill_chunk"),
    ]:
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw)
        )
    prompt = _chat(tiny_cfg)
    oracle = generate(tiny_params, tiny_cfg, prompt, 12)
    cached = generate(tiny_params, tiny_cfg, prompt, 12, use_cache=True, kernels="pallas")
    assert {"chunk_kda", "fused_recurrent_kda", "mla_decode", "mla_prefill_chunk"} <= set(calls)
    np.testing.assert_array_equal(cached.tokens, oracle.tokens)
    np.testing.assert_allclose(cached.logits, oracle.logits, atol=1e-4, rtol=0)  # measured 1.8e-5 to 4.7e-5


def test_unknown_kernel_choice_raises(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="kernels"):
        generate(tiny_params, tiny_cfg, [1, 2], 1, use_cache=True, kernels="cuda")
