"""The model: the cache makes pieces equal one shot; bad input is refused clearly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import model, tokenizer

# fp32 through 4 layers, max |diff| of the logits measured over 4 param and prompt seeds:
# different span lengths sum in different orders (prompt in pieces: 6.8e-5 to 1.5e-4)
LOGIT_ATOL = 2e-4
# the same spans, batched or alone (9.5e-7 to 3.5e-6)
BATCH_ATOL = 1e-5


def _prompt(rng, n, cfg):
    return rng.integers(0, tokenizer.N_BYTES, size=(1, n)).astype(np.int32)  # text, no placeholders


def test_prompt_in_pieces_through_the_cache_equals_one_shot(rng, tiny_cfg, tiny_params):
    toks = _prompt(rng, 150, tiny_cfg)
    full, _ = model.forward(tiny_params, tiny_cfg, toks)
    cache = model.init_cache(tiny_cfg, 1, 160, jnp.float32)
    pieces = []
    for lo, hi in [(0, 70), (70, 71), (71, 74), (74, 150)]:  # chunked, decode, absorbed, long naive
        logits, cache = model.forward(tiny_params, tiny_cfg, toks[:, lo:hi], cache=cache)
        pieces.append(logits)
    pieces = jnp.concatenate(pieces, 1)
    np.testing.assert_allclose(pieces, full, atol=LOGIT_ATOL, rtol=0)
    np.testing.assert_array_equal(pieces.argmax(-1), full.argmax(-1))
    assert int(cache["lengths"][0]) == 150


def test_logits_tail_gives_the_last_positions_logits_and_the_same_cache(rng, tiny_cfg, tiny_params):
    """A serving step asks for the last position's logits only; the cache it leaves is the same."""
    toks = _prompt(rng, 40, tiny_cfg)
    positions = jnp.arange(40, dtype=jnp.int32)[None]
    cache = lambda: model.init_cache(tiny_cfg, 1, 64, jnp.float32)
    full, c_full = model.forward_step_jit(
        tiny_params, toks, positions, cache(), None, cfg=tiny_cfg, expert_path="grouped", kernels="reference"
    )
    tail, c_tail = model.forward_step_jit(
        tiny_params,
        toks,
        positions,
        cache(),
        None,
        cfg=tiny_cfg,
        expert_path="grouped",
        kernels="reference",
        logits_tail=1,
    )
    assert tail.shape == (1, 1, tiny_cfg.vocab_size)
    np.testing.assert_allclose(tail[:, 0], full[:, -1], atol=1e-6, rtol=0)
    jax.tree.map(np.testing.assert_array_equal, c_tail, c_full)


def test_batched_cache_equals_each_sequence_alone(rng, tiny_cfg, tiny_params):
    toks = rng.integers(0, 256, size=(2, 20)).astype(np.int32)
    cache = model.init_cache(tiny_cfg, 2, 32, jnp.float32)
    batched, cache = model.forward(tiny_params, tiny_cfg, toks, cache=cache)
    step, _ = model.forward(tiny_params, tiny_cfg, toks[:, :1], cache=cache)
    for b in range(2):
        alone, c = model.forward(
            tiny_params, tiny_cfg, toks[b : b + 1], cache=model.init_cache(tiny_cfg, 1, 32, jnp.float32)
        )
        np.testing.assert_allclose(batched[b], alone[0], atol=BATCH_ATOL, rtol=0)
        alone_step, _ = model.forward(tiny_params, tiny_cfg, toks[b : b + 1, :1], cache=c)
        np.testing.assert_allclose(step[b], alone_step[0], atol=BATCH_ATOL, rtol=0)


def test_image_changes_only_what_follows_it(rng, tiny_cfg, tiny_params):
    tpi = tiny_cfg.vit.tokens_per_image
    toks = np.array([[tokenizer.BOS_ID, 5, 6] + tokenizer.image_tokens(tpi) + [7, 8]], np.int32)
    img_a = rng.random((1, 16, 16, 3)).astype(np.float32)
    img_b = rng.random((1, 16, 16, 3)).astype(np.float32)
    la, _ = model.forward(tiny_params, tiny_cfg, toks, images=img_a)
    lb, _ = model.forward(tiny_params, tiny_cfg, toks, images=img_b)
    first_image_pos = 4
    np.testing.assert_array_equal(la[:, :first_image_pos], lb[:, :first_image_pos])
    assert not np.allclose(la[:, -1], lb[:, -1])
    # uint8 images mean the same as floats / 255
    img_u8 = (img_a * 255).astype(np.uint8)
    lu, _ = model.forward(tiny_params, tiny_cfg, toks, images=img_u8)
    lf, _ = model.forward(tiny_params, tiny_cfg, toks, images=img_u8.astype(np.float32) / 255)
    np.testing.assert_allclose(lu, lf, atol=6e-5, rtol=0)  # measured 7.8e-6 to 2.0e-5 (4 seeds)


