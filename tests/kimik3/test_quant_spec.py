"""The quantized formats (`kimik3.quant.formats`) held against their definitions, not against the
quantizer's own arithmetic.

Contract, with every constant written out here rather than read from the code under test:

* e4m3fn (FP8): 1 sign, 4 exponent (bias 7), 3 mantissa bits; largest finite 448 (0x7e), smallest
  normal 2^-6 (0x08), smallest subnormal 2^-9 (0x01), no infinity, NaN only at 0x7f / 0xff;
  float32 -> e4m3fn rounds to nearest, ties to the even mantissa.
* e8m0 (MX scales): 2^(bits - 127) for bits 0..254, 255 is NaN.
* e2m1 (FP4): codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives; two codes a
  byte along N, element 2j in the low nibble; rounding to nearest, ties to the even mantissa.
* OCP MX v1.0 scale rule: each 32-long block along K of a column shares X = floor(log2 amax) - emax,
  emax = 8 for e4m3 (448 = 1.75 * 2^8) and 2 for e2m1 (6 = 1.5 * 2^2), stored as e8m0 bits X + 127;
  scaled values past the element type's largest magnitude saturate to it.  An all-zero block (no
  spec rule) takes the documented 2^-126 and dequantizes to zeros; X is clipped to >= -126.
* fp8 (DeepSeek-V3 weight layout): fp32 scale = amax / 448 per 128 x 128 block (1 for a zero block),
  values W / scale clipped to +-448 and rounded to e4m3fn.
* Round trip: each element's error is at most half the gap between the two element-type values
  around |w| / scale (plus the saturated excess), times the scale; values already on the grid come
  back bit-exactly; the code's own `error_bound` covers the error and is within 2x of this bound.
"""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kimik3.quant import formats as qf

E4M3_EMAX, E2M1_EMAX = 8, 2  # OCP MX v1.0, table 1: the element types' largest exponents
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


# ---- independent decoders and a reference MX quantizer -------------------------------------------------


