"""The kernel switch: what runs where, and the fallbacks it takes."""

import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import ops
from pallas_kernels.moe import grouped_matmul_ref


def test_auto_means_references_off_the_gpu_and_bad_choices_are_refused(monkeypatch):
    assert ops.resolve("auto") == "reference"  # the tests run on CPU
    monkeypatch.setenv("KIMIK3_KERNELS", "pallas")
    assert ops.resolve("auto") == "pallas"
    monkeypatch.setenv("KIMIK3_KERNELS", "fast")
    with pytest.raises(ValueError, match="KIMIK3_KERNELS"):
        ops.resolve("auto")
    with pytest.raises(ValueError, match="kernels must be"):
        ops.resolve("cuda")


@pytest.mark.parametrize(
    "k, n, dtypes",
    [
        (32, 48, ("float32", "float32")),  # the Pallas kernel's tiling
        (24, 48, ("float32", "float32")),  # K not a multiple of 16
        (32, 48, ("float32", "bfloat16")),
    ],
)  # mixed dtypes
def test_grouped_matmul_takes_the_kernel_where_it_tiles_and_the_reference_elsewhere(rng, k, n, dtypes):
    lhs = jnp.asarray(rng.standard_normal((30, k)), dtypes[0])
    rhs = jnp.asarray(rng.standard_normal((3, k, n)), dtypes[1])
    sizes = jnp.asarray([10, 0, 20], jnp.int32)
    out = ops.grouped_matmul(lhs, rhs, sizes, kernels="pallas")
    want = grouped_matmul_ref(lhs, rhs.astype(lhs.dtype) if dtypes[0] != dtypes[1] else rhs, sizes)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype, dqk, dv, cc, want",
    [
        (jnp.bfloat16, 192, 128, "9.0", "hopper"),  # H100 / H200, the model's MLA dims
        (jnp.float16, 192, 128, "9.0", "hopper"),
        (jnp.float32, 192, 128, "9.0", "triton"),  # wgmma here takes 16-bit operands
        (jnp.bfloat16, 24, 16, "9.0", "triton"),  # tiny dims: not multiples of 64
        (jnp.bfloat16, 192, 128, "8.0", "triton"),  # no wgmma / TMA before Hopper
        (jnp.bfloat16, 192, 128, None, "triton"),  # off the GPU (interpret mode)
    ],
)
def test_mla_prefill_takes_the_hopper_kernel_only_where_it_runs(dtype, dqk, dv, cc, want):
    assert ops.mla_prefill_impl(dtype, dqk, dv, cc) == want


def test_mxfp4_experts_take_the_hopper_kernel_only_where_asked(monkeypatch):
    """`KIMIK3_MOE_MXFP4`: "auto" (the default) on a 9.x GPU only; "triton" never the Hopper
    kernel; "hopper" also off the GPU (the interpreter); anything else refused, naming the
    variable."""
    monkeypatch.delenv("KIMIK3_MOE_MXFP4", raising=False)
    assert [ops.moe_mxfp4_impl(cc) for cc in ("9.0", "8.0", None)] == ["hopper", "triton", "triton"]
    monkeypatch.setenv("KIMIK3_MOE_MXFP4", "auto")
    assert [ops.moe_mxfp4_impl(cc) for cc in ("9.0", "8.0", None)] == ["hopper", "triton", "triton"]
    monkeypatch.setenv("KIMIK3_MOE_MXFP4", "triton")
    assert [ops.moe_mxfp4_impl(cc) for cc in ("9.0", "8.0", None)] == ["triton"] * 3
    monkeypatch.setenv("KIMIK3_MOE_MXFP4", "hopper")
    assert [ops.moe_mxfp4_impl(cc) for cc in ("9.0", "8.0", None)] == ["hopper", "triton", "hopper"]
    monkeypatch.setenv("KIMIK3_MOE_MXFP4", "marlin")
    with pytest.raises(ValueError, match="KIMIK3_MOE_MXFP4"):
        ops.moe_mxfp4_impl("9.0")


