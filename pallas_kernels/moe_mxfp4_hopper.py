"""The MXFP4 grouped expert GEMM as a Hopper kernel (Mosaic GPU): weights decoded in registers
as the wgmma's A operand, never through shared memory.

The Triton kernel (`moe._gmm_kernel` with `mxfp4.PackedMXFP4`) decodes each packed tile in
registers and then hands it to the MMA through shared memory; measured on the H200 that frame
tops out near half of the copy rate even with no decode at all (RESULTS.md, quantized weights).  Here
the product is computed transposed, ``out^T [N, rows] = W^T [N, K] @ x^T [K, rows]``, so the
weights are wgmma's A operand, which Hopper reads from registers: each warpgroup loads its
codes from shared memory (where TMA put them) straight into the A fragment's layout, decodes
and scales them there, and issues the wgmma with the rows' activations (B, [rows, K] in shared
memory, read transposed).  One program: one row tile of the group-aligned layout (one group)
times ``block_n`` output columns, K pipelined in ``block_k`` steps through TMA; or, warp-
specialized, a producer warpgroup issuing the copies and two consumers on ``block_n`` columns
each.  Mosaic GPU's interpreter runs both on the CPU (`interpret=True`: each decoded tile
staged through shared memory, the interpreter's only A operand).  The default decode,
"lut_perm", looks eight codes up at a time with `prmt` (inline PTX) from one 32-bit shared-memory
load, the codes stored permuted along K so that each lane loads exactly its A-layout codes
(`K_PERM`); the frame, not the decode, bounds the kernel (RESULTS.md, quantized weights).  The serving
engine holds MXFP4 experts in this layout from load on, on a 9.x GPU
(`kimik3.ops.hopper_mxfp4_experts`; ``KIMIK3_MOE_MXFP4=triton`` keeps the Triton MXFP4 kernels).

Layout (`to_hopper`, done once when the weights load):
  codes  [G, N, K] int4, two per byte along K (what TMA and the int4 -> bf16 upcast take): for
         the "arith" decode the e2m1 codes as sign-magnitude integers, ``i = (-1)^s * (code &
         7)`` in two's complement; for "bits" and "lut" the e2m1 bits as they are; for
         "lut_perm" those bits in `K_PERM`'s order within each 32-wide block of K;
  scales [G, K / 32, N] uint8: the e8m0 exponents as they are (4.25 bits a weight in all).
Decode "arith" (`decode`): ``|i|`` indexes the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 in order,
which are ``2|i| - min(|i|, 6) - min(|i|, 4) / 2``: an odd function of i, so two clips, a few
multiply-adds and the block's power-of-two scale last, every step exact in bf16; the decoded tile
equals `mxfp4.dequantize` bit for bit and the kernel differs from the reference only in fp32
accumulation order.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa, utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import moe_layout, mxfp4

MX_BLOCK = mxfp4.MX_BLOCK


class HopperMXFP4(NamedTuple):
    """Expert weights [G, K, N] in the Hopper kernel's layout (the module comment): codes
    [G, N, K] int4, scales [G, K / 32, N] uint8 (e8m0 exponents)."""

    codes: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, g, n, k = self.codes.shape  # (lead: a stacked tree's leading axes)
        return (*lead, g, k, n)


# How the kernel turns codes into bf16: "arith", codes as two's complement integers through the
# int4 -> bf16 upcast and `decode`; "bits", the e2m1 bits as they are, moved into a bf16's bit
# pattern with integer ops (`_e2m1_bits`); "lut", the same bits and the same bf16s, eight codes
# at a time through byte-permute table lookups (`_e2m1_lut`); "lut_perm", "lut" on codes stored
# permuted along K (`K_PERM`) so that one 32-bit shared-memory load gives a thread the eight codes
# wgmma's A layout wants of it, where "lut" loads them a byte (two codes) at a time.  Each needs
# its own code layout (`to_hopper`: "lut" takes the "bits" one).
DECODES = ("arith", "bits", "lut", "lut_perm")
# The decode `to_hopper` lays codes out for, and `gmm_padded` reads, unless told otherwise (and
# the layout of experts `kimik3.ops.hopper_mxfp4_experts` moves).
DEFAULT_DECODE = "lut_perm"
# Not MXFP4: the codes' integers (the int4 -> bf16 upcast alone) times the block scale, the
# cheapest decode there is.  A timing probe of the kernel's frame (`grouped_matmul(...,
# decode=PROBE_DECODE)` on the "arith" layout; unchecked, and no registered benchmark runs it):
# how fast the kernel would be if decoding cost nothing beyond the upcast.
PROBE_DECODE = "upcast_probe"


# "lut_perm"'s order of the codes along K within each 32-wide block (an MX block: the scales do
# not move).  wgmma's A layout gives lane t of a row's four the K pairs 2t + 8j + {0, 1}, j = 0..3
# (Mosaic GPU's WGMMA layout); a 32-bit load in the WGMMA_UPCAST_4X layout gives it the eight codes
# 8t .. 8t + 7.  So the code of K 8j + 2t + e is stored at 8t + 2j + e: byte j of the loaded word is
# then the A layout's register for the j-th 8-wide column tile, and no code changes thread.
# K_PERM[stored position] = the K (within the block) whose code is stored there.
K_PERM = tuple(8 * j + 2 * t + e for t in range(4) for j in range(4) for e in range(2))


def _permute_k(codes_gnk, inverse: bool = False):
    """codes [..., K] in K order -> "lut_perm"'s stored order (`K_PERM`); inverse: back."""
    perm = list(K_PERM)
    if inverse:
        perm = [perm.index(i) for i in range(MX_BLOCK)]
    blocks = codes_gnk.reshape(codes_gnk.shape[:-1] + (-1, MX_BLOCK))
    return blocks[..., jnp.asarray(perm)].reshape(codes_gnk.shape)


