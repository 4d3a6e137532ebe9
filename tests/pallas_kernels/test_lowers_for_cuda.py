"""The decode step's Triton kernels lower for an H200 on this CPU machine.

Interpret mode (every other test here) runs a kernel's jnp semantics; it does not run the Pallas
Triton lowering, which refuses some ops the interpreter takes (bf16 division, shapes that are not
powers of two, ...).  Under an abstract H200 mesh the lowering runs without a GPU, so those
errors show here, before any device time.  (Triton's own compile to PTX, and shared-memory
limits, still need the GPU: `tests/gpu`.)"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from pallas_kernels import kda, kda_decode, mla, moe, moe_combine, moe_mxfp4, moe_route, mxfp4, qgemm

S = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
H200 = AbstractMesh(
    (1,),
    ("x",),
    (AxisType.Explicit,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
)


def lowered_triton_calls(fn, *shapes) -> int:
    with jax.sharding.use_abstract_mesh(H200):
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("__gpu$xla.gpu.triton")


def test_the_check_catches_what_the_lowering_refuses():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] / (x_ref[...] + 1)  # bf16 division: Triton has none

    bad = lambda x: pl.pallas_call(kernel, out_shape=S(x.shape, x.dtype), interpret=False)(x)
    with pytest.raises(NotImplementedError, match="unsupported types"):
        lowered_triton_calls(bad, S((16, 128), BF16))


@pytest.mark.parametrize("rows, lower_bound", [(8, -5.0), (32, -5.0), (8, None)])
def test_kda_decode_at_small_dims(rows, lower_bound):
    """The bounded gate (Kimi-K3) and the unbounded softplus gate (Kimi-Linear, lower_bound None)."""
    h, k, n_slots = 12, 128, 2 * rows + 2
    fn = lambda x, fg, cp, sp, sl, va, wq, wk, wv, a, dt, on: kda_decode._decode_core(
        x,
        fg,
        cp,
        sp,
        sl,
        va,
        (wq, wk, wv),
        a,
        dt,
        on,
        beta_col=3 * h * k + k,
        lower_bound=lower_bound,
        eps=1e-6,
        l2_eps=1e-6,
        scale=k**-0.5,
        block_v=64,
        num_warps=4,
        interpret=False,
    )
    assert (
        lowered_triton_calls(
            fn,
            S((rows, 3 * h * k + 2 * k + h), BF16),
            S((rows, 2 * h * k), BF16),
            S((n_slots, 3, 3, h * k), BF16),
            S((n_slots, h, k, k), F32),
            S((rows,), I32),
            S((rows,), I32),
            *[S((4, h * k), BF16)] * 3,
            S((h,), F32),
            S((h, k), F32),
            S((k,), F32),
        )
        == 1
    )


@pytest.mark.parametrize(
    "block_v, num_warps, cache_hints",
    [(64, 8, False), (64, 8, True), (32, 4, False), (64, 4, False), (16, 1, False), (128, 8, False)],
)
def test_fused_recurrent_kda_at_its_tilings(block_v, num_warps, cache_hints):
    """The decode / verify recurrence at the kda_decode benchmark's tilings (64 columns on 8
    warps is the default, 32 on 4 fla 0.6's), and the default with fla's eviction hints."""
    b, h, d = 64, 32, 128
    fn = lambda q, k, v, g, beta, pool, slots, n_acc: kda._fused_recurrent_core(
        q,
        k,
        v,
        g,
        beta,
        pool,
        slots,
        n_acc,
        scale=d**-0.5,
        block_v=block_v,
        interpret=False,
        num_warps=num_warps,
        cache_hints=cache_hints,
    )
    assert (
        lowered_triton_calls(
            fn, *[S((b, 1, h, d), BF16)] * 4, S((b, 1, h), BF16), S((2 * b, h, d, d), F32), S((b,), I32), S((b,), I32)
        )
        == 1
    )


@pytest.mark.parametrize("rows", [8, 32])
def test_moe_combine_norm_at_small_dims(rows):
    fn = lambda y, dest, w, norm: moe_combine._combine_norm_core(y, dest, w, norm, eps=1e-6, interpret=False)
    assert lowered_triton_calls(fn, S((32 * 16, 768), BF16), S((rows, 4), I32), S((rows, 4), F32), S((768,), BF16)) == 1


@pytest.mark.parametrize("rows", [8, 32])
def test_moe_route_at_small_dims(rows):
    fn = lambda logits, bias, real: moe_route._route_core(logits, bias, real, top_k=4, block_m=16, interpret=False)
    assert lowered_triton_calls(fn, S((rows, 32), F32), S((32,), F32), S((rows,), I32)) == 1


@pytest.mark.parametrize("dtype, tokens", [(BF16, 32), (F32, 32), (BF16, 8)])  # 8 x top-4: few_rows_tiling
def test_grouped_ffn_with_the_activation_in_the_epilogue(dtype, tokens):
    act = lambda gate, up: jax.nn.silu(gate) * up
    fn = lambda x, ids, w_gateup, w_out: moe.grouped_ffn(x, ids, w_gateup, w_out, act=act, interpret=False)
    assert (
        lowered_triton_calls(
            fn, S((tokens, 768), dtype), S((tokens, 4), I32), S((32, 768, 1536), dtype), S((32, 768, 768), dtype)
        )
        == 2
    )


@pytest.mark.parametrize("b, splits, rows", [(8, 4, 16), (32, 1, 16), (4, 6, 64)])
def test_mla_merge_splits_at_small_dims(b, splits, rows):
    fn = lambda o, lse: mla.merge_splits(o, lse, (b, 1, 16, 512), BF16, kernel=True, interpret=False)
    assert lowered_triton_calls(fn, S((b, splits, rows, 512), F32), S((b, splits, rows), F32)) == 1


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
@pytest.mark.parametrize("rows", [1, 64, 2048])  # decode, a decode bucket, a prefill chunk
def test_block_scaled_gemm_at_small_dims(fmt, rows):
    """KDA's fused input projection of `small` ([1536, 4876]: 4876 columns, no power of two)."""
    k, n = 1536, 4876
    bk = qgemm.block_k(fmt)
    sw = S((k // bk, 39), F32) if fmt == "fp8" else S((k // bk, n), jnp.float8_e8m0fnu)
    col_block = S((n,), I32) if fmt == "fp8" else None
    fn = lambda xq, sx, wq, sw, cb: qgemm.qmatmul(fmt, xq, sx, wq, sw, cb, interpret=False)
    assert (
        lowered_triton_calls(
            fn, S((rows, k), jnp.float8_e4m3fn), S((rows, k // bk), F32), S((k, n), jnp.float8_e4m3fn), sw, col_block
        )
        == 1
    )


@pytest.mark.parametrize("rows", [32, 4096])  # a decode step's assignments, a prefill chunk's
def test_mxfp4_grouped_gemm_at_small_dims(rows):
    fn = lambda x, values, scales, sizes: moe_mxfp4.grouped_matmul_mxfp4(x, values, scales, sizes, interpret=False)
    assert (
        lowered_triton_calls(
            fn, S((rows, 768), BF16), S((32, 768, 768), jnp.uint8), S((32, 24, 1536), jnp.float8_e8m0fnu), S((32,), I32)
        )
        == 1
    )


@pytest.mark.parametrize("tokens", [4, 32, 128])  # gathered decode rows (few-row and wide tiles), the padded copy
def test_grouped_ffn_on_mxfp4_experts(tokens):
    """The decode step's routed experts with MXFP4 gate/up and down: the inline-PTX decode and the
    even / odd column stores lower."""
    act = lambda gate, up: jax.nn.silu(gate) * up
    fn = lambda x, ids, vg, sg, vo, so: moe.grouped_ffn(
        x, ids, mxfp4.PackedMXFP4(vg, sg), mxfp4.PackedMXFP4(vo, so), act=act, interpret=False
    )
    e8 = jnp.float8_e8m0fnu
    assert (
        lowered_triton_calls(
            fn,
            S((tokens, 768), BF16),
            S((tokens, 8), I32),
            S((32, 768, 768), jnp.uint8),
            S((32, 24, 1536), e8),
            S((32, 768, 384), jnp.uint8),
            S((32, 24, 768), e8),
        )
        == 2
    )


@pytest.mark.parametrize("impl, bounded, kernels", [("split", True, 3), ("intra_solve", True, 2), ("split", False, 4)])
def test_chunk_kda_prefill_lowers_as_its_triton_kernels(impl, bounded, kernels):
    """The prefill's kernels at the model's head dims, bf16, a state exported every 128 tokens:
    the split prepare (intra, solve) and the state pass with o in its loop, three Triton calls;
    with the intra and solve in one program, two; with an unbounded gate the exact diagonal
    tiles' kernel before them, four."""
    t, h, d = 1024, 4, 128
    fn = lambda q, k, v, g, beta: kda.chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        output_final_state=True,
        checkpoint_positions=list(range(128, t + 1, 128)),
        interpret=False,
        tuning={"prepare_impl": impl},
        gate_bounded=bounded,
    )
    calls = lowered_triton_calls(
        fn, *[S((1, t, h, d), BF16)] * 2, S((1, t, h, d), BF16), S((1, t, h, d), F32), S((1, t, h), BF16)
    )
    assert calls == kernels
