"""The quantized GEMMs compiled for the GPU at `small`'s dims: the block-scaled FP8 / MXFP8
kernel against its reference, fused projection groups against their members bit for bit (on the
GPU's own kernel: array_equal), and the MXFP4 grouped expert GEMM against the bf16 path on the
dequantized weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import config, ops
from kimik3.quant import formats
from pallas_kernels import moe, moe_mxfp4, moe_mxfp4_hopper, mxfp4, qgemm
from tests.gpu.conftest import sm90

SMALL = config.small()
# `small`'s fused groups: KDA q | k | v | f_a | beta | g_a, MLA q_a | kv_a | gate
GROUPS = {"kda": (1536, 1536, 1536, 128, 12, 128), "mla": (768, 576, 2048)}


@pytest.mark.parametrize("fmt", qgemm.FORMATS)
@pytest.mark.parametrize("m", [1, 8, 64, 2048])
def test_block_scaled_gemm_against_its_reference(fmt, m):
    rng = np.random.default_rng(m)
    operands = qgemm.reference_inputs(rng, fmt, m, 1536, 4876)
    got = np.asarray(qgemm.qmatmul(fmt, *operands, out_dtype=jnp.float32))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(qgemm.qmatmul_ref(fmt, *operands))
        x, w = (np.asarray(a, np.float32) for a in operands[0:3:2])
        scale = np.abs(x) @ np.abs(w)  # the sum of |products| before scaling, per output
    bk = qgemm.block_k(fmt)
    s_max = float(np.max(np.asarray(operands[1]))) * float(np.max(np.asarray(operands[3], np.float32)))
    # Hopper's FP8 MMA adds products in a narrower-than-fp32 accumulator within one instruction
    # (DeepSeek-V3 measured ~14 bits); each K block's sum is promoted to fp32 after at most bk
    # products, so the error stays under 2^-12 of the block sums' magnitudes
    assert np.all(np.abs(got - ref) <= 2.0**-12 * scale * s_max + 1e-30), (fmt, m, bk)
    assert np.mean(np.abs(got - ref)) < 1e-3 * np.mean(np.abs(ref))


@pytest.mark.parametrize("fmt", qgemm.FORMATS)
@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("m", [1, 32, 2048])
def test_fused_groups_equal_their_members_bit_for_bit_on_the_gpu(fmt, group, m):
    rng = np.random.default_rng(7)
    widths = GROUPS[group]
    members = [formats.quantize(rng.standard_normal((SMALL.d_model, w)).astype(np.float32) * 0.02, fmt) for w in widths]
    fused = formats.concat(members)
    x = jnp.asarray(rng.standard_normal((m, SMALL.d_model)), jnp.bfloat16)
    y = np.asarray(ops.linear(x, fused, kernels="pallas"), np.float32)
    start = 0
    for q in members:
        y_m = np.asarray(ops.linear(x, q, kernels="pallas"), np.float32)
        np.testing.assert_array_equal(y[:, start : start + q.shape[1]], y_m)
        start += q.shape[1]


@pytest.mark.parametrize("rows", [8, 32, 256, 4096])
@pytest.mark.parametrize("k, n", [(768, 1536), (768, 768)])  # gate ++ up, down
def test_mxfp4_grouped_gemm_against_the_bf16_path(rows, k, n):
    rng = np.random.default_rng(rows)
    g = SMALL.n_routed_experts
    q = formats.quantize(rng.standard_normal((g, k, n)).astype(np.float32) * 0.03, "mxfp4")
    sizes = np.bincount(rng.integers(0, g, rows), minlength=g).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    got = np.asarray(moe_mxfp4.grouped_matmul_mxfp4(x, q.values, q.scales, jnp.asarray(sizes)), np.float32)
    ref = np.asarray(moe_mxfp4.grouped_matmul_mxfp4_ref(x, q.values, q.scales, jnp.asarray(sizes)), np.float32)
    # the same bf16 products summed in fp32 in another order, each output rounded to bf16
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2 * float(np.abs(ref).max()))


def _read_back_through(gemm):
    """Identity rows [2K, K] times two random MXFP4 experts [2, K, N] (every code, both nibbles,
    scales 2^-127 (a bf16 subnormal) to 2^6) through `gemm(rows, weights, group_sizes)` must give
    the dequantized weights bit for bit."""
    rng = np.random.default_rng(3)
    k, n = 256, 512
    values = jnp.asarray(rng.integers(0, 256, (2, k, n // 2), dtype=np.uint8))
    bits = rng.integers(100, 134, (2, k // 32, n)).astype(np.uint8)
    bits[0, 0, :4] = (0, 1, 126, 133)
    w = mxfp4.PackedMXFP4(values, jnp.asarray(bits).view(jnp.float8_e8m0fnu))
    eye = jnp.eye(k, dtype=jnp.bfloat16)
    got = gemm(jnp.concatenate([eye, eye]), w, jnp.asarray([k, k], jnp.int32))
    want = mxfp4.dequantize(w.values, w.scales).astype(jnp.bfloat16).reshape(2 * k, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_mxfp4_decode_in_ptx_is_the_formats_bit_for_bit():
    """The Triton kernel's inline-PTX decode, read back through identity rows."""
    _read_back_through(lambda x, w, sizes: moe_mxfp4.grouped_matmul_mxfp4(x, w.values, w.scales, sizes))


