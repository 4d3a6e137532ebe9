"""OCP MXFP4 weights inside the Triton kernels: the packed layout and its decode to 16-bit values.

A weight [.., K, N] is stored as e2m1 codes packed two per byte along N (column 2c in the low
nibble, 2c + 1 in the high: ``values [.., K, N / 2] uint8``) and one e8m0 scale per 32 K of each
column (``scales [.., K / 32, N] float8_e8m0fnu``): 4.25 bits a weight, the layout of
`kimik3.quant.formats` (kernels import nothing from the model package, so it is restated here).

`decode_tile` turns a [32, P] tile of packed bytes and the two scale rows of its even and odd
columns into the even and odd columns' values times their scales, exactly (an e2m1 value is two
significant bits; a scale is a power of two).  On the GPU with bf16 activations it runs as inline
PTX: four packed bytes a register, two bf16 lanes at a time (``prmt`` spreads the bytes into the
high byte of each 16-bit lane; shifts and one ``lop3`` put a code's sign at bit 15 and its three
exponent / mantissa bits at bits 6-8, which is the bf16 of value * 2^-126, a bf16 subnormal for
the codes 0 and 1; ``fma.rn.bf16x2`` by 2^126 and then by the scale restores the value): ~3
instructions a weight, where the float formulation (`decode_e2m1`) takes ~15 and made the MXFP4
grouped GEMM ALU-bound at decode.  Elsewhere (interpret mode, fp16) it is `decode_e2m1` in jnp.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

MX_BLOCK = 32


class PackedMXFP4(NamedTuple):
    """Weights [G, K, N] as MXFP4 (the module comment): values [G, K, N / 2] uint8, scales
    [G, K / 32, N] float8_e8m0fnu."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:
        g, k, p = self.values.shape
        return g, k, 2 * p


def check(w: PackedMXFP4, what: str = "MXFP4 weights"):
    """ValueError naming the mismatch, before any launch."""
    g, k, p = w.values.shape
    if w.values.dtype != jnp.uint8:
        raise ValueError(f"{what}: packed uint8 values [G, K, N / 2] expected; got {w.values.dtype} {w.values.shape}")
    if k % MX_BLOCK or w.scales.shape != (g, k // MX_BLOCK, 2 * p) or w.scales.dtype != jnp.float8_e8m0fnu:
        raise ValueError(
            f"{what}: scales must be e8m0 [G, K / 32, N] = {(g, k // MX_BLOCK, 2 * p)}; "
            f"got {w.scales.dtype} {w.scales.shape}"
        )


def decode_e2m1(code):
    """int32 4-bit e2m1 codes -> float32 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives):
    exponent e = code[2:1], mantissa m = code[0]: m / 2 for e = 0, (1 + m / 2) 2^(e - 1) else."""
    c = code & 7
    e, m = c >> 1, (c & 1).astype(jnp.float32)
    pow2 = jax.lax.bitcast_convert_type(jax.lax.shift_left(e + 125, 23), jnp.float32)  # 2^(e - 2)
    mag = jnp.where(e == 0, m * 0.5, (m + 2.0) * pow2)
    return jnp.where(code >= 8, -mag, mag)


def pow2_of_e8m0(bits):
    """int32 e8m0 bit patterns (biased exponents) -> float32 2^(bits - 127) (0: 2^-127, fp32's
    subnormal 0x00400000)."""
    return jax.lax.bitcast_convert_type(jnp.where(bits == 0, 0x00400000, jax.lax.shift_left(bits, 23)), jnp.float32)


def dequantize(values_gkp, scales_gbn):
    """float32 [G, K, N] weights of packed codes [G, K, N / 2] uint8 and e8m0 scales [G, K / 32, N]:
    the format's definition, in plain jnp (the references')."""
    codes = jnp.stack([values_gkp & 0xF, values_gkp >> 4], axis=-1).reshape(values_gkp.shape[:-1] + (-1,))
    return decode_e2m1(codes.astype(jnp.int32)) * jnp.repeat(scales_gbn.astype(jnp.float32), MX_BLOCK, axis=-2)


def _bf16_of_e8m0(bits):
    """int32 e8m0 bits [P] -> bf16 2^(bits - 127): the bits are bf16's exponent field, except
    2^-127, a bf16 subnormal (mantissa 0x40).  (255, e8m0's NaN, never comes out of quantize.)"""
    b16 = jnp.where(bits == 0, 0x40, jax.lax.shift_left(bits, 7)).astype(jnp.int16)
    return jax.lax.bitcast_convert_type(b16, jnp.bfloat16)


# One instance: $2 holds four packed bytes b0..b3 (elements 0..3), $3 / $4 the bf16 scales of
# elements 0, 1 / 2, 3 (two to a register); $0 / $1 their values.  prmt puts b0, b1 (then b2, b3)
# in the high bytes of the two 16-bit lanes: a high nibble (odd column) sits at lane bits 12-15
# (sign at 15 in place; e2m1 bits at 12-14, shifted down to 6-8), a low nibble (even column) at
# 8-11 (sign shifted up by 4, e2m1 bits down by 2).  lop3 0xEA is (a & b) | c.  (One program
# per half: Pallas lowers an inline-asm op of one result only.)
_ODD_BITS = "shr.b32 y, a, 6;\nand.b32 y, y, 0x01C001C0;\nlop3.b32 d, a, nz, y, 0xEA;\n"
_EVEN_BITS = "shl.b32 t, a, 4;\nshr.b32 y, a, 2;\nand.b32 y, y, 0x01C001C0;\nlop3.b32 d, t, nz, y, 0xEA;\n"


def _decode_ptx(bits: str) -> str:
    lanes = "".join(
        f"prmt.b32 a, $2, z, {sel};\n" + bits + f"fma.rn.bf16x2 d, d, k, nz;\nfma.rn.bf16x2 {out}, d, {s}, nz;\n"
        for sel, out, s in (("0x1404", "$0", "$3"), ("0x3424", "$1", "$4"))
    )
    return (
        "{\n.reg .b32 z, k, nz, a, t, y, d;\nmov.b32 z, 0;\nmov.b32 k, 0x7E807E80;\nmov.b32 nz, 0x80008000;\n"
        + lanes
        + "}"
    )


_DECODE_PTX = (_decode_ptx(_EVEN_BITS), _decode_ptx(_ODD_BITS))


def decode_tile(packed_rp, s_even_p, s_odd_p, dtype, *, ptx: bool):
    """Inside a kernel: packed bytes [R, P] uint8 and the e8m0 scale bits (int32 [P]) of the even
    and odd columns -> (even [R, P], odd [R, P]) values times their scales in dtype (exact).
    ptx: the inline-PTX decode (GPU, bf16 only); else the float formulation."""
    r, p = packed_rp.shape
    if ptx and dtype == jnp.bfloat16:
        out = jax.ShapeDtypeStruct((r, p), jnp.bfloat16)
        return tuple(
            pltriton.elementwise_inline_asm(
                asm,
                args=[packed_rp, jnp.broadcast_to(_bf16_of_e8m0(s)[None, :], (r, p))],
                constraints="=r,=r,r,r,r",
                pack=4,
                result_shape_dtypes=[out],
            )[0]
            for asm, s in zip(_DECODE_PTX, (s_even_p, s_odd_p))
        )
    code = packed_rp.astype(jnp.int32)
    return tuple(
        (decode_e2m1((code >> (4 * half)) & 0xF) * pow2_of_e8m0(s)[None, :]).astype(dtype)
        for half, s in ((0, s_even_p), (1, s_odd_p))
    )
