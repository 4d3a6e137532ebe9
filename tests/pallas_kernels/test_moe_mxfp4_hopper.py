"""The Hopper MXFP4 grouped GEMM's layout, its lowering, and its arithmetic in Mosaic GPU's
interpreter (decoded tiles staged through shared memory there; the register-operand body runs
on the GPU: tests/gpu/test_quant_kernels.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe_mxfp4_hopper as hopper
from pallas_kernels import mxfp4

S = jax.ShapeDtypeStruct


def _packed(rng, g, k, n):
    values = jnp.asarray(rng.integers(0, 256, (g, k, n // 2), dtype=np.uint8))
    bits = rng.integers(100, 134, (g, k // 32, n)).astype(np.uint8)
    bits[0, 0, :4] = (1, 2, 126, 254)  # 2^-126 .. 2^127 (2^-127, a subnormal, on the GPU: XLA:CPU flushes it)
    return mxfp4.PackedMXFP4(values, jnp.asarray(bits).view(jnp.float8_e8m0fnu))


@pytest.mark.parametrize("decode", hopper.DECODES)
def test_the_hopper_layout_holds_the_same_weights(decode):
    """Codes along K (two's complement integers for "arith", the e2m1 bits for "bits", "lut" and,
    permuted within each 32-wide block, "lut_perm") and the untouched exponents decode to the
    format's values, every code and both signs ("arith" by the kernel's own formula,
    `hopper.decode`)."""
    w = _packed(np.random.default_rng(0), 3, 128, 96)
    h = hopper.to_hopper(w, decode)
    if decode == "lut_perm":  # the code of K 32b + 8j + 2t + e stored at 32b + 8t + 2j + e
        plain = np.asarray(hopper.to_hopper(w, "lut").codes.astype(jnp.int8)).reshape(3, 96, 4, 4, 4, 2)
        np.testing.assert_array_equal(
            np.asarray(h.codes.astype(jnp.int8)).reshape(3, 96, 4, 4, 4, 2), plain.swapaxes(2 + 1, 2 + 2)
        )
    assert h.codes.dtype == jnp.int4 and h.codes.shape == (3, 96, 128) and h.shape == (3, 128, 96)
    assert h.scales.dtype == jnp.uint8 and h.scales.shape == (3, 4, 96)
    np.testing.assert_array_equal(
        np.asarray(hopper.dequantize(h, decode)), np.asarray(mxfp4.dequantize(w.values, w.scales))
    )
    with pytest.raises(ValueError, match="decode must be one of"):
        hopper.to_hopper(w, "table")


@pytest.mark.parametrize("decode", hopper.DECODES)
def test_moving_experts_a_group_at_a_time_gives_the_layout_of_moving_them_at_once(decode, monkeypatch):
    w = _packed(np.random.default_rng(2), 8, 64, 32)
    monkeypatch.setattr(hopper, "TO_HOPPER_EXPERTS_PER_PASS", 8)
    whole = hopper.to_hopper(w, decode)
    monkeypatch.setattr(hopper, "TO_HOPPER_EXPERTS_PER_PASS", 2)
    grouped = hopper.to_hopper(w, decode)
    assert grouped.codes.shape == whole.codes.shape == (8, 32, 64)
    np.testing.assert_array_equal(np.asarray(grouped.codes.astype(jnp.int8)), np.asarray(whole.codes.astype(jnp.int8)))
    np.testing.assert_array_equal(np.asarray(grouped.scales), np.asarray(whole.scales))


def test_the_decode_is_exact_in_bf16():
    """Every code times scales from 2^-126 to 2^127, computed in bf16 as the kernel computes it,
    is the format's value exactly (past the range, the same inf).  (XLA:CPU flushes subnormals,
    so the scale 2^-127 is checked on the GPU: tests/gpu/test_quant_kernels.py.)"""
    i = jnp.arange(-7, 8, dtype=jnp.float32)[:, None]
    scale = jnp.ldexp(1.0, jnp.asarray([-126, -125, -60, -1, 0, 1, 60, 125, 126, 127]))[None, :]
    got = hopper.decode(i.astype(jnp.bfloat16), scale.astype(jnp.bfloat16))
    mags = jnp.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    want = jnp.sign(i) * mags[jnp.abs(i).astype(jnp.int32)] * scale
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want))


def test_bad_operands_are_named_before_any_launch():
    h = hopper.to_hopper(_packed(np.random.default_rng(1), 2, 128, 128))
    x = jnp.zeros((32, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="codes must be int4"):
        hopper.gmm_padded(jnp.zeros((2,), jnp.int32), jnp.zeros((32, 256), jnp.bfloat16), h, 16)
    with pytest.raises(ValueError, match="bf16 rows"):
        hopper.gmm_padded(jnp.zeros((2,), jnp.int32), x.astype(jnp.float32), h, 16)
    with pytest.raises(ValueError, match="must divide"):
        hopper.gmm_padded(jnp.zeros((2,), jnp.int32), x, h, 16, block_n=96)
    with pytest.raises(ValueError, match="2 x block_n"):
        hopper.gmm_padded(
            jnp.zeros((2,), jnp.int32), x, h, 16, block_n=128, block_k=64, code_tile=64, warp_specialized=True
        )
    with pytest.raises(ValueError, match="scales must be uint8"):
        hopper.gmm_padded(jnp.zeros((2,), jnp.int32), x, hopper.HopperMXFP4(h.codes, h.scales[:, :2]), 16)
    with pytest.raises(ValueError, match="load4x"):
        hopper.gmm_padded(jnp.zeros((2,), jnp.int32), x, h, 16, block_k=128, load4x=True)
    with pytest.raises(ValueError, match="overlap needs"):
        hopper.gmm_padded(jnp.zeros((2,), jnp.int32), x, h, 16, block_k=128, steps=1, overlap=True)


_TILINGS = [
    (16, 128, 128, 4, 64, False, False, False),
    (8, 64, 256, 4, 256, False, False, False),
    (16, 256, 128, 3, 128, False, False, False),
    (64, 128, 128, 4, 128, False, False, False),
    (16, 128, 128, 4, 64, True, False, False),
    (8, 64, 256, 3, 128, True, False, False),
    (16, 128, 128, 4, 128, False, True, False),
    (16, 64, 128, 4, 64, True, True, False),
    (16, 128, 256, 4, 128, False, False, True),
    (16, 128, 256, 2, 128, False, True, True),
]


@pytest.mark.parametrize(
    "block_m, block_n, block_k, steps, code_tile, warp_specialized, load4x, overlap, decode",
    # the default decode at every tiling ("lut" where load4x shuffles), the others at two
    [t + ("lut" if t[6] else "lut_perm",) for t in _TILINGS]
    + [t + (d,) for t in (_TILINGS[0], _TILINGS[4]) for d in hopper.DECODES if d != "lut_perm"],
)
def test_lowers_for_hopper(block_m, block_n, block_k, steps, code_tile, warp_specialized, load4x, overlap, decode):
    """Mosaic GPU's own checks (layout inference of the int4 -> bf16 A operand, the inline PTX
    decode's registers, the operands' swizzles and tilings, the activations released a step late
    under overlap) run on this CPU machine."""
    g, k, n, m = 8, 1024, 512, 40
    fn = lambda x, c, s, sz: hopper.grouped_matmul(
        x,
        hopper.HopperMXFP4(c, s),
        sz,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        steps=steps,
        code_tile=code_tile,
        decode=decode,
        warp_specialized=warp_specialized,
        load4x=load4x,
        overlap=overlap,
    )
    jax.jit(fn).trace(
        S((m, k), jnp.bfloat16), S((g, n, k), jnp.int4), S((g, k // 32, n), jnp.uint8), S((g,), jnp.int32)
    ).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(
    "block_m, block_n, block_k, steps, code_tile, warp_specialized, decode, load4x, overlap",
    [
        (16, 64, 64, 2, 64, False, "arith", False, True),
        (16, 64, 256, 2, 128, True, "arith", True, False),
        (8, 64, 128, 3, 64, True, "bits", False, False),
        (16, 64, 128, 2, 128, False, "bits", True, False),
        (16, 64, 128, 2, 64, False, "lut", True, False),
        (16, 64, 128, 2, 128, False, "lut_perm", False, True),
    ],
)
def test_the_kernels_arithmetic_in_the_interpreter(
    block_m, block_n, block_k, steps, code_tile, warp_specialized, decode, load4x, overlap
):
    """Mosaic GPU's interpreter runs the kernel (both the single-warpgroup and the warp-specialized
    one: producer, two consumers on their own column halves; overlap: each step's activations
    released a step late, K in four steps through two buffers) with each decoded tile staged through
    shared memory, its only A operand.  Rows over 4 groups (one empty, the last rows in none)
    equal the product with the dequantized weights, each output rounded once to bf16.  XLA:CPU
    flushes bf16 subnormals, which the "bits" decode passes through for the codes +-1 (0.5 x
    2^-126 before its final multiply): those codes are left out of its weights here; the GPU
    checks every code (tests/gpu/test_quant_kernels.py)."""
    rng = np.random.default_rng(7)
    g, k, n, m = 4, 256, 256, 40
    w = _packed(rng, g, k, n)
    if decode == "bits":  # no code 1 or 9 (+-0.5) in either nibble
        v = np.asarray(w.values)
        lo, hi = v & 0xF, v >> 4
        lo = np.where((lo & 7) == 1, lo + 1, lo)
        hi = np.where((hi & 7) == 1, hi + 1, hi)
        w = mxfp4.PackedMXFP4(jnp.asarray((hi << 4 | lo).astype(np.uint8)), w.scales)
    bits = np.asarray(w.scales).view(np.uint8).copy()
    bits[:] = np.clip(bits, 118, 134)  # O(1) weights: products and sums far from bf16's range ends
    w = mxfp4.PackedMXFP4(w.values, jnp.asarray(bits).view(jnp.float8_e8m0fnu))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    sizes = jnp.asarray([10, 0, 20, 7], jnp.int32)
    got = np.asarray(
        hopper.grouped_matmul(
            x,
            hopper.to_hopper(w, decode),
            sizes,
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
            steps=steps,
            code_tile=code_tile,
            decode=decode,
            warp_specialized=warp_specialized,
            load4x=load4x,
            overlap=overlap,
            interpret=True,
        ).astype(jnp.float32)
    )
    wd = mxfp4.dequantize(w.values, w.scales).astype(jnp.float32)
    ref = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), wd, sizes, precision=jax.lax.Precision.HIGHEST))
    np.testing.assert_allclose(got, ref, rtol=2**-7, atol=1e-4 * np.max(np.abs(ref)))
    assert np.mean(got == np.asarray(jnp.asarray(ref).astype(jnp.bfloat16).astype(jnp.float32))) > 0.97
    assert not np.any(got[37:])


def _run_ptx(text: str, word: int) -> list[int]:
    """A reader of the few PTX instructions `_LUT_PTX` uses (and, shr, prmt in its default mode),
    run on one 32-bit input ($4) -> its four outputs ($0..$3)."""
    regs = {"$4": word}
    val = lambda t: regs[t] if t in regs else int(t, 0)
    for line in text.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "shr.u32":
            regs[dst] = val(src[0]) >> val(src[1])
        elif op == "prmt.b32":
            pool = [(val(src[0]) >> 8 * i) & 0xFF for i in range(4)] + [(val(src[1]) >> 8 * i) & 0xFF for i in range(4)]
            sel = val(src[2])
            assert all(not (sel >> 4 * j) & 8 for j in range(4)), "sign-replicate selectors are not modelled"
            regs[dst] = sum(pool[(sel >> 4 * j) & 7] << 8 * j for j in range(4))
        else:
            raise AssertionError(f"unmodelled PTX {op}")
    return [regs[f"${q}"] for q in range(4)]


def test_the_table_decodes_ptx_gives_the_bits_decodes_numbers_for_every_code():
    """`_e2m1_lut`'s PTX (read here instruction by instruction) turns a word of eight codes into
    the bf16s `_e2m1_bits` gives, code i of the word in half i % 2 of output word i // 2: every
    code in every position."""
    rng = np.random.default_rng(3)
    words = [
        sum(int(c) << 4 * i for i, c in enumerate(codes))
        for codes in [np.arange(8), np.arange(8, 16)] + [rng.integers(0, 16, 8) for _ in range(64)]
    ]
    for word in words:
        codes = [(word >> 4 * i) & 0xF for i in range(8)]
        want = np.asarray(hopper._e2m1_bits(jnp.asarray(codes, jnp.int8).astype(jnp.int4)[None], scaled=False))[0]
        got = [(w >> 16 * h) & 0xFFFF for w in _run_ptx(hopper._LUT_PTX, word) for h in range(2)]
        assert got == [int(v) for v in want.view(np.uint16)], (codes, got)


def test_the_serving_experts_on_the_hopper_mxfp4_kernel_equal_the_triton_ones():
    """MXFP4 experts moved into the Hopper kernel's layout at load (`ops.hopper_mxfp4_experts`,
    `KIMIK3_MOE_MXFP4=hopper`) serve `ops.grouped_ffn`, `ops.routed_ffn` (a decode step's) and
    `ops.grouped_matmul` (Mosaic GPU's interpreter here): tokens routed to two experts each, some to none, give the Triton MXFP4
    kernels' outputs within bf16 roundings (the same decoded weights; the activation between the
    GEMMs as XLA ops on the gate / up outputs rounded to bf16, as the Triton epilogue takes
    them).  Experts the Hopper kernel does not tile stay as they are."""
    from kimik3 import ops
    from kimik3.layers.moe import _SituGLU
    from kimik3.quant import formats

    rng = np.random.default_rng(11)
    n, top_k, l, f, e = 24, 2, 256, 256, 4
    q = lambda *s: formats.quantize((rng.standard_normal(s) * 0.05).astype(np.float32), "mxfp4")
    params = {"w_gateup_elf": q(e, l, 2 * f), "w_out_efl": q(e, f, l), "small": q(e, 64, 128)}
    x = jnp.asarray(rng.standard_normal((n, l)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e + 1, (n, top_k)), jnp.int32)
    act = _SituGLU((8.0, 8.0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMIK3_KERNELS", "pallas")
        want = np.asarray(ops.grouped_ffn(x, ids, params["w_gateup_elf"], params["w_out_efl"], act), np.float32)
        sizes = jnp.asarray([10, 0, 9, 5], jnp.int32)
        want_gmm = np.asarray(ops.grouped_matmul(x, params["w_gateup_elf"], sizes), np.float32)
        mp.setenv("KIMIK3_MOE_MXFP4", "triton")
        assert ops.hopper_mxfp4_experts(params) is params  # asked for the Triton kernels
        mp.setenv("KIMIK3_MOE_MXFP4", "hopper")
        assert ops.hopper_mxfp4_experts(params, "float32") is params  # the kernel multiplies bf16 rows
        moved = ops.hopper_mxfp4_experts(params)
        assert isinstance(moved["w_gateup_elf"], hopper.HopperMXFP4) and moved["w_gateup_elf"].shape == (e, l, 2 * f)
        assert moved["small"] is params["small"]  # K 64: not the kernel's 256-wide steps
        np.testing.assert_array_equal(
            np.asarray(ops.expert_weights(moved["w_out_efl"], jnp.float32)),
            np.asarray(ops.expert_weights(params["w_out_efl"], jnp.float32)),
        )
        assert ops.grouped_ffn_fits(x, moved["w_gateup_elf"], moved["w_out_efl"])
        assert not ops.grouped_ffn_fits(x.astype(jnp.float32), moved["w_gateup_elf"], moved["w_out_efl"])
        got = np.asarray(ops.grouped_ffn(x, ids, moved["w_gateup_elf"], moved["w_out_efl"], act), np.float32)
        got_gmm = np.asarray(ops.grouped_matmul(x, moved["w_gateup_elf"], sizes), np.float32)
        # a decode step's path: routing and layout in one kernel, the experts, combine + norm
        logits = jnp.asarray(rng.standard_normal((8, e)), jnp.float32)
        routed = [
            np.asarray(
                ops.routed_ffn(
                    x[:8],
                    logits,
                    jnp.zeros((e,), jnp.float32),
                    None,
                    w["w_gateup_elf"],
                    w["w_out_efl"],
                    act,
                    top_k,
                    jnp.ones((l,), jnp.float32),
                    1e-6,
                ),
                np.float32,
            )
            for w in (params, moved)
        ]
        assert ops.routed_ffn_fits(x[:8], moved["w_gateup_elf"], moved["w_out_efl"], top_k)
    np.testing.assert_allclose(routed[1], routed[0], rtol=2**-6, atol=2**-6 * np.max(np.abs(routed[0])))
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=2**-6 * scale)
    assert np.mean(got == want) > 0.9
    np.testing.assert_allclose(got_gmm, want_gmm, rtol=2**-7, atol=2**-7 * np.max(np.abs(want_gmm)))


def test_a_model_on_moved_experts_computes_what_it_computes_on_the_quantized_ones(monkeypatch):
    """`tiny` with MoE dims the Hopper kernel tiles (256), quantized under `fp8_attn` (MXFP4
    experts) and served as the model runner serves them (`stacked.serving_layout`, then
    `ops.hopper_mxfp4_experts` under `KIMIK3_MOE_MXFP4=hopper`): the model reads the moved experts
    (`qparam` passes them through), its logits on the reference kernels equal those on the
    quantized experts bit for bit, a stacked copy keeps them whole, and the tree still counts as
    MXFP4 for the prefix cache's namespace."""
    from kimik3 import config, model, ops, stacked
    from kimik3 import quant_store as store
    from kimik3.quant import formats

    cfg = config.tiny().replace(moe_latent_dim=256, moe_expert_dim=256, dtype="bfloat16")
    params = store.quantize_params(
        model.init_params(cfg, jax.random.PRNGKey(0), "float32"), cfg, "fp8_attn", fuse=False
    )
    served = stacked.serving_layout(params, cfg, scan=False)
    monkeypatch.setenv("KIMIK3_MOE_MXFP4", "hopper")
    moved = ops.hopper_mxfp4_experts(served, cfg.dtype)
    kinds = lambda tree: sorted(
        {
            type(leaf).__name__
            for leaf in jax.tree_util.tree_leaves(
                tree, is_leaf=lambda x: isinstance(x, (formats.QTensor, hopper.HopperMXFP4))
            )
        }
    )
    assert "HopperMXFP4" in kinds(moved) and "HopperMXFP4" not in kinds(served)
    assert formats.tree_formats(moved) == formats.tree_formats(served) == ("fp8", "mxfp4")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 12)), jnp.int32)
    want = model.forward(served, cfg, tokens, kernels="reference")[0]
    np.testing.assert_array_equal(
        np.asarray(model.forward(moved, cfg, tokens, kernels="reference")[0]), np.asarray(want)
    )
    # the prefill copy stacks periods leaf by leaf (`stacked.stack_positions`): a stacked tensor
    # keeps its type, its shape led by the periods
    gu = jax.tree_util.tree_leaves(moved, is_leaf=lambda x: isinstance(x, hopper.HopperMXFP4))
    gu = next(leaf for leaf in gu if isinstance(leaf, hopper.HopperMXFP4))
    two = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), gu, gu)
    assert isinstance(two, hopper.HopperMXFP4) and two.shape == (2,) + gu.shape
