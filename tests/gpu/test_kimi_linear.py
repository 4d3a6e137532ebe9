"""Kimi-Linear on the GPU: the KDA kernels with its unbounded softplus gate (per-token log-decay far
below the bounded gate's -5) against the references and against fla (``chunk_kda``,
``fused_recurrent_kda``: the kernels fla and vLLM serve Kimi-Linear with), and the serving engine on
a random Kimi-Linear of the checkpoint's head dims through the Pallas kernels against the fp32
oracle.  fla comes from a carried wheel (benchmarks/README.md); its rows skip without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import config, generate, model, ops
from kimik3.layers.kda import kda_gate
from pallas_kernels import kda, kda_decode
from serving.engine import Engine, EngineConfig
from tests.pallas_kernels.test_kda_ref import kda_inputs

ATOL = RTOL = 1e-3  # fp32 kernels (3xTF32 or better) against fp32 references, O(1) values
H, D = 32, 128  # Kimi-Linear's KDA heads


def softplus_gates(rng, b, t, shift=0.0, scale=3.0):
    """Kimi-Linear's gate -exp(A_log) * softplus(f + dt_bias) with A_log = log U(1, 16) and f of
    N(shift, scale): with the defaults per-token log-decays reach about -16 * 3 * scale, far below
    the bounded gate's -5; shift -5 keeps them above it."""
    f = jnp.asarray(shift + rng.standard_normal((b, t, H, D)) * scale, jnp.float32)
    a_log = jnp.log(jnp.asarray(rng.uniform(1.0, 16.0, H), jnp.float32))
    return kda_gate(f, a_log, jnp.zeros((H, D), jnp.float32), None)


def _close(got, want, what):
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=ATOL, rtol=RTOL, err_msg=what
    )


@pytest.mark.parametrize("shift, scale", [(-5.0, 0.3), (0.0, 3.0)], ids=["gates above -5", "gates far below -5"])
def test_a_chunked_prefill_with_the_unbounded_gate_equals_the_reference_and_fla(shift, scale):
    rng = np.random.default_rng(0)
    q, k, v, _, beta = kda_inputs(rng, 1, 300, H, D, D)
    g = softplus_gates(rng, 1, 300, shift, scale)
    assert (float(jnp.min(g)) < ops.GATE_FLOOR) == (shift == 0.0)
    s0 = jnp.asarray(rng.standard_normal((1, H, D, D)) * 0.1, jnp.float32)
    o, s = jax.jit(lambda *a: ops.kda(*a, initial_state=s0, kernels="pallas", gate_bounded=False))(q, k, v, g, beta)
    o_ref, s_ref = kda.kda_chunked_ref(q, k, v, g, beta, initial_state=s0)
    _close(o, o_ref, "output")
    _close(s, s_ref, "final state")
    fla = pytest.importorskip("fla.ops.kda")
    torch = pytest.importorskip("torch")
    t = lambda x: torch.from_numpy(np.asarray(x, np.float32)).cuda()
    o_fla, s_fla = fla.chunk_kda(t(q), t(k), t(v), t(g), t(beta), initial_state=t(s0), output_final_state=True)
    _close(o, o_fla.float().cpu().numpy(), "output against fla's chunk_kda")
    _close(s, s_fla.float().cpu().numpy(), "state against fla's chunk_kda")


def test_decode_with_the_unbounded_gate_equals_the_reference_and_fla():
    rng = np.random.default_rng(1)
    b = 8
    q, k, v, _, beta = kda_inputs(rng, b, 1, H, D, D)
    g = softplus_gates(rng, b, 1)
    pool = jnp.asarray(rng.standard_normal((b + 3, H, D, D)) * 0.1, jnp.float32)
    slots = jnp.asarray(rng.permutation(b + 3)[:b], jnp.int32)
    s_in = np.asarray(pool[slots])
    o_ref, s_ref = kda.kda_recurrent_ref(q, k, v, g, beta, initial_state=pool[slots])
    o, pool = kda.fused_recurrent_kda(q, k, v, g, beta, state_pool=pool, slots=slots)
    _close(o, o_ref, "output")
    _close(pool[slots], s_ref, "states in their slots")
    fla = pytest.importorskip("fla.ops.kda")
    torch = pytest.importorskip("torch")
    t = lambda x: torch.from_numpy(np.asarray(x, np.float32)).cuda()
    o_fla, s_fla = fla.fused_recurrent_kda(
        t(q), t(k), t(v), t(g), t(beta), initial_state=t(s_in), output_final_state=True
    )
    _close(o, o_fla.float().cpu().numpy(), "output against fla's fused_recurrent_kda")
    _close(pool[slots], s_fla.float().cpu().numpy(), "state against fla's fused_recurrent_kda")