def test_a_chunk_over_a_cache_takes_the_hopper_kernel_where_the_hopper_prefill_runs(monkeypatch):
    """`KIMIK3_MLA_CHUNK`: "auto" (the default) where the Hopper prefill runs (16-bit inputs,
    its dims, compute capability 9.x) and the chunk fills a Hopper tile (128 new tokens: a
    serving engine's 64-token bucket stays on Triton); "triton" always; "hopper" at any length,
    also off the GPU (the interpreter) where the dims fit; anything else refused."""
    bf = jnp.bfloat16
    for choice in (None, "auto"):
        if choice is None:
            monkeypatch.delenv("KIMIK3_MLA_CHUNK", raising=False)
        else:
            monkeypatch.setenv("KIMIK3_MLA_CHUNK", choice)
        assert [ops.mla_chunk_impl(bf, 192, 128, "9.0", t) for t in (128, 256, 2048)] == ["hopper"] * 3
        assert [ops.mla_chunk_impl(bf, 192, 128, "9.0", t) for t in (1, 64, 127)] == ["triton"] * 3
        assert [
            ops.mla_chunk_impl(*a, 256)
            for a in [(bf, 192, 128, "8.0"), (bf, 192, 128, None), (jnp.float32, 192, 128, "9.0"), (bf, 24, 16, "9.0")]
        ] == ["triton"] * 4
    monkeypatch.setenv("KIMIK3_MLA_CHUNK", "triton")
    assert ops.mla_chunk_impl(bf, 192, 128, "9.0", 256) == "triton"
    monkeypatch.setenv("KIMIK3_MLA_CHUNK", "hopper")
    assert ops.mla_chunk_impl(bf, 192, 128, None, 256) == "hopper"
    assert ops.mla_chunk_impl(bf, 192, 128, "9.0", 16) == "hopper"
    assert ops.mla_chunk_impl(bf, 24, 16, None, 256) == "triton"
    monkeypatch.setenv("KIMIK3_MLA_CHUNK", "cutlass")
    with pytest.raises(ValueError, match="KIMIK3_MLA_CHUNK"):
        ops.mla_chunk_impl(bf, 192, 128, "9.0", 256)