def test_pallas_kernels_match_the_references_without_a_cache(rng, tiny_cfg, tiny_params, monkeypatch):
    """Prefill from scratch through chunk_kda and mla_prefill (interpret mode) == the reference math."""
    from pallas_kernels import mla

    jax.clear_caches()  # a cached trace would bypass the spies below
    calls = []
    real = mla.mla_prefill
    monkeypatch.setattr(mla, "mla_prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    toks = rng.integers(0, tokenizer.N_BYTES, size=(2, 70)).astype(np.int32)
    ref, _ = model.forward(tiny_params, tiny_cfg, toks, kernels="reference")
    ker, _ = model.forward(tiny_params, tiny_cfg, toks, kernels="pallas")
    assert calls
    np.testing.assert_allclose(ker, ref, atol=3e-4, rtol=0)  # measured 1.9e-5 to 1.0e-4 (4 seeds)
    np.testing.assert_array_equal(ker.argmax(-1), ref.argmax(-1))


class TestBadInput:
    def test_token_ids_out_of_range(self, tiny_cfg, tiny_params):
        with pytest.raises(ValueError, match="out of range"):
            model.forward(tiny_params, tiny_cfg, np.array([[1, tiny_cfg.vocab_size]]))
        with pytest.raises(ValueError, match="out of range"):
            model.forward(tiny_params, tiny_cfg, np.array([[-1, 2]]))

    def test_tokens_of_wrong_rank_dtype_or_empty(self, tiny_cfg, tiny_params):
        with pytest.raises(ValueError, match=r"\[B, T\]"):
            model.forward(tiny_params, tiny_cfg, np.array([1, 2]))
        with pytest.raises(ValueError, match="integer"):
            model.forward(tiny_params, tiny_cfg, np.array([[1.0, 2.0]]))
        with pytest.raises(ValueError, match="empty"):
            model.forward(tiny_params, tiny_cfg, np.zeros((1, 0), np.int32))

    def test_prompt_longer_than_the_context(self, tiny_cfg, tiny_params):
        with pytest.raises(ValueError, match="context limit"):
            model.forward(tiny_params, tiny_cfg, np.zeros((1, tiny_cfg.max_seq_len + 1), np.int32))
        cache = model.init_cache(tiny_cfg, 1, 8, jnp.float32)
        with pytest.raises(ValueError, match="cache capacity=8"):
            model.forward(tiny_params, tiny_cfg, np.zeros((1, 9), np.int32), cache=cache)

    def test_positions_that_do_not_continue_the_cache(self, tiny_cfg, tiny_params):
        with pytest.raises(ValueError, match="positions"):
            model.forward(tiny_params, tiny_cfg, np.zeros((1, 3), np.int32), positions=np.array([[1, 2, 3]]))

    @pytest.mark.parametrize(
        "shape, dtype, message",
        [
            ((1, 15, 16, 3), np.float32, "images must be"),
            ((1, 16, 16, 4), np.float32, "images must be"),
            ((16, 16, 3), np.float32, "images must be"),
            ((1, 16, 16, 3), np.int32, "dtype"),
        ],
    )
    def test_image_of_wrong_shape_or_dtype(self, tiny_cfg, tiny_params, shape, dtype, message):
        toks = np.array([tokenizer.image_tokens(tiny_cfg.vit.tokens_per_image)], np.int32)
        with pytest.raises(ValueError, match=message):
            model.forward(tiny_params, tiny_cfg, toks, images=np.zeros(shape, dtype))

    def test_broken_image_and_placeholder_mismatch(self, tiny_cfg, tiny_params):
        toks = np.array([tokenizer.image_tokens(tiny_cfg.vit.tokens_per_image)], np.int32)
        bad = np.full((1, 16, 16, 3), np.nan, np.float32)
        with pytest.raises(ValueError, match="NaN"):
            model.forward(tiny_params, tiny_cfg, toks, images=bad)
        with pytest.raises(ValueError, match="placeholders"):
            model.forward(tiny_params, tiny_cfg, toks, images=np.zeros((2, 16, 16, 3), np.float32))
        with pytest.raises(ValueError, match="no images"):
            model.forward(tiny_params, tiny_cfg, toks)

    def test_a_generated_image_token_continuing_a_cache_is_a_text_token(self, tiny_cfg, tiny_params):
        """A decode step whose token the model sampled as <|image|> runs (no images needed) and
        gives what the full no-cache forward gives there (extra placeholders are text tokens)."""
        prompt = np.array([[5, 6, 7]], np.int32)
        cache = model.init_cache(tiny_cfg, 1, 16)
        _, cache = model.forward(tiny_params, tiny_cfg, prompt, cache=cache)
        step, _ = model.forward(tiny_params, tiny_cfg, np.array([[tokenizer.IMAGE_ID]], np.int32), cache=cache)
        seq = np.array([[5, 6, 7, tokenizer.IMAGE_ID]], np.int32)
        with pytest.raises(ValueError, match="no images"):  # a prompt's placeholder still needs its image
            model.forward(tiny_params, tiny_cfg, seq)
        # the oracle's form: a jitted full recompute (traced tokens: the prompt checks do not apply)
        full = jax.jit(lambda t: model.forward(tiny_params, tiny_cfg, t)[0])(seq)
        np.testing.assert_allclose(step[0, -1], full[0, -1], atol=1e-5, rtol=0)  # measured 1.4e-6 to 4.1e-6


def test_init_params_draws_the_whole_models_tree_per_block_kind(tiny_cfg):
    """Blocks drawn per kind (one program per (mixer, FFN) kind) give exactly the tree flax's init
    of the whole model declares, every block its own values, the same for the same key."""
    key = jax.random.PRNGKey(3)
    params = model.init_params(tiny_cfg, key)
    declared = model.cast_params(
        jax.eval_shape(lambda: model.KimiK3(tiny_cfg).init(key, *model.example_inputs(tiny_cfg))["params"]),
        tiny_cfg.dtype,
    )
    assert jax.tree.structure(params) == jax.tree.structure(declared)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(declared)):
        assert got.shape == want.shape and got.dtype == want.dtype
    kinds = [model.block_kind(tiny_cfg, i) for i in range(tiny_cfg.n_layers)]
    same = [(i, j) for i in range(len(kinds)) for j in range(i) if kinds[i] == kinds[j]]
    assert same  # tiny has two (KDA, MoE) blocks: one program, two keys
    for i, j in same:
        for name in ("kda", "moe"):
            for x, y in zip(jax.tree.leaves(params[f"layer_{i}"][name]), jax.tree.leaves(params[f"layer_{j}"][name])):
                x, y = np.asarray(x), np.asarray(y)
                assert not np.array_equal(x, y) or np.all(x == x.flat[0]), (i, j, name)  # constants (norms) alike
    again = model.init_params(tiny_cfg, key)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(again)))