def _e4m3_decode(bits: int) -> float:
    sign = -1.0 if bits & 0x80 else 1.0
    e, m = (bits >> 3) & 0xF, bits & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m / 8 * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def _e2m1_decode(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    e, m = (code >> 1) & 0x3, code & 0x1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


E4M3_POS = np.array([_e4m3_decode(b) for b in range(0x7F)])  # the finite non-negatives, codes 0..0x7e ascending
E2M1_POS = np.array([_e2m1_decode(c) for c in range(8)])


def _floor_log2(a: float) -> int:
    x = math.floor(math.log2(a))
    while 2.0**x > a:
        x -= 1
    while 2.0 ** (x + 1) <= a:
        x += 1
    return x


def _round_to_grid(a, grid):
    """Non-negative magnitudes a -> (codes, values): nearest grid point, ties to the even code (the
    grids are ascending by code, and a code's lowest bit is its mantissa's lowest bit)."""
    a = np.minimum(np.asarray(a, np.float64), grid[-1])  # saturation
    d = np.abs(a[..., None] - grid)
    tied = d == d.min(axis=-1, keepdims=True)
    codes = np.arange(len(grid))
    code = np.argmin(np.where(tied, (codes % 2) * 1000 + codes, 10**6), axis=-1)
    return code, grid[code]


def _mx_reference(w, fmt: str, emax: int | None = None):
    """W [K, N] -> (e8m0 scale bits [K/32, N], dequantized [K, N]) by the OCP MX rule."""
    emax = {"mxfp8": E4M3_EMAX, "mxfp4": E2M1_EMAX}[fmt] if emax is None else emax
    grid = E4M3_POS if fmt == "mxfp8" else E2M1_POS
    w = np.asarray(w, np.float64)
    k, n = w.shape
    bits = np.zeros((k // 32, n), np.uint8)
    out = np.zeros_like(w)
    for b in range(k // 32):
        for j in range(n):
            blk = w[32 * b : 32 * b + 32, j]
            amax = np.abs(blk).max()
            x = max(_floor_log2(amax) - emax, -126) if amax > 0 else -126
            bits[b, j] = x + 127
            _, mag = _round_to_grid(np.abs(blk) / 2.0**x, grid)
            out[32 * b : 32 * b + 32, j] = np.sign(blk) * mag * 2.0**x
    return bits, out


def _half_gap_bound(a, grid):
    """The largest rounding error at magnitude a (in grid units): half the gap of the grid interval
    holding a, or the excess past the largest value."""
    a = np.asarray(a, np.float64)
    i = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 2)
    inside = (grid[i + 1] - grid[i]) / 2
    return np.where(a <= grid[-1], inside, a - grid[-1])


def _scale_bits(q):
    return np.asarray(q.scales).view(np.uint8)


def _assert_amax_over_448(scales, amax):
    """fp32 scales == amax / 448 up to one ulp (XLA:CPU divides by a constant as a multiply by its
    rounded reciprocal, which can land one ulp from the correctly rounded quotient)."""
    want = np.asarray(amax, np.float32) / np.float32(448)
    got = np.asarray(scales)
    assert got.dtype == np.float32
    np.testing.assert_array_less(np.abs(got.view(np.int32) - want.view(np.int32)), 2)


def _e4m3_bits(v):
    return np.asarray(v).view(np.uint8)


def _codes(q):
    """mxfp4 codes [K, N] from the packed bytes, low nibble first."""
    p = np.asarray(q.values)
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[0], -1)


# ---- the element and scale types -----------------------------------------------------------------------


def test_e4m3fn_landmarks_and_every_code_decode_as_the_definition_says():
    assert _e4m3_decode(0x7E) == 448.0 and _e4m3_decode(0xFE) == -448.0
    assert _e4m3_decode(0x08) == 2.0**-6 and _e4m3_decode(0x01) == 2.0**-9 and _e4m3_decode(0x07) == 7 * 2.0**-9
    assert _e4m3_decode(0x38) == 1.0 and _e4m3_decode(0x78) == 256.0
    ours = np.array([_e4m3_decode(b) for b in range(256)])
    theirs = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(np.isnan(theirs), np.isin(np.arange(256), [0x7F, 0xFF]))
    np.testing.assert_array_equal(ours, theirs)  # NaNs compare equal in assert_array_equal
    assert not np.isinf(theirs).any()
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == 448


@pytest.mark.parametrize("cast", ["ml_dtypes", "jax"])
def test_e4m3fn_casts_round_to_nearest_even_and_overflow_to_nan(cast):
    # value -> expected bits: exact values, ties (to the even mantissa), subnormal ties, overflow
    table = {
        448.0: 0x7E,
        -448.0: 0xFE,
        460.0: 0x7E,  # below the 448 / 480 midpoint
        464.0: 0x7E,  # the midpoint to 480 (the NaN code): ties to 448
        480.0: 0x7F,  # past it: NaN, e4m3fn has no infinity
        1e6: 0x7F,
        1.0: 0x38,
        1.0625: 0x38,  # tie between 1 and 1.125: the even mantissa, 1
        1.1875: 0x3A,  # tie between 1.125 and 1.25: 1.25
        2.0**-6: 0x08,
        2.0**-9: 0x01,
        2.0**-10: 0x00,  # tie between 0 and 2^-9: 0
        3 * 2.0**-10: 0x02,  # tie between 2^-9 and 2^-8: 2^-8
        -0.0: 0x80,
    }
    v = np.array(list(table), np.float32)
    got = v.astype(ml_dtypes.float8_e4m3fn) if cast == "ml_dtypes" else jnp.asarray(v).astype(jnp.float8_e4m3fn)
    assert [hex(b) for b in _e4m3_bits(got)] == [hex(b) for b in table.values()]


def test_e8m0_is_two_to_the_bits_minus_127_and_255_is_nan():
    v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    np.testing.assert_array_equal(v[:255], [2.0 ** (b - 127) for b in range(255)])
    assert np.isnan(v[255])


def test_e2m1_codes_decode_to_the_spec_table_and_unpack_low_nibble_first():
    assert [_e2m1_decode(c) for c in range(16)] == E2M1_VALUES
    assert list(qf.E2M1_GRID) == E2M1_VALUES[:8]
    got = np.asarray(qf.unpack_e2m1(jnp.arange(256, dtype=jnp.uint8)[None]))[0]
    want = [E2M1_VALUES[b & 0xF] if i == 0 else E2M1_VALUES[b >> 4] for b in range(256) for i in (0, 1)]
    np.testing.assert_array_equal(got, want)
    # spot checks, by hand: 0x21 = [code 1, code 2] = [0.5, 1]; 0xF8 = [-0, -6]; 0x7E = [-4, 6]
    np.testing.assert_array_equal(
        np.asarray(qf.unpack_e2m1(jnp.array([[0x21, 0xF8, 0x7E]], jnp.uint8))), [[0.5, 1.0, -0.0, -6.0, -4.0, 6.0]]
    )


# ---- MX scales and element codes on hand-picked blocks -------------------------------------------------


def _blocks(*cols, k=32):
    """Columns given as {row: value} -> W [k, len(cols)]."""
    w = np.zeros((k, len(cols)), np.float32)
    for j, col in enumerate(cols):
        for r, v in col.items():
            w[r, j] = v
    return w


# (column {row: value}, expected e8m0 bits = X + 127, expected e4m3 bits at those rows)
MXFP8_CASES = [
    ({0: 448.0, 1: -448.0}, 127, [0x7E, 0xFE]),  # amax 448 = 1.75 * 2^8: X = 0
    ({0: 1.0, 1: 0.5}, 119, [0x78, 0x70]),  # amax 1: X = -8, 1 -> 256
    ({0: 0.75}, 118, [0x7C]),  # floor(log2 0.75) = -1: X = -9, 0.75 -> 384 = 1.5 * 2^8
    ({0: 500.0, 1: 256.0}, 127, [0x7E, 0x78]),  # amax in [448, 512): X = 0, 500 saturates to 448
    ({0: 512.0}, 128, [0x78]),  # amax 512: X = 1, 512 -> 256
    ({0: 448.0, 1: 1.0625, 2: 1.1875, 3: 2.0**-10, 4: 3 * 2.0**-10}, 127, [0x7E, 0x38, 0x3A, 0x00, 0x02]),  # ties
    ({0: 2.0**-120}, 1, [0x68]),  # X = -128 clipped to -126: 2^-120 -> 64
    ({}, 1, [0x00]),  # an all-zero block: 2^-126, zero codes
]
MXFP4_CASES = [
    ({0: 6.0, 1: -6.0}, 127, [0x7, 0xF]),  # amax 6 = 1.5 * 2^2: X = 0
    ({0: 1.0, 1: 0.25}, 125, [0x6, 0x2]),  # amax 1: X = -2, 1 -> 4, 0.25 -> 1
    ({0: 7.0, 1: 4.0}, 127, [0x7, 0x6]),  # amax in [4, 8): X = 0, 7 saturates to 6
    ({0: 8.0, 1: 3.0}, 128, [0x6, 0x3]),  # amax 8: X = 1, 8 -> 4, 3 -> 1.5
    # ties to the even mantissa at X = 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    (
        {0: 6.0, 1: 0.25, 2: 0.75, 3: 1.25, 4: 1.75, 5: 2.5, 6: 3.5, 7: 5.0, 8: -2.5, 9: -5.0},
        127,
        [0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xC, 0xE],
    ),
    ({}, 1, [0x0]),
]


@pytest.mark.parametrize(
    "col,bits,codes", MXFP8_CASES, ids=[str(c[1]) + "-" + str(i) for i, c in enumerate(MXFP8_CASES)]
)
def test_mxfp8_block_scale_is_floor_log2_amax_minus_8_and_values_round_to_e4m3(col, bits, codes):
    w = _blocks(col, {0: 1.0})  # a second column: blocks are per column
    q = qf.check(qf.quantize(w, "mxfp8"))
    assert q.scales.dtype == jnp.float8_e8m0fnu
    assert _scale_bits(q).tolist() == [[bits, 119]]
    rows = sorted(col) or [0]
    assert [hex(b) for b in _e4m3_bits(q.values)[rows, 0]] == [hex(c) for c in codes]
    back = np.asarray(qf.dequantize(q))[:, 0]
    np.testing.assert_array_equal(back[rows], [_e4m3_decode(c) * 2.0 ** (bits - 127) for c in codes])
    assert np.all(back[[r for r in range(32) if r not in col]] == 0)


@pytest.mark.parametrize(
    "col,bits,codes", MXFP4_CASES, ids=[str(c[1]) + "-" + str(i) for i, c in enumerate(MXFP4_CASES)]
)
def test_mxfp4_block_scale_is_floor_log2_amax_minus_2_and_values_round_to_e2m1(col, bits, codes):
    w = _blocks(col, {0: 1.0})
    q = qf.check(qf.quantize(w, "mxfp4"))
    assert q.scales.dtype == jnp.float8_e8m0fnu and q.values.shape == (32, 1)
    assert _scale_bits(q).tolist() == [[bits, 125]]
    rows = sorted(col) or [0]
    assert [hex(c) for c in _codes(q)[rows, 0]] == [hex(c) for c in codes]
    assert int(np.asarray(q.values)[0, 0]) >> 4 == 0x6  # column 1's row 0 (1.0 at X = -2 -> 4) in the high nibble
    back = np.asarray(qf.dequantize(q))[:, 0]
    np.testing.assert_array_equal(back[rows], [E2M1_VALUES[c] * 2.0 ** (bits - 127) for c in codes])


def test_an_emax_off_by_one_changes_the_pinned_scales():
    w = _blocks({0: 448.0}, {0: 6.0})
    assert _mx_reference(w, "mxfp8")[0].tolist() == [[127, 121]]
    assert _mx_reference(w, "mxfp8", emax=7)[0].tolist() == [[128, 122]]
    assert _mx_reference(w, "mxfp4")[0].tolist() == [[133, 127]]
    assert _mx_reference(w, "mxfp4", emax=1)[0].tolist() == [[134, 128]]


def test_the_spec_check_catches_a_quantizer_with_emax_7(monkeypatch, rng):
    w = rng.standard_normal((64, 8)).astype(np.float32)
    bits, _ = _mx_reference(w, "mxfp8")
    assert np.array_equal(_scale_bits(qf.quantize(w, "mxfp8")), bits)
    monkeypatch.setitem(qf._EMAX, "mxfp8", 7)
    assert not np.array_equal(_scale_bits(qf.quantize(w, "mxfp8")), bits)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_mx_quantization_matches_the_spec_reference_on_random_blocks(rng, fmt):
    w = rng.standard_normal((128, 24)) * np.exp(2 * rng.standard_normal((1, 24)))
    w[:, :3] *= 1e4  # a few columns with large amax, a few with tiny
    w[:, 3:6] *= 1e-6
    w = w.astype(np.float32)
    bits, ref = _mx_reference(w, fmt)
    q = qf.quantize(w, fmt)
    np.testing.assert_array_equal(_scale_bits(q), bits)
    np.testing.assert_array_equal(np.asarray(qf.dequantize(q), np.float64), ref)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_values_on_the_grid_come_back_bit_exactly(rng, fmt):
    grid = E4M3_POS if fmt == "mxfp8" else E2M1_POS
    emax = E4M3_EMAX if fmt == "mxfp8" else E2M1_EMAX
    top = np.flatnonzero((grid >= 2.0**emax))  # codes in the top binade: they fix X
    x = rng.integers(-40, 40, size=(2, 6))
    mag = grid[rng.integers(0, len(grid), size=(64, 6))]
    mag[[0, 32]] = grid[rng.choice(top, size=(2, 6))]
    w = (np.where(rng.random((64, 6)) < 0.5, -1, 1) * mag * 2.0 ** np.repeat(x, 32, axis=0)).astype(np.float32)
    q = qf.quantize(w, fmt)
    np.testing.assert_array_equal(_scale_bits(q), x + 127)
    back = np.asarray(qf.dequantize(q))
    np.testing.assert_array_equal(back, w)


# ---- fp8 block scales -----------------------------------------------------------------------------------


def test_fp8_block_scale_is_amax_over_448_per_128_by_128_block():
    w = np.zeros((256, 384), np.float32)
    w[0, 0], w[5, 7] = 896.0, 1.5  # block (0, 0): amax 896 -> scale 2
    w[1, 128], w[2, 129] = 448.0, 2.0**-9  # block (0, 1): scale 1
    w[130, 0] = 1.0  # block (1, 0): scale float32(1 / 448)
    w[3, 256], w[4, 256] = 0.3, -0.1  # block (0, 2): scale 0.3 / 448
    # block (1, 1) and (1, 2): all zero -> 1
    q = qf.check(qf.quantize(w, "fp8"))
    s = np.asarray(q.scales)
    assert q.scales.dtype == jnp.float32 and s.shape == (2, 3)
    _assert_amax_over_448(s, [[896.0, 448.0, 0.3], [1.0, 448.0, 448.0]])
    assert s[0, 0] == 2.0 and s[0, 1] == s[1, 1] == s[1, 2] == 1.0  # exact where amax / 448 is; zero blocks 1
    v = _e4m3_bits(q.values)
    assert v[0, 0] == 0x7E and v[5, 7] == 0x34  # 896 / 2 = 448; 1.5 / 2 = 0.75
    assert v[1, 128] == 0x7E and v[2, 129] == 0x01  # exact at scale 1, the smallest subnormal included
    assert v[130, 0] == 0x7E and v[3, 256] == 0x7E  # amax / (amax / 448) is 448 up to a rounding: clipped
    np.testing.assert_array_equal(np.asarray(qf.dequantize(q))[128:, 128:], 0)


def test_fp8_ragged_blocks_take_their_own_amax():
    w = np.zeros((130, 130), np.float32)
    w[129, 129] = 4.0  # the 2 x 2 corner block
    w[0, 0] = 448.0
    q = qf.quantize(w, "fp8")
    _assert_amax_over_448(q.scales, [[448.0, 448.0], [448.0, 4.0]])  # zero blocks: 1
    assert _e4m3_bits(q.values)[129, 129] == 0x7E


def test_activation_rows_take_the_same_scale_rules():
    x = np.zeros((2, 128), np.float32)
    x[0, 0], x[0, 32], x[0, 64], x[1, 0] = 448.0, 1.0, 500.0, 3.0
    v, s = qf.quantize_rows(x, "mxfp8")
    np.testing.assert_array_equal(
        np.asarray(s), [[1.0, 2.0**-8, 1.0, 2.0**-126], [2.0**-7, 2.0**-126, 2.0**-126, 2.0**-126]]
    )
    assert _e4m3_bits(v)[0, [0, 32, 64]].tolist() == [0x7E, 0x78, 0x7E] and _e4m3_bits(v)[1, 0] == 0x7C
    v, s = qf.quantize_rows(x, "fp8")
    _assert_amax_over_448(s, [[500.0], [3.0]])


# ---- error bounds ---------------------------------------------------------------------------------------


def _independent_bound(w, fmt):
    w = np.asarray(w, np.float64)
    if fmt == "fp8":
        q = qf.quantize(w.astype(np.float32), "fp8")
        scale = np.repeat(np.repeat(np.asarray(q.scales, np.float64), 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
        grid = E4M3_POS
    else:
        bits, _ = _mx_reference(w, fmt)
        scale = np.repeat(2.0 ** (bits.astype(np.float64) - 127), 32, axis=0)
        grid = E4M3_POS if fmt == "mxfp8" else E2M1_POS
    return _half_gap_bound(np.abs(w) / scale, grid) * scale


@pytest.mark.parametrize("fmt", qf.FORMATS)
def test_round_trip_error_is_within_an_independent_half_gap_bound(rng, fmt):
    w = rng.standard_normal((256, 160)) * np.exp(1.5 * rng.standard_normal((256, 160)))
    w = w.astype(np.float32)
    w[rng.random(w.shape) < 0.05] = 0.0
    err = np.abs(np.asarray(qf.dequantize(qf.quantize(w, fmt)), np.float64) - w)
    mine = _independent_bound(w, fmt)
    assert np.all(err <= mine * (1 + 1e-6)), float((err - mine).max())
    code = np.asarray(qf.error_bound(w, fmt), np.float64)
    assert np.all(err <= code)
    nz = w != 0
    assert np.all(code[nz] <= 2 * mine[nz]), float((code[nz] / mine[nz]).max())


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_the_codes_bound_at_a_zero_element_is_the_subnormal_half_gap(fmt):
    w = _blocks({0: 448.0})
    code = np.asarray(qf.error_bound(w, fmt))[1, 0]
    assert code <= 2 * 2.0**-10