def _unpermute_tile(vals):
    """A decoded [bn, c] tile of "lut_perm" codes, columns in stored order -> K order: column
    8t + 2j + e of a block holds K 8j + 2t + e, so a transpose of (t, j) within each block (the
    interpreter's path; on the GPU the registers land in the A layout as loaded)."""
    bn, c = vals.shape
    return vals.reshape(bn, c // MX_BLOCK, 4, 4, 2).swapaxes(2, 3).reshape(bn, c)


# experts moved per pass of `to_hopper`: GPU XLA lowers the nibble unpack + transpose of all G
# experts at once with temporaries of ~16 bytes per code (18 GiB for Kimi-Linear's 256 x 2304 x
# 2048 gate-up codes); one pass per group of this many bounds them to a few hundred MB.
TO_HOPPER_EXPERTS_PER_PASS = 16


def _hopper_codes(v, decode: str):
    """Packed code pairs [..., K, N / 2] uint8 -> the kernel's codes [..., N, K] int8."""
    codes = jnp.stack([v & 0xF, v >> 4], axis=-1).reshape(v.shape[:-1] + (-1,)).astype(jnp.int8)  # [.., K, N]
    if decode == "arith":
        codes = jnp.where(codes >= 8, 8 - codes, codes)  # sign-magnitude -> two's complement (-0 -> 0)
    else:
        codes = jnp.where(codes >= 8, codes - 16, codes)  # the same 4 bits, read as an int4
    codes = jnp.swapaxes(codes, -1, -2)  # [.., N, K]
    return _permute_k(codes) if decode == "lut_perm" else codes


def to_hopper(w: mxfp4.PackedMXFP4, decode: str = DEFAULT_DECODE) -> HopperMXFP4:
    """The Triton layout (codes packed in pairs along N) -> the Hopper kernel's (module comment),
    for the kernel's `decode` (DECODES).  Pure data movement: no value changes.  Experts move
    `TO_HOPPER_EXPERTS_PER_PASS` at a time (a sequential map), so the temporaries stay small."""
    mxfp4.check(w)
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}; got {decode!r}")
    v = w.values
    g, k, p = v.shape
    per = TO_HOPPER_EXPERTS_PER_PASS
    if g > per and g % per == 0:
        codes = lax.map(lambda part: _hopper_codes(part, decode).astype(jnp.int4), v.reshape(g // per, per, k, p))
        codes = codes.reshape(g, 2 * p, k)
    else:
        codes = _hopper_codes(v, decode).astype(jnp.int4)
    return HopperMXFP4(codes, lax.bitcast_convert_type(w.scales, jnp.uint8))


def decode(i, scale=None):
    """The kernel's decode, written once: codes i as signed magnitudes (any float dtype holding
    -7..7 exactly) and their block's scale, broadcast to i's shape -> i's e2m1 value times the
    scale (None: the value alone, the kernel's scales following).  The magnitudes 0, .5, 1,
    1.5, 2, 3, 4, 6 of |i| = 0..7 are 2|i| - min(|i|, 6) - min(|i|, 4) / 2, an odd function of
    i: no sign handling, every step exact in bf16, and the scale multiplies the value last, as
    `mxfp4.dequantize` does (so a value overflows, or underflows, exactly where the format's
    does)."""
    value = jnp.clip(i, -4, 4) * -0.5 + (i * 2.0 - jnp.clip(i, -6, 6))
    return value if scale is None else value * scale


def dequantize(w: HopperMXFP4, decode_: str = "arith"):
    """float32 [G, K, N] of weights in the Hopper layout for `decode_` (the "arith" kernel's
    `decode` in plain jnp; "bits", "lut" and "lut_perm" codes through the format's own decode)."""
    scale = jnp.repeat(mxfp4.pow2_of_e8m0(w.scales.astype(jnp.int32)), MX_BLOCK, axis=1)  # [G, K, N]
    codes = w.codes
    if decode_ == "lut_perm":
        codes = _permute_k(codes, inverse=True)
    codes = jnp.swapaxes(codes, 1, 2)
    if decode_ in ("bits", "lut", "lut_perm"):
        return mxfp4.decode_e2m1(codes.astype(jnp.int32) & 0xF) * scale
    return decode(codes.astype(jnp.float32), scale)


def check(w: HopperMXFP4, k: int, what: str = "MXFP4 grouped GEMM (Hopper)"):
    """ValueError naming the mismatch, before any launch."""
    g, n, k2 = w.codes.shape
    if w.codes.dtype != jnp.int4 or k2 != k:
        raise ValueError(f"{what}: codes must be int4 [G, N, K={k}]; got {w.codes.dtype} {w.codes.shape}")
    if w.scales.dtype != jnp.uint8 or w.scales.shape != (g, k // MX_BLOCK, n) or k % MX_BLOCK:
        raise ValueError(
            f"{what}: scales must be uint8 [G, K / 32, N] = {(g, k // MX_BLOCK, n)}; "
            f"got {w.scales.dtype} {w.scales.shape}"
        )


def _scale_bf16(scale_u8, shape):
    """e8m0 exponents [bn] uint8 -> their powers of two in bf16 (2^-127: a subnormal), broadcast
    along the columns of `shape` [bn, 32]."""
    return lax.broadcast_in_dim(mxfp4._bf16_of_e8m0(scale_u8.astype(jnp.int32)), shape, (0,))


def _e2m1_bits(codes, scaled: bool = True):
    """int4 e2m1 bits [bn, c] -> bf16 values [bn, c]: the sign to bit 15 and the exponent and
    mantissa bits to bits 6-8 make the bf16 of the value times 2^-126 (a subnormal for the codes
    0 and 1, as in `mxfp4.decode_tile`'s PTX); one multiply by 2^126 restores it (scaled=False:
    left out)."""
    c = codes.astype(jnp.int16)
    bits = lax.shift_left(c & 8, jnp.int16(12)) | lax.shift_left(c & 7, jnp.int16(6))
    vals = lax.bitcast_convert_type(bits, jnp.bfloat16)
    return vals * jnp.bfloat16(2.0**126) if scaled else vals


# e2m1 magnitude bits -> the bytes of the bf16 of the value times 2^-126 (`_e2m1_bits`' numbers):
# s<<15 | mag<<6, whose low byte is (m1 m0)<<6 and high byte s<<7 | m2, so each byte is a lookup
# of two of the code's bits: table entry i is the byte for index i
_LUT_LO = 0xC0804000  # index (m1, m0): 0x00, 0x40, 0x80, 0xC0
_LUT_HI = 0x81800100  # index (s, m2): 0x00, 0x01, 0x80, 0x81
_LUT_PTX = f"""{{
.reg .b32 sl, sh, sl1, sh1, lo, hi, lo1, hi1;
and.b32 sl, $4, 0x33333333;
shr.u32 sh, $4, 2;
and.b32 sh, sh, 0x33333333;
shr.u32 sl1, sl, 16;
shr.u32 sh1, sh, 16;
prmt.b32 lo, {_LUT_LO}, 0, sl;
prmt.b32 hi, {_LUT_HI}, 0, sh;
prmt.b32 lo1, {_LUT_LO}, 0, sl1;
prmt.b32 hi1, {_LUT_HI}, 0, sh1;
prmt.b32 $0, lo, hi, 0x5140;
prmt.b32 $1, lo, hi, 0x7362;
prmt.b32 $2, lo1, hi1, 0x5140;
prmt.b32 $3, lo1, hi1, 0x7362;
}}"""


def _e2m1_lut(codes, permuted: bool = False):
    """int4 e2m1 bits [bn, c] (wgmma's A layout) -> bf16 [bn, c], each the code's value times
    2^-126 (`_e2m1_bits`' numbers, bit for bit), eight codes (one 32-bit word) at a time: the
    two bytes of each bf16 looked up with `prmt` in 4-entry tables (`_LUT_LO`, `_LUT_HI`) and
    interleaved, 13 instructions for 8 codes (the integer path spends several per code).
    permuted: codes [bn, c] in the WGMMA_UPCAST_4X layout, stored in `K_PERM`'s order, so that
    each loaded word's byte j is the A layout's register of column tile 4 x (the word's 32-wide
    tile) + j (`_e2m1_lut_permuted`).  GPU only (inline PTX); the interpreter takes the format's
    own decode (`_decode_tiles`)."""
    if permuted:
        return _e2m1_lut_permuted(codes)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(codes.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def lut(_, arr):
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        flat = list(np.ndenumerate(arr.registers))
        width = ir.VectorType(flat[0][1].type).shape[0]  # codes a register
        per = 8 // width
        if len(flat) % per:
            raise ValueError(f"e2m1 table decode: {len(flat)} registers of {width} codes do not make 32-bit words")
        out = np.empty_like(arr.registers)
        for start in range(0, len(flat), per):
            group = flat[start : start + per]
            word = utils.bitcast(utils.vector_concat([r for _, r in group]), i32)
            res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [word], _LUT_PTX, "=r,=r,=r,=r,r")
            vals = utils.vector_concat([utils.bitcast(llvm.extractvalue(i32, res, (q,)), pair) for q in range(4)])
            for j, (idx, _) in enumerate(group):
                out[idx] = utils.vector_slice(vals, slice(j * width, (j + 1) * width))
        return fa.FragmentedArray(_registers=out, _layout=arr.layout, _is_signed=None)

    return lut(codes)


def _e2m1_lut_permuted(codes):
    """`_e2m1_lut` of "lut_perm" codes [bn, c] loaded in the WGMMA_UPCAST_4X layout (each lane
    a 32-bit word: 8 codes of a row, `K_PERM`'s order) -> bf16 [bn, c] in wgmma's A layout, no
    code crossing lanes.  The two layouts' register arrays differ only in their column axis
    (axis 1: 32-wide tiles against 8-wide), so the word at (a, c, ...) gives the A registers
    (a, 4c + j, ...), j its byte."""

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
        return_type=plgpu.ShapeDtypeStruct(codes.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def lut(_, arr):
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(fa.WGMMA_LAYOUT.registers_shape(tuple(arr.shape)), dtype=object)
        if arr.registers.shape[1] * 4 != out.shape[1] or arr.registers.shape[2:] != out.shape[2:]:
            raise ValueError(
                f"e2m1 table decode (permuted): registers {arr.registers.shape} do not map onto the "
                f"A layout's {out.shape}"
            )
        for idx, reg in np.ndenumerate(arr.registers):
            res = llvm.inline_asm(
                llvm.StructType.get_literal([i32] * 4), [utils.bitcast(reg, i32)], _LUT_PTX, "=r,=r,=r,=r,r"
            )
            for j in range(4):
                out[(idx[0], 4 * idx[1] + j) + idx[2:]] = utils.bitcast(llvm.extractvalue(i32, res, (j,)), pair)
        return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return lut(codes)


def _decode_tiles(codes_i4, scales_u8, decode_: str):
    """Codes [bn, c] int4 (c a multiple of 32) and the c / 32 blocks' e8m0 exponent rows (a list
    of [bn]) -> each block's bf16 [bn, 32] weights: the codes' values (exact in bf16), then each
    block's power-of-two scale, last.  decode_ "lut_interpret": "lut"'s codes through the
    format's own decode (the interpreter runs no PTX; no subnormal on the way, which XLA:CPU
    would flush)."""
    if decode_ in ("lut", "lut_perm"):
        vals = _e2m1_lut(codes_i4, permuted=decode_ == "lut_perm") * jnp.bfloat16(2.0**126)
    elif decode_ in ("lut_interpret", "lut_perm_interpret"):
        vals = mxfp4.decode_e2m1(codes_i4.astype(jnp.int32) & 0xF).astype(jnp.bfloat16)
        if decode_ == "lut_perm_interpret":
            vals = _unpermute_tile(vals)
    elif decode_ == "bits":
        vals = _e2m1_bits(codes_i4)
    elif decode_ == PROBE_DECODE:  # not MXFP4: the codes' integers
        vals = codes_i4.astype(jnp.bfloat16)
    else:
        vals = decode(codes_i4.astype(jnp.bfloat16))
    return [
        vals[:, h * MX_BLOCK : (h + 1) * MX_BLOCK] * _scale_bf16(s, (vals.shape[0], MX_BLOCK))
        for h, s in enumerate(scales_u8)
    ]


def _load_codes(codes_ref, load4x: bool, permuted: bool = False):
    """A [bn, c] int4 tile of codes from shared memory into wgmma's A layout.  load4x: 32-bit
    loads, each thread 8 codes of a row at once (Mosaic GPU's WGMMA_UPCAST_4X layout, as JAX's
    mixed-type matmul reads its int4 operand), then shuffled among the threads into the A layout;
    else loaded in the A layout directly (2 codes, 8 bits, a load).  permuted ("lut_perm"'s
    codes): the 32-bit loads and no shuffle (its decode puts each byte where the A layout wants
    it)."""
    if permuted:
        return plgpu.load(codes_ref, layout=plgpu.Layout.WGMMA_UPCAST_4X)
    if not load4x:
        return codes_ref[...]
    return plgpu.layout_cast(plgpu.load(codes_ref, layout=plgpu.Layout.WGMMA_UPCAST_4X), plgpu.Layout.WGMMA)


def _mma_step(
    acc_ref,
    x_smem,
    codes_smem,
    scales_smem,
    *,
    block_k,
    code_tile,
    decode_,
    rows=None,
    stage=None,
    load4x=False,
    overlap=False,
):
    """One pipeline step of a warpgroup: its codes' rows (`rows`: a slice of the block's, or all)
    decoded 32 K at a time into wgmma's A operand, times the step's activations (B, transposed),
    accumulated into acc_ref; waits for its MMAs before the step's buffers are released, or
    (overlap) for the previous step's only, whose activations the pipeline released one step late
    (`delay_release`), so this step's MMAs run on under the next step's decode.
    stage: None on the GPU (A from registers); under Mosaic GPU's interpreter, which reads A from
    shared memory only, a [rows, 32] shared buffer each decoded tile passes through."""
    per = code_tile // MX_BLOCK
    codes = codes_smem if rows is None else codes_smem.at[rows]
    if decode_ in ("lut", "lut_perm") and stage is not None:  # the interpreter runs no PTX
        decode_ += "_interpret"
    for c in range(block_k // code_tile):
        scale_rows = [scales_smem[c * per + h] if rows is None else scales_smem[c * per + h, rows] for h in range(per)]
        tiles = _decode_tiles(
            _load_codes(codes.at[:, pl.ds(c * code_tile, code_tile)], load4x, permuted=decode_.startswith("lut_perm")),
            scale_rows,
            decode_,
        )
        for h, w in enumerate(tiles):
            x_t = x_smem.at[:, pl.ds((c * per + h) * MX_BLOCK, MX_BLOCK)].T
            if stage is not None:
                stage[...] = w
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, stage, x_t)
                plgpu.wgmma_wait(0)
            else:
                plgpu.wgmma(acc_ref, w, x_t)
    plgpu.wgmma_wait(block_k // MX_BLOCK if overlap and stage is None else 0)  # one group per wgmma call


def _kernel(
    tile_group_gmem,
    x_gmem,
    codes_gmem,
    scales_gmem,
    out_gmem,
    o_smem,
    stage=None,
    *,
    block_m,
    block_n,
    block_k,
    n_k,
    steps,
    code_tile,
    decode_,
    load4x=False,
    overlap=False,
):
    """One program: a row tile of one group times block_n columns.  stage: `_mma_step`'s (the
    interpreter's staging buffer, a scratch ref), or None on the GPU.  overlap: `_mma_step`'s, the
    activations' buffers released a step late."""
    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    group = tile_group_gmem[mi]

    @pl.when(group >= 0)  # tiles past the last group hold no row anyone reads
    def _():
        def acc_scope(acc_ref):
            def step(_, x_smem, codes_smem, scales_smem):
                _mma_step(
                    acc_ref,
                    x_smem,
                    codes_smem,
                    scales_smem,
                    block_k=block_k,
                    code_tile=code_tile,
                    decode_=decode_,
                    stage=stage,
                    load4x=load4x,
                    overlap=overlap,
                )

            plgpu.emit_pipeline(
                step,
                grid=(n_k,),
                max_concurrent_steps=steps,
                in_specs=[
                    plgpu.BlockSpec(
                        (block_m, block_k),
                        lambda k: (mi, k),
                        delay_release=int(overlap),
                        transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64)),
                    ),
                    plgpu.BlockSpec(
                        (block_n, block_k),
                        lambda k: (ni, k),
                        transforms=(plgpu.TilingTransform((8, code_tile)), plgpu.SwizzleTransform(code_tile // 2)),
                    ),
                    plgpu.BlockSpec((block_k // MX_BLOCK, block_n), lambda k: (k, ni)),
                ],
            )(x_gmem, codes_gmem.at[group], scales_gmem.at[group])
            plgpu.wgmma_wait(0)  # overlap: the last step's MMAs
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_n, block_m), jnp.float32))
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(ni * block_n, block_n), pl.ds(mi * block_m, block_m)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel_ws(
    tile_group_gmem,
    x_gmem,
    codes_gmem,
    scales_gmem,
    out_gmem,
    o_smem,
    *,
    block_m,
    block_n,
    block_k,
    n_k,
    steps,
    code_tile,
    decode_,
    interpret=False,
    load4x=False,
):
    """`_kernel` warp-specialized: a producer warpgroup issues the TMA copies and two consumer
    warpgroups each take half of the program's 2 * block_n columns, so one decodes while the
    other's MMAs run (JAX's own Hopper mixed-type matmul is built so)."""
    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    group = tile_group_gmem[mi]

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(n_k,),
            memory_registers=40,
            max_concurrent_steps=steps,
            wg_axis="wg",
            num_compute_wgs=2,
            compute_context=context,
            in_specs=[
                plgpu.BlockSpec(
                    (block_m, block_k),
                    lambda k: (mi, k),
                    transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64)),
                ),
                plgpu.BlockSpec(
                    (2 * block_n, block_k),
                    lambda k: (ni, k),
                    transforms=(plgpu.TilingTransform((8, code_tile)), plgpu.SwizzleTransform(code_tile // 2)),
                ),
                plgpu.BlockSpec((block_k // MX_BLOCK, 2 * block_n), lambda k: (k, ni)),
            ],
        )

    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem, codes_gmem.at[0], scales_gmem.at[0]),
        stages=plgpu.SMEM((2, block_n, MX_BLOCK), x_gmem.dtype) if interpret else None,
        collective_axes="wg",
    )
    def _(allocs, stages):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * block_n, block_n)

        def context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((block_n, block_m), jnp.float32))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                o_smem[wg] = acc_ref[...].astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg], out_gmem.at[pl.ds((2 * ni + wg) * block_n, block_n), pl.ds(mi * block_m, block_m)]
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def body(_, x_smem, codes_smem, scales_smem, acc_ref):
            _mma_step(
                acc_ref,
                x_smem,
                codes_smem,
                scales_smem,
                block_k=block_k,
                code_tile=code_tile,
                decode_=decode_,
                rows=rows,
                stage=None if stages is None else stages.at[wg],
                load4x=load4x,
            )
            return acc_ref

        @pl.when(group >= 0)  # tiles past the last group hold no row anyone reads
        def _():
            pipeline(body, context)(x_gmem, codes_gmem.at[group], scales_gmem.at[group], allocations=allocs)


