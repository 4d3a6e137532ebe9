"""Quantized weight formats with real arithmetic: quantize, dequantize, the reference matmul.

A weight W [..., K, N] (K contracted: y = x @ W) becomes a `QTensor` of values and scales:

* ``fp8``: e4m3 values, one fp32 scale per 128 x 128 block of (K, N) (DeepSeek-V3's weight
  layout): scale = amax(block) / 448, values = W / scale rounded to e4m3.  A ragged last block
  (K or N not a multiple of 128) has its own amax.
* ``mxfp8``: OCP microscaling: e4m3 values, one e8m0 (power-of-two) scale per 32 consecutive
  K of each column.  scale = 2^(floor(log2 amax) - 8) (8: e4m3's largest exponent); values
  past e4m3's largest normal (448) saturate, as the OCP spec defines.
* ``mxfp4``: OCP microscaling with e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and signs), scale
  2^(floor(log2 amax) - 2), saturating at 6; two values packed per byte along N (low nibble
  first), so an [K, N] weight is [K, N / 2] uint8 plus [K / 32, N] e8m0: 4.25 bits a value.

Scales run along K per column (MX) or per 128-column block (fp8), so quantizing the members of a
projection group apart and concatenating along N (`concat`) gives the bits of the group quantized
whole whenever the members' widths are multiples of the blocks.  Where they are not (fp8: KDA's
beta is H columns wide, MLA's kv latent 576), the fused fp8 tensor keeps each member's own block
grid: ``segments`` lists the members' widths and the 128-column blocks restart at each, so a
fused tensor holds exactly its members' bits and scales (what makes the fused GEMMs bit-exact).

Activations (`quantize_rows`, the W8A8 GEMMs of `pallas_kernels.qgemm`): one scale per row per
K block: fp8 per 1 x 128 (DeepSeek-V3's activation tiles, fp32), MXFP8 per 1 x 32 (e8m0).

`dequantize(q)` is exact arithmetic (values x scales in fp32); `matmul_ref(x, q)` is
``x @ dequantize(q)`` with fp32 accumulation, the reference every kernel is held against.
`check(q)` refuses a tensor whose scales are missing, mis-shaped, of the wrong dtype, or not
finite and positive (a corrupt checkpoint entry), before any launch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("fp8", "mxfp8", "mxfp4")
FP8_BLOCK = 128
MX_BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
_EMAX = {"mxfp8": 8, "mxfp4": 2}  # the element type's largest exponent (OCP MX: X = floor(log2 amax) - emax)
# e2m1's magnitudes by 3-bit code (sign in bit 3)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantized [..., K, N] weight.  values: float8_e4m3fn [..., K, N] (fp8, mxfp8) or uint8
    [..., K, N / 2] (mxfp4, packed); scales: float32 [..., ceil(K/128), ceil(N/128)] (fp8) or
    float8_e8m0fnu [..., K / 32, N] (mx)."""

    values: jax.Array
    scales: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple = dataclasses.field(metadata=dict(static=True))
    # fp8 only: the widths along N of the members of a fused group, each with its own 128-column
    # blocks (scales [..., kb, sum ceil(w / 128)]); () = one member
    segments: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @property
    def bits_per_value(self) -> float:
        n = math.prod(self.shape)
        return 8.0 * (self.values.size * self.values.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize) / n


def tree_formats(tree) -> tuple[str, ...]:
    """The quantized formats a param tree holds, sorted (() for an unquantized tree): what a prefix
    cache's namespace carries, so that KV computed under one manifest is never read under another."""
    from pallas_kernels.moe_mxfp4_hopper import HopperMXFP4  # MXFP4 experts in the Hopper kernel's layout

    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, (QTensor, HopperMXFP4)))
    return tuple(
        sorted(
            {
                "mxfp4" if isinstance(leaf, HopperMXFP4) else leaf.fmt
                for leaf in leaves
                if isinstance(leaf, (QTensor, HopperMXFP4))
            }
        )
    )


def _require(ok: bool, msg: str):
    if not ok:
        raise ValueError(msg)


def _check_weight(w, fmt: str):
    _require(fmt in FORMATS, f"unknown format {fmt!r}; known: {FORMATS}")
    _require(w.ndim >= 2, f"a weight to quantize is [..., K, N]; got shape {tuple(w.shape)}")
    k, n = w.shape[-2:]
    if fmt in _EMAX:
        _require(k % MX_BLOCK == 0, f"{fmt} scales blocks of {MX_BLOCK} along K; K={k} is not a multiple")
    if fmt == "mxfp4":
        _require(n % 2 == 0, f"mxfp4 packs two values per byte along N; N={n} is odd")