def test_the_hopper_chunk_kernel_serves_mla_attention_as_the_triton_one_does(monkeypatch, rng):
    """A chunk of 16 new tokens after cached prefixes of 37 and 0 tokens, through
    `ops.mla_attention` on the Pallas path: with `KIMIK3_MLA_CHUNK=hopper` the Hopper chunk kernel
    runs (Mosaic GPU's interpreter here) and gives the Triton kernel's outputs within bf16."""
    from pallas_kernels import mla_hopper

    b, t, h, r, rope, nope, dv, s = 2, 16, 2, 32, 64, 64, 64, 128
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    q, latent = f(b, t, h, nope + rope), f(b, s, r + rope)
    w_kb, w_vb = f(r, h, nope) * 0.2, f(r, h, dv) * 0.2
    q_pos = jnp.asarray([37, 0], jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    run = lambda: ops.mla_attention(
        q,
        latent,
        w_kb,
        w_vb,
        kv_lora=r,
        scale=(nope + rope) ** -0.5,
        q_pos_bt=q_pos,
        k_pos_bs=k_pos,
        absorbed=False,
        contiguous_cache=True,
        kernels="pallas",
    )
    monkeypatch.setenv("KIMIK3_MLA_CHUNK", "triton")
    triton = np.asarray(run(), np.float32)
    calls = []
    real = mla_hopper.mla_prefill_chunk_hopper
    monkeypatch.setattr(mla_hopper, "mla_prefill_chunk_hopper", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setenv("KIMIK3_MLA_CHUNK", "hopper")
    hopper = np.asarray(run(), np.float32)
    assert len(calls) == 1 and calls[0]["block_kv"] == 128
    assert hopper.shape == (b, t, h, dv)
    np.testing.assert_allclose(hopper, triton, atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    "dtype, kv_lora, rope, page, rows, max_keys, cc, want",
    [
        (jnp.bfloat16, 512, 64, 128, 96, 2048, "9.0", "hopper"),  # 96 heads, one query: two 64-row tiles
        (jnp.bfloat16, 512, 64, 128, 64, 2048, "9.0", "hopper"),  # 16 heads x 4 speculative tokens
        (jnp.bfloat16, 512, 64, 128, 16, 2048, "9.0", "triton"),  # 16 rows over a short context
        (jnp.bfloat16, 512, 64, 128, 16, 32768, "9.0", "hopper"),  # ... over a long one
        (jnp.float32, 512, 64, 128, 96, 2048, "9.0", "triton"),
        (jnp.bfloat16, 32, 16, 128, 96, 2048, "9.0", "triton"),  # tiny dims
        (jnp.bfloat16, 512, 64, 16, 96, 2048, "9.0", "triton"),  # pages shorter than a key tile
        (jnp.bfloat16, 512, 64, 128, 96, 2048, "8.0", "triton"),
        (jnp.bfloat16, 512, 64, 128, 96, 2048, None, "triton"),
    ],
)
def test_mla_decode_takes_the_hopper_kernel_where_it_is_faster(dtype, kv_lora, rope, page, rows, max_keys, cc, want):
    assert ops.mla_decode_impl(dtype, kv_lora, rope, page, rows, max_keys, cc) == want


def test_a_verify_pass_on_the_pallas_path_exports_what_the_reference_does(rng):
    """kda at chunk size 1 with every position exported (a speculative verify pass) on a state
    pool by slot: the recurrent kernel (interpret mode here) gives the reference's outputs, pool
    and exports, zeros for counts outside 1..T included."""
    from tests.pallas_kernels.test_kda_ref import kda_inputs

    q, k, v, g, beta = kda_inputs(rng, 2, 4, 2, 16, 16)
    pool = rng.standard_normal((5, 2, 16, 16)).astype(np.float32)  # a fresh copy per call: the kernel donates it
    slots = jnp.asarray([4, 1], jnp.int32)
    export_at = jnp.asarray([1, 2, 3, 4, 0, 6], jnp.int32)
    run = lambda kernels: ops.kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=jnp.asarray(pool),
        chunk_size=1,
        kernels=kernels,
        export_at=export_at,
        slots=slots,
    )
    got, want = run("pallas"), run("reference")
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    assert not np.asarray(got[2][:, 4:]).any()


@pytest.mark.parametrize("floor", [-4.0, -60.0])
def test_an_unbounded_gate_runs_the_chunk_kernel_exactly_at_any_depth(rng, floor):
    """Kimi-Linear's gate has no lower bound: with g down to -60 (exp(16 * 60) overflows the
    factored diagonal tiles) the chunk kernel with `gate_bounded=False` still gives the
    recurrence's outputs and state, finite (interpret mode); the bounded form would not."""
    from pallas_kernels.kda import kda_recurrent_ref
    from tests.pallas_kernels.test_kda_ref import kda_inputs

    q, k, v, _, beta = kda_inputs(rng, 1, 80, 2, 16, 16)
    g = jnp.asarray(rng.uniform(floor, 0.0, q.shape), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((1, 2, 16, 16)), jnp.float32)
    o_ref, s_ref = kda_recurrent_ref(q, k, v, g, beta, initial_state=s0)
    o, s = ops.kda(q, k, v, g, beta, initial_state=s0, kernels="pallas", gate_bounded=False)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    np.testing.assert_allclose(o, o_ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(s, s_ref, atol=1e-4, rtol=1e-4)
    if floor < ops.GATE_FLOOR:  # the factored tiles would not have survived these gates
        o_kernel = ops.kda(q, k, v, g, beta, initial_state=s0, kernels="pallas")[0]
        assert not np.isfinite(np.asarray(o_kernel)).all()