@pytest.mark.parametrize("tokens", [1, 32, 512])  # gathered decode rows, the padded copy
def test_grouped_ffn_on_mxfp4_experts_against_the_bf16_experts(tokens):
    rng = np.random.default_rng(tokens)
    e, l, f, top_k = SMALL.n_routed_experts, SMALL.moe_latent_dim, SMALL.moe_expert_dim, SMALL.n_active_experts
    qs = [
        formats.quantize(rng.standard_normal(s).astype(np.float32) * 0.05, "mxfp4") for s in ((e, l, 2 * f), (e, f, l))
    ]
    x = jnp.asarray(rng.standard_normal((tokens, l)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:top_k] for _ in range(tokens)]), jnp.int32)
    act = lambda gate, up: jax.nn.silu(gate) * up
    got = moe.grouped_ffn(x, ids, *[mxfp4.PackedMXFP4(q.values, q.scales) for q in qs], act=act)
    want = moe.grouped_ffn(x, ids, *[mxfp4.dequantize(q.values, q.scales).astype(jnp.bfloat16) for q in qs], act=act)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # the same weights (the decode is exact), fp32 sums in another order, bf16 hidden and outputs
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max()))


hopper = pytest.mark.skipif(not sm90(), reason="Hopper (sm_90) kernels")


_HOPPER_TILINGS = [
    dict(block_m=16, block_n=128, block_k=128, code_tile=64),
    dict(block_m=8, block_n=64, block_k=256, code_tile=128),
    dict(block_m=16, block_n=256, block_k=128, code_tile=128, steps=3),
    dict(block_m=16, block_n=128, block_k=128, code_tile=64, warp_specialized=True),
    dict(block_m=16, block_n=128, block_k=128, code_tile=128, load4x=True),
    dict(block_m=16, block_n=64, block_k=128, code_tile=64, warp_specialized=True, load4x=True),
    dict(block_m=16, block_n=128, block_k=256, code_tile=128, overlap=True),
    dict(block_m=16, block_n=128, block_k=128, code_tile=128, steps=2, overlap=True),
]


@hopper
@pytest.mark.parametrize(
    "tiling, decode",
    [(t, d) for t in _HOPPER_TILINGS for d in moe_mxfp4_hopper.DECODES if not (t.get("load4x") and d == "lut_perm")],
)  # lut_perm loads so itself
def test_mxfp4_hopper_decode_is_the_formats_bit_for_bit(tiling, decode):
    """The Hopper kernel's register decode, read back through identity rows (under overlap, rows
    released a step late: an early release would hand a step the next one's rows)."""
    _read_back_through(
        lambda x, w, sizes: moe_mxfp4_hopper.grouped_matmul(
            x, moe_mxfp4_hopper.to_hopper(w, decode), sizes, **tiling, decode=decode
        )
    )