def gmm_padded(
    tile_group,
    x_pad,
    w: HopperMXFP4,
    block_m: int,
    *,
    block_n: int = 128,
    block_k: int = 256,
    steps: int = 4,
    code_tile: int = 128,
    decode: str = DEFAULT_DECODE,
    warp_specialized: bool = False,
    load4x: bool = False,
    overlap: bool = False,
    interpret: bool = False,
):
    """Rows already in the group-aligned layout (`moe_layout.padded_layout`): x_pad [n_tiles *
    block_m, K] bf16, tile_group [n_tiles] int32 (-1: past the groups) -> out [n_tiles * block_m,
    N] bf16 (rows of tiles past the groups are not written: callers gather only their rows).
    decode: the codes' encoding (DECODES; `to_hopper` with the same).  warp_specialized: a
    producer warpgroup and two consumers, each taking block_n of the program's 2 * block_n
    columns (`_kernel_ws`).  load4x: the codes read from shared memory 8 at a time and shuffled
    into the A layout (`_load_codes`; not with "lut_perm", which reads them so without shuffles).  overlap: each step's MMAs left running under the next
    step's decode (`_mma_step`; steps >= 2; not with warp_specialized).  interpret: Mosaic GPU's
    interpreter (CPU), the decoded tiles staged through shared memory."""
    rows, k = x_pad.shape
    g, n, _ = w.codes.shape
    check(w, k)
    if decode not in DECODES + (PROBE_DECODE,):
        raise ValueError(f"MXFP4 grouped GEMM (Hopper): decode must be one of {DECODES}; got {decode!r}")
    if x_pad.dtype != jnp.bfloat16:
        raise ValueError(f"MXFP4 grouped GEMM (Hopper) multiplies bf16 rows; got {x_pad.dtype}")
    if (
        block_m % 8
        or rows % block_m
        or n % block_n
        or block_n % 64
        or k % block_k
        or block_k % code_tile
        or code_tile not in (64, 128, 256)
    ):
        raise ValueError(
            f"MXFP4 grouped GEMM (Hopper): rows {rows} / block_m {block_m} (a multiple of 8), "
            f"N {n} / block_n {block_n} (of 64), K {k} / block_k {block_k} (of code_tile {code_tile}: "
            f"64, 128 or 256) must divide"
        )
    if load4x and decode == "lut_perm":
        raise ValueError(
            'MXFP4 grouped GEMM (Hopper): load4x shuffles codes into the A layout; "lut_perm" '
            'codes load there as they are (take decode="lut" for load4x)'
        )
    if overlap and (warp_specialized or steps < 2):
        raise ValueError(
            f"MXFP4 grouped GEMM (Hopper): overlap needs steps >= 2 (got {steps}) and no warp specialization"
        )
    kw = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        n_k=k // block_k,
        steps=steps,
        code_tile=code_tile,
        decode_=decode,
        load4x=load4x,
    )
    mode = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    if warp_specialized:
        if n % (2 * block_n):
            raise ValueError(f"MXFP4 grouped GEMM (Hopper, warp-specialized): N {n} must divide by 2 x block_n")
        out_t = plgpu.kernel(
            functools.partial(_kernel_ws, interpret=interpret, **kw),
            out_type=jax.ShapeDtypeStruct((n, rows), x_pad.dtype),
            grid=(rows // block_m, n // (2 * block_n)),
            grid_names=("m", "n"),
            num_threads=3,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
            scratch_types=dict(o_smem=plgpu.SMEM((2, block_n, block_m), x_pad.dtype)),
            **mode,
        )(tile_group, x_pad, w.codes, w.scales)
    else:
        out_t = plgpu.kernel(
            functools.partial(_kernel, overlap=overlap, **kw),
            out_type=jax.ShapeDtypeStruct((n, rows), x_pad.dtype),
            grid=(rows // block_m, n // block_n),
            grid_names=("m", "n"),
            scratch_types=dict(
                o_smem=plgpu.SMEM((block_n, block_m), x_pad.dtype),
                **(dict(stage=plgpu.SMEM((block_n, MX_BLOCK), x_pad.dtype)) if interpret else {}),
            ),
            **mode,
        )(tile_group, x_pad, w.codes, w.scales)
    return out_t.T


def grouped_matmul(lhs_mk, w: HopperMXFP4, group_sizes_g, *, block_m=None, **tiling):
    """`moe.grouped_matmul`'s contract on Hopper-layout MXFP4 weights: lhs [M, K] bf16 rows
    sorted by group, group_sizes [G] -> [M, N] bf16 (rows past the groups' sum give 0).
    tiling: `gmm_padded`'s block_n / block_k / steps / code_tile / decode / warp_specialized / load4x /
    overlap / interpret."""
    check(w, lhs_mk.shape[1])
    block_m = block_m or moe_layout.layout_block_m(lhs_mk.shape[0])
    return moe_layout.through_padded_layout(
        lhs_mk, group_sizes_g, block_m, lambda tile_group, x_pad: gmm_padded(tile_group, x_pad, w, block_m, **tiling)
    )
