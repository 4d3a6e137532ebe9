"""Every Pallas kernel the model runs, compiled for the GPU in fp32 at `small`'s dims, against
its reference on fresh random inputs.

fp32 is what the oracle runs in: a kernel whose fp32 tiles overflow the GPU's shared
memory fails only here (the CPU suite runs the kernels in interpret mode, which has no shared
memory), so each family is a test of its own and a failure names the kernel.  fp32 inputs
multiply in 3xTF32 or better, so outputs of O(1) agree with the fp32 reference to ~1e-5; the
tolerance below leaves room for summation order over a few hundred keys, not for bf16 (~1e-2).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import config
from pallas_kernels import kda, mla, moe
from tests.pallas_kernels.test_kda_ref import kda_inputs

ATOL = RTOL = 1e-3
CFG = config.small()
T = 300  # the oracle test's prompt: four 64-token chunks and a ragged tail


def _close(got, want, what):
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=ATOL, rtol=RTOL, err_msg=what
    )


@pytest.mark.parametrize(
    "tuning, t",
    [
        ({}, T),
        ({"prepare_impl": "fused"}, T),
        ({"prepare_impl": "intra_solve"}, T),
        ({"intra_chunks": 4, "intra": (8, 2)}, 8 * 64 - 20),
    ],
    ids=["default", "prepare=fused", "prepare=intra_solve", "intra_chunks=4"],
)
def test_kda_chunk_prefill_with_state_and_exports(tuning, t):
    """(intra_chunks=4 with Triton's pipelined loads: eight chunks, so two programs a head loop.)"""
    rng = np.random.default_rng(0)
    h, d = CFG.kda_heads, CFG.kda_head_dim
    q, k, v, g, beta = kda_inputs(rng, 1, t, h, d, d)
    s0 = jnp.asarray(rng.standard_normal((1, h, d, d)) * 0.1, jnp.float32)
    o, s, ckpt = kda.chunk_kda(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, checkpoint_positions=[128, 256], tuning=tuning
    )
    o_ref, s_ref = kda.kda_chunked_ref(q, k, v, g, beta, initial_state=s0)
    _close(o, o_ref, "output")
    _close(s, s_ref, "final state")
    _, s128 = kda.kda_chunked_ref(*(x[:, :128] for x in (q, k, v, g, beta)), initial_state=s0)
    _close(ckpt[:, 0], s128, "state exported at 128")


def test_kda_fused_recurrent_decode_in_place():
    rng = np.random.default_rng(1)
    h, d, b = CFG.kda_heads, CFG.kda_head_dim, 8
    q, k, v, g, beta = kda_inputs(rng, b, 1, h, d, d)
    pool = jnp.asarray(rng.standard_normal((b + 3, h, d, d)) * 0.1, jnp.float32)
    slots = jnp.asarray(rng.permutation(b + 3)[:b], jnp.int32)
    o_ref, s_ref = kda.kda_recurrent_ref(q, k, v, g, beta, initial_state=pool[slots])
    o, pool = kda.fused_recurrent_kda(q, k, v, g, beta, state_pool=pool, slots=slots)
    _close(o, o_ref, "output")
    _close(pool[slots], s_ref, "states in their slots")


def _latent_prefix(rng, b, page, n_pages, lens):
    r, p, h = CFG.kv_lora_rank, CFG.qk_rope_dim, CFG.mla_heads
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
    pages = f(n_pages, page, r + p)
    per_row = n_pages // b
    table = jnp.asarray(rng.permutation(n_pages)[: b * per_row].reshape(b, per_row), jnp.int32)
    return mla.LatentPrefix(
        pages, table, jnp.asarray(lens, jnp.int32), f(r, h, CFG.qk_nope_dim), f(r, h, CFG.v_head_dim)
    )


@pytest.mark.parametrize("cached", [0, 200])
def test_mla_prefill_chunk_over_latent_pages(cached):
    """A chunk of T tokens continuing `cached` tokens, as the cached generate and the engine's
    prefill run it (the expanded form over the pages)."""
    rng = np.random.default_rng(2)
    h, dqk, dv = CFG.mla_heads, CFG.qk_nope_dim + CFG.qk_rope_dim, CFG.v_head_dim
    prefix = _latent_prefix(rng, 1, 128, 8, [cached])
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v = f(1, T, h, dqk), f(1, T, h, dqk), f(1, T, h, dv)
    scale = dqk**-0.5
    o, _ = mla.mla_prefill_chunk(q, k, v, prefix, scale=scale, rope_dim=CFG.qk_rope_dim)
    o_ref, _ = mla.mla_prefill_ref(q[0], k[0], v[0], cu_seqlens=[0, T], scale=scale, prefix=prefix)
    _close(o[0], o_ref, f"chunk after {cached} cached tokens")


def test_mla_prefill_fresh_tokens():
    rng = np.random.default_rng(3)
    h, dqk, dv = CFG.mla_heads, CFG.qk_nope_dim + CFG.qk_rope_dim, CFG.v_head_dim
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v = f(T + 77, h, dqk), f(T + 77, h, dqk), f(T + 77, h, dv)
    cu = [0, T, T + 77]
    o, lse = mla.mla_prefill(q, k, v, cu_seqlens=cu, scale=dqk**-0.5, rope_dim=CFG.qk_rope_dim)
    o_ref, lse_ref = mla.mla_prefill_ref(q, k, v, cu_seqlens=cu, scale=dqk**-0.5)
    _close(o, o_ref, "output")
    _close(lse, lse_ref, "lse")


@pytest.mark.parametrize("queries", [1, 4])
def test_mla_absorbed_decode_over_pages(queries):
    """One decode token (and a 4-token speculative verify) per row over paged latents."""
    rng = np.random.default_rng(4)
    r, p, h, b = CFG.kv_lora_rank, CFG.qk_rope_dim, CFG.mla_heads, 4
    prefix = _latent_prefix(rng, b, 128, 24, [0] * b)
    lens = jnp.asarray(rng.integers(queries, 6 * 128, b), jnp.int32)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q_latent, q_pe = f(b, queries, h, r), f(b, queries, h, p)
    o, lse = mla.mla_decode(q_latent, q_pe, prefix.latent_pages, prefix.block_tables, lens, scale=192**-0.5)
    o_ref, lse_ref = mla.mla_decode_ref(q_latent, q_pe, prefix.latent_pages, prefix.block_tables, lens, scale=192**-0.5)
    _close(o, o_ref, "output")
    _close(lse, lse_ref, "lse")


@pytest.mark.parametrize("rows", [32 * 4, 2048 * 4])
def test_moe_grouped_matmul(rows):
    """The experts' fused gate+up GEMM at a decode step's and a prefill chunk's routed rows."""
    rng = np.random.default_rng(5)
    g, kdim, n = CFG.n_routed_experts, CFG.moe_latent_dim, 2 * CFG.moe_expert_dim
    sizes = np.bincount(rng.integers(0, g, rows), minlength=g)
    lhs = jnp.asarray(rng.standard_normal((rows, kdim)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((g, kdim, n)) * kdim**-0.5, jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = moe.grouped_matmul(lhs, rhs, sizes)
    _close(got, moe.grouped_matmul_ref(lhs, rhs, sizes), "grouped GEMM")


@pytest.mark.parametrize("dtype, rows", [("float32", 32), ("float32", 2048), ("bfloat16", 32)])
def test_moe_grouped_ffn(dtype, rows):
    """Both routed-expert GEMMs and the activation in one layout (the decode step's MoE path) at
    `small`'s expert dims, against each expert applied to its rows.  bf16 rounds the hidden
    activation once between the GEMMs: ~1e-2 relative."""
    from tests.pallas_kernels.test_moe_kernels import _ffn_ref, _silu_glu

    rng = np.random.default_rng(6)
    e, k, l, f = CFG.n_routed_experts, CFG.n_active_experts, CFG.moe_latent_dim, CFG.moe_expert_dim
    x = jnp.asarray(rng.standard_normal((rows, l)), dtype)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(rows)]).astype(np.int32)
    w_gateup = jnp.asarray(rng.standard_normal((e, l, 2 * f)) * l**-0.5, dtype)
    w_out = jnp.asarray(rng.standard_normal((e, f, l)) * f**-0.5, dtype)
    y = moe.grouped_ffn(x, jnp.asarray(ids), w_gateup, w_out, act=_silu_glu)
    want = _ffn_ref(x.astype(jnp.float32), ids, w_gateup.astype(jnp.float32), w_out.astype(jnp.float32))
    tol = ATOL if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=tol, rtol=tol, err_msg="grouped_ffn")


def test_the_fp32_kernels_ran_on_the_gpu():
    """Guard: the tests above ran compiled kernels, not the interpreter."""
    assert jax.default_backend() == "gpu" and not kda._default_interpret() and not mla._default_interpret()