@hopper
@pytest.mark.parametrize("warp_specialized", [False, True])
@pytest.mark.parametrize("decode", moe_mxfp4_hopper.DECODES)
@pytest.mark.parametrize("rows", [1, 8, 32, 256, 4096])
@pytest.mark.parametrize("k, n", [(768, 1536), (768, 768)])  # small's gate ++ up, down
def test_mxfp4_hopper_grouped_gemm_against_the_bf16_path(rows, k, n, decode, warp_specialized):
    rng = np.random.default_rng(rows)
    g = SMALL.n_routed_experts
    q = formats.quantize(rng.standard_normal((g, k, n)).astype(np.float32) * 0.03, "mxfp4")
    sizes = jnp.asarray(np.bincount(rng.integers(0, g, rows), minlength=g).astype(np.int32))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = moe_mxfp4_hopper.to_hopper(mxfp4.PackedMXFP4(q.values, q.scales), decode)
    got = np.asarray(
        moe_mxfp4_hopper.grouped_matmul(
            x, w, sizes, decode=decode, block_n=64 if warp_specialized else 128, warp_specialized=warp_specialized
        ),
        np.float32,
    )
    ref = np.asarray(moe_mxfp4.grouped_matmul_mxfp4_ref(x, q.values, q.scales, sizes), np.float32)
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2 * float(np.abs(ref).max()))


@hopper
@pytest.mark.parametrize("tokens", [1, 32, 512])  # decode steps (the routed path from 1 to 32), a prefill chunk
def test_smalls_mxfp4_experts_in_the_hopper_layout_give_the_triton_kernels_outputs(tokens, monkeypatch):
    """`small`'s MXFP4 experts moved into the Hopper kernel's layout (`ops.hopper_mxfp4_experts`
    under `KIMIK3_MOE_MXFP4=auto`) through `ops.grouped_ffn` and, for a decode step's powers of two,
    `ops.routed_ffn`: the Triton MXFP4 kernels' outputs within bf16 roundings."""
    from kimik3.layers.moe import _SituGLU

    rng = np.random.default_rng(tokens)
    e, l, f, top_k = SMALL.n_routed_experts, SMALL.moe_latent_dim, SMALL.moe_expert_dim, SMALL.n_active_experts
    q = lambda *s: formats.quantize((rng.standard_normal(s) * 0.05).astype(np.float32), "mxfp4")
    params = {"gu": q(e, l, 2 * f), "out": q(e, f, l)}
    x = jnp.asarray(rng.standard_normal((tokens, l)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:top_k] for _ in range(tokens)]), jnp.int32)
    logits = jnp.asarray(rng.standard_normal((tokens, e)), jnp.float32)
    act = _SituGLU((8.0, 8.0))
    monkeypatch.setenv("KIMIK3_MOE_MXFP4", "auto")
    moved = ops.hopper_mxfp4_experts(params, "bfloat16")
    assert isinstance(moved["gu"], moe_mxfp4_hopper.HopperMXFP4) and isinstance(
        moved["out"], moe_mxfp4_hopper.HopperMXFP4
    )
    outs = []
    for w in (params, moved):
        y = ops.grouped_ffn(x, ids, w["gu"], w["out"], act)
        r = (
            ops.routed_ffn(
                x,
                logits,
                jnp.zeros((e,), jnp.float32),
                None,
                w["gu"],
                w["out"],
                act,
                top_k,
                jnp.ones((l,), jnp.float32),
                1e-6,
            )
            if ops.routed_ffn_fits(x, w["gu"], w["out"], top_k)
            else y
        )
        outs.append([np.asarray(a, np.float32) for a in (y, r)])
    for want, got in zip(*outs):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max()))