def _pad_to(x, axis: int, multiple: int):
    size = x.shape[axis]
    pad = -size % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _fp8_block_scales(w):
    """fp32 [..., kb, nb]: amax / 448 per 128 x 128 block (1 where a block is all zero)."""
    k, n = w.shape[-2:]
    p = _pad_to(_pad_to(jnp.abs(w), -2, FP8_BLOCK), -1, FP8_BLOCK)
    kb, nb = p.shape[-2] // FP8_BLOCK, p.shape[-1] // FP8_BLOCK
    amax = p.reshape(p.shape[:-2] + (kb, FP8_BLOCK, nb, FP8_BLOCK)).max(axis=(-3, -1))
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)


def _segments(n: int, segments: tuple) -> tuple:
    segments = tuple(segments) or (n,)
    _require(
        sum(segments) == n and all(w > 0 for w in segments),
        f"fp8 segments {segments} must be positive widths summing to N={n}",
    )
    return segments


def fp8_column_blocks(n: int, segments: tuple = ()):
    """int32 [N]: the index of each column's 128-column scale block (blocks restart at each member)."""
    out, first = [], 0
    for w in _segments(n, segments):
        out.append(first + np.arange(w) // FP8_BLOCK)
        first += -(-w // FP8_BLOCK)
    return np.concatenate(out).astype(np.int32)


def _expand_fp8_scales(scales, k: int, n: int, segments: tuple = ()):
    s = jnp.repeat(scales, FP8_BLOCK, axis=-2)[..., :k, :]
    return s[..., fp8_column_blocks(n, segments)]


def _mx_exponents(w, fmt: str):
    """int32 [..., K/32, N]: X = floor(log2 amax) - emax per 32 K of a column, clipped to
    [-126, 127]: e8m0 reaches 2^-127, but that is an fp32 subnormal, which XLA:CPU flushes to 0
    (an all-zero block takes 2^-126)."""
    k = w.shape[-2]
    blocks = jnp.abs(w).reshape(w.shape[:-2] + (k // MX_BLOCK, MX_BLOCK, w.shape[-1]))
    amax = blocks.max(axis=-2)
    _, exp = jnp.frexp(jnp.where(amax > 0, amax, 1.0))  # amax = m * 2^exp, m in [0.5, 1): floor(log2) = exp - 1
    x = jnp.where(amax > 0, exp - 1 - _EMAX[fmt], -126)
    return jnp.clip(x, -126, 127).astype(jnp.int32)


def _pow2(x_int):
    """float32 2^x for int32 exponents x (exact)."""
    return jnp.ldexp(jnp.ones(jnp.shape(x_int), jnp.float32), x_int)


def _per_element(mx_scales):
    """[..., K/32, N] MX scales -> float32 [..., K, N]: each K's scale."""
    return jnp.repeat(mx_scales.astype(jnp.float32), MX_BLOCK, axis=-2)


def _e8m0(x_int):
    """int32 exponents -> float8_e8m0fnu scales 2^x (exact: e8m0 holds 2^-127 .. 2^127)."""
    return _pow2(x_int).astype(jnp.float8_e8m0fnu)


def _e2m1_codes(v):
    """float32 values already scaled into [-6, 6] -> uint8 4-bit e2m1 codes (round to nearest,
    ties to even code, as the OCP spec rounds)."""
    mag = jnp.abs(v)
    # nearest grid point; ties go to the even code (the grid's even codes have a zero mantissa bit)
    d = jnp.abs(mag[..., None] - jnp.asarray(E2M1_GRID))
    best = jnp.min(d, axis=-1, keepdims=True)
    tie_ok = d <= best
    codes = jnp.arange(8, dtype=jnp.int32)
    even_first = jnp.where(tie_ok, (codes % 2) * 8 + codes, 99)  # prefer even codes among the nearest
    code = jnp.argmin(even_first, axis=-1).astype(jnp.uint8)
    return code | jnp.where(v < 0, jnp.uint8(8), jnp.uint8(0))


def _pack_pairs(codes):
    """uint8 codes [..., N] -> [..., N/2]: code 2j in the low nibble, 2j + 1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed):
    """uint8 [..., N/2] -> float32 e2m1 values [..., N] (the inverse of the packing)."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))
    mag = jnp.asarray(E2M1_GRID)[(codes & 7).astype(jnp.int32)]
    return jnp.where(codes & 8, -mag, mag)


def quantize(w, fmt: str, segments: tuple = ()) -> QTensor:
    """W [..., K, N] (any float dtype) -> QTensor in `fmt` (see the module comment).  segments
    (fp8): the widths of a fused group's members along N, each quantized on its own blocks."""
    _check_weight(w, fmt)
    w = jnp.asarray(w, jnp.float32)
    k, n = w.shape[-2:]
    if fmt == "fp8":
        segments = _segments(n, segments)
        bounds = np.cumsum((0,) + segments)
        scales = jnp.concatenate([_fp8_block_scales(w[..., a:b]) for a, b in zip(bounds[:-1], bounds[1:])], axis=-1)
        # amax / scale is 448 up to one rounding: clip so that it cannot overflow e4m3 into NaN
        values = jnp.clip(w / _expand_fp8_scales(scales, k, n, segments), -E4M3_MAX, E4M3_MAX)
        return QTensor(
            values.astype(jnp.float8_e4m3fn), scales, fmt, tuple(w.shape), segments if len(segments) > 1 else ()
        )
    _require(not segments or len(segments) == 1, f"{fmt} scales run along K per column: it takes no segments")
    x = _mx_exponents(w, fmt)
    scaled = w / _per_element(_pow2(x))
    if fmt == "mxfp8":
        values = jnp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    else:
        values = _pack_pairs(_e2m1_codes(jnp.clip(scaled, -E2M1_MAX, E2M1_MAX)))
    return QTensor(values, _e8m0(x), fmt, tuple(w.shape))


def _scale_shape(fmt: str, shape: tuple, segments: tuple = ()) -> tuple:
    k, n = shape[-2:]
    if fmt == "fp8":
        return tuple(shape[:-2]) + (-(-k // FP8_BLOCK), sum(-(-w // FP8_BLOCK) for w in _segments(n, segments)))
    return tuple(shape[:-2]) + (k // MX_BLOCK, n)


def concat(qs) -> QTensor:
    """Members [..., K, N_i] of one format -> the fused [..., K, sum N_i] (the members' bits and
    scales as they are: fp8 keeps each member's blocks as a segment)."""
    qs = list(qs)
    fmt, lead = qs[0].fmt, tuple(qs[0].shape[:-1])
    _require(
        all(q.fmt == fmt and tuple(q.shape[:-1]) == lead for q in qs),
        f"concat: members must share a format and [..., K]; got {[(q.fmt, q.shape) for q in qs]}",
    )
    values = jnp.concatenate([q.values for q in qs], axis=-1)
    scales = jnp.concatenate([q.scales for q in qs], axis=-1)
    shape = lead + (sum(q.shape[-1] for q in qs),)
    segments = sum((tuple(q.segments) or (q.shape[-1],) for q in qs), ()) if fmt == "fp8" else ()
    return QTensor(values, scales, fmt, shape, segments if len(segments) > 1 else ())


def quantize_rows(x, fmt: str):
    """Activations x [..., K] -> (e4m3 values [..., K], scales [..., K / block] float32): one scale
    per row per K block, 128 (fp8: amax / 448, DeepSeek-V3's 1 x 128 tiles; K a multiple of 128)
    or 32 (mxfp8: the e8m0 power of two of `quantize`, saturating).  Row r's values depend on row
    r alone: a fused GEMM's members see the same activations."""
    _require(fmt in ("fp8", "mxfp8"), f"activations quantize as fp8 or mxfp8; got {fmt!r}")
    block = FP8_BLOCK if fmt == "fp8" else MX_BLOCK
    k = x.shape[-1]
    _require(k % block == 0, f"{fmt} activation blocks are {block} wide; K={k} is not a multiple")
    x = jnp.asarray(x, jnp.float32)
    blocks = x.reshape(x.shape[:-1] + (k // block, block))
    amax = jnp.abs(blocks).max(axis=-1)
    if fmt == "fp8":
        scales = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    else:
        _, exp = jnp.frexp(jnp.where(amax > 0, amax, 1.0))
        scales = _pow2(jnp.clip(jnp.where(amax > 0, exp - 1 - _EMAX[fmt], -126), -126, 127))
    values = jnp.clip(blocks / scales[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return values.reshape(x.shape), scales


def check(q: QTensor) -> QTensor:
    """q if it is well formed; ValueError naming the problem otherwise (a corrupt or mismatched
    entry is refused at load, never dequantized into wrong weights).  Reads the scales' values."""
    _require(q.fmt in FORMATS, f"unknown format {q.fmt!r}; known: {FORMATS}")
    shape = tuple(q.shape)
    want_values = shape if q.fmt != "mxfp4" else shape[:-1] + (shape[-1] // 2,)
    want_vdtype = jnp.uint8 if q.fmt == "mxfp4" else jnp.float8_e4m3fn
    _require(
        tuple(q.values.shape) == want_values and q.values.dtype == want_vdtype,
        f"{q.fmt} values for a {shape} weight must be {jnp.dtype(want_vdtype).name} {want_values}; "
        f"got {q.values.dtype} {tuple(q.values.shape)}",
    )
    _require(q.fmt == "fp8" or not q.segments, f"{q.fmt} takes no segments; got {q.segments}")
    want_scales = _scale_shape(q.fmt, shape, q.segments)
    want_sdtype = jnp.float32 if q.fmt == "fp8" else jnp.float8_e8m0fnu
    _require(
        tuple(q.scales.shape) == want_scales and q.scales.dtype == want_sdtype,
        f"{q.fmt} scales for a {shape} weight must be {jnp.dtype(want_sdtype).name} {want_scales}; "
        f"got {q.scales.dtype} {tuple(q.scales.shape)}",
    )
    s = np.asarray(q.scales, np.float32)
    _require(
        bool(np.all(np.isfinite(s) & (s > 0))),
        f"{q.fmt} scales hold {int(np.sum(~(np.isfinite(s) & (s > 0))))} non-finite or non-positive entries "
        f"(a corrupt scale tensor)",
    )
    if q.fmt != "mxfp4":
        _require(bool(np.all(np.isfinite(np.asarray(q.values, np.float32)))), f"{q.fmt} values hold NaN")
    return q


def dequantize(q: QTensor):
    """float32 [..., K, N]: values x scales, exactly."""
    k, n = q.shape[-2:]
    if q.fmt == "fp8":
        return q.values.astype(jnp.float32) * _expand_fp8_scales(q.scales, k, n, q.segments)
    values = unpack_e2m1(q.values) if q.fmt == "mxfp4" else q.values.astype(jnp.float32)
    return values * _per_element(q.scales)


def matmul_ref(x, q: QTensor):
    """x [..., K] @ dequantize(q) [K, N] -> float32 [..., N], fp32 accumulation at the highest
    precision (what every quantized GEMM kernel is held against)."""
    return jnp.matmul(jnp.asarray(x, jnp.float32), dequantize(q), precision=jax.lax.Precision.HIGHEST)


def error_bound(w, fmt: str, segments: tuple = ()):
    """float32 [..., K, N]: the largest |W - dequantize(quantize(W))| each element may show (round
    to nearest of the element type inside the scaled range, plus saturation past it)."""
    w = jnp.asarray(w, jnp.float32)
    k, n = w.shape[-2:]
    if fmt == "fp8":
        scale = _expand_fp8_scales(quantize(w, "fp8", segments).scales, k, n, segments)
        a = jnp.abs(w) / scale
        step = _e4m3_step(a)
        return step / 2 * scale * (1 + 1e-6)
    scale = _per_element(_pow2(_mx_exponents(w, fmt)))
    a = jnp.abs(w) / scale
    if fmt == "mxfp8":
        inside = _e4m3_step(jnp.minimum(a, E4M3_MAX)) / 2
        return jnp.where(a <= E4M3_MAX, inside, a - E4M3_MAX) * scale * (1 + 1e-6)
    step = jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0))
    return jnp.where(a <= E2M1_MAX, step / 2, a - E2M1_MAX) * scale * (1 + 1e-6)


def _e4m3_step(a):
    """The spacing of e4m3 values around |v| = a: 2^(e - 3) for a in [2^e, 2^(e+1)), e >= -6;
    the subnormal spacing 2^-9 below 2^-6."""
    _, exp = jnp.frexp(jnp.where(a > 0, a, 1.0))
    e = jnp.where(a > 0, jnp.maximum(exp - 1, -6), -6)  # an exact zero sits on the subnormal grid
    return _pow2(e - 3)