def test_the_prefill_steps_xla_options_are_switched_by_one_variable_each():
    """`KIMIK3_PREFILL_TRITON_GEMM=0` and `KIMIK3_PREFILL_COMMAND_BUFFER=0` are XLA options of the
    serving step's program alone (the decode program keeps XLA's defaults); anything but 0 or 1 is
    refused by name."""
    assert model.step_compiler_options({}) == {}
    assert model.step_compiler_options({"KIMIK3_PREFILL_TRITON_GEMM": "1"}) == {}
    assert model.step_compiler_options({"KIMIK3_PREFILL_TRITON_GEMM": "0"}) == {"xla_gpu_enable_triton_gemm": False}
    both = {"KIMIK3_PREFILL_TRITON_GEMM": "0", "KIMIK3_PREFILL_COMMAND_BUFFER": "0"}
    assert model.step_compiler_options(both) == {
        "xla_gpu_enable_triton_gemm": False,
        "xla_gpu_enable_command_buffer": "",
    }
    for name in both:
        with pytest.raises(ValueError, match=name):
            model.step_compiler_options({name: "off"})
    # XLA takes the options on any backend (DebugOptions fields), so a program compiles with them
    f = jax.jit(lambda x: x @ x, compiler_options=model.step_compiler_options(both))
    assert float(f(jnp.ones((4, 4))).sum()) == 64.0