def test_the_fused_decode_kernels_softplus_gate_equals_its_reference():
    rng = np.random.default_rng(2)
    b, hk = 8, H * D
    r = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
    args = dict(
        beta_col=3 * hk,
        w_conv=tuple(r(4, hk, scale=0.5) for _ in "qkv"),
        a_log=jnp.log(jnp.asarray(rng.uniform(1, 16, H), jnp.float32)),
        dt_bias=r(H, D, scale=0.5),
        o_norm=r(D, scale=0.1) + 1,
        lower_bound=None,
        eps=1e-5,
    )
    x_in, fg = r(b, 3 * hk + H), r(b, 2 * hk, scale=3.0)
    conv, state = r(b + 2, 3, 3, hk), r(b + 2, H, D, D, scale=0.1)
    slots = jnp.asarray(rng.permutation(b + 2)[:b], jnp.int32)
    want = kda_decode.kda_decode_ref(x_in, fg, conv, state, slots, None, **args)
    got = kda_decode.kda_decode(x_in, fg, jnp.copy(conv), jnp.copy(state), slots, None, **args)
    _close(got[0], want[0], "output")
    _close(got[2][slots], want[2][slots], "states")


def test_an_engine_on_a_kimi_linear_of_the_checkpoints_head_dims_gives_the_oracles_tokens():
    """Five layers of Kimi-Linear's widths per head (KDA 32 x 128, MLA 32 heads, 512 + 64 latent,
    no q-LoRA, no output gate), fp32, through the Pallas kernels, with a prefix hit."""
    cfg = config.kimi_linear().replace(
        name="kimi_linear_5",
        vocab_size=4096,
        d_model=1024,
        n_layers=5,
        max_seq_len=8192,
        n_routed_experts=16,
        n_active_experts=4,
        moe_latent_dim=1024,
        moe_expert_dim=256,
        moe_shared_dim=256,
        dense_ffn_dim=2048,
        mixer_layout=("kda", "kda", "kda", "mla", "mla"),
        dtype="float32",
    )
    params = model.init_params(cfg, jax.random.PRNGKey(0), "float32")
    rng = np.random.default_rng(3)
    turn1 = rng.integers(0, cfg.vocab_size, 200).tolist()
    eng = Engine(
        params,
        cfg,
        EngineConfig(
            num_pages=64,
            num_slots=4,
            num_snapshots=16,
            page_tokens=64,
            kda_block_tokens=64,
            max_pages_per_request=16,
            prefill_chunk_tokens=128,
        ),
    )
    with jax.default_matmul_precision("highest"):
        r1 = eng.submit(turn1, 4)
        eng.run(max_steps=100)
        turn2 = turn1 + r1.output + rng.integers(0, cfg.vocab_size, 30).tolist()
        r2 = eng.submit(turn2, 4)
        eng.run(max_steps=100)
        assert r2.cached_tokens >= 192
        assert r1.output == generate.generate(params, cfg, turn1, 4).tokens.tolist()
        assert r2.output == generate.generate(params, cfg, turn2, 4).tokens.tolist()


def _rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_kimi_linears_full_width_layers_in_bf16_on_the_served_kernels_track_the_fp32_reference():
    """One KDA layer with the dense FFN, one MLA layer and one KDA layer with the 256-expert MoE, at
    Kimi-Linear's full widths (d 2304, KDA 32 x 128 with the unbounded gate, MLA 32 heads, experts
    2304 -> 1024 top-8), in bf16 through the served layout and the Pallas kernels, against the
    same (bf16-rounded) weights in fp32 on the reference kernels: prefill logits of 1024 tokens
    within a relative L2 of 5e-2 and 4 cached decode steps within 2e-2 (bf16 activations and KDA
    intermediates over three layers: 2.3e-2 and 7e-3 at reduced widths in the interpreter)."""
    from kimik3 import stacked

    cfg = config.kimi_linear().replace(
        name="kimi_linear_layers", n_layers=3, mixer_layout=("kda", "mla", "kda"), vocab_size=8192, max_seq_len=2048
    )
    params = model.init_params(cfg, jax.random.PRNGKey(0), "bfloat16")
    p32 = model.cast_params(params, jnp.float32)
    served = stacked.serving_layout(params, cfg, scan=False)
    cfg32 = cfg.replace(dtype="float32")
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 1024)), jnp.int32)
    steps = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 4)), jnp.int32)
    cache = model.init_cache(cfg, 1, 1100)
    cache32 = model.init_cache(cfg32, 1, 1100)
    logits, cache = model.forward(served, cfg, prompt, cache=cache, kernels="pallas")
    with jax.default_matmul_precision("highest"):
        want, cache32 = model.forward(p32, cfg32, prompt, cache=cache32, kernels="reference")
    errs = {"prefill": _rel_l2(logits, want)}
    for i in range(steps.shape[1]):
        logits, cache = model.forward(served, cfg, steps[:, i : i + 1], cache=cache, kernels="pallas")
        with jax.default_matmul_precision("highest"):
            want, cache32 = model.forward(p32, cfg32, steps[:, i : i + 1], cache=cache32, kernels="reference")
        errs[f"decode {i}"] = _rel_l2(logits, want)
    decode = max(v for name, v in errs.items() if name != "prefill")
    assert errs["prefill"] <= 5e-2 and decode <= 2e-2, errs
