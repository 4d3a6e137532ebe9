"""Quantized formats (`kimik3.quant.formats`): each format's round trip within its bound on
fresh random weights (normal, heavy-tailed, with zeros and tiny blocks), MXFP4's packing against
an independent e2m1 cast, bits per value as the manifests count them, the reference matmul, the
fusion rule (members quantized apart == the group quantized whole), and corrupt entries refused."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import quantization
from kimik3.quant import formats as qf


def _weights(rng, shape, kind):
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "heavy":  # log-normal magnitudes: blocks spanning many binades
        return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 2)).astype(np.float32)
    w = rng.standard_normal(shape).astype(np.float32)  # "zeros": whole blocks zero and tiny ones
    w[..., :32, :] = 0.0
    w[..., 32:64, :] *= 1e-30
    return w


@pytest.mark.parametrize("fmt", qf.FORMATS)
@pytest.mark.parametrize("kind", ["normal", "heavy", "zeros"])
def test_round_trip_within_the_formats_bound(rng, fmt, kind):
    shape = (2, 256, 192) if fmt != "fp8" else (2, 320, 200)  # fp8: ragged last blocks in K and N
    w = _weights(rng, shape, kind)
    q = qf.check(qf.quantize(w, fmt))
    back = np.asarray(qf.dequantize(q))
    err = np.abs(back - w)
    bound = np.asarray(qf.error_bound(w, fmt))
    assert back.shape == w.shape and np.all(np.isfinite(back))
    assert np.all(err <= bound), (fmt, kind, float((err - bound).max()))
    assert np.all(back[w == 0] == 0)
    # the bound is tight enough to mean something: relative RMS error of the element type
    rel = np.sqrt(np.mean(err**2) / np.mean(w**2))
    assert rel < {"fp8": 0.04, "mxfp8": 0.06, "mxfp4": 0.25}[fmt], rel


def test_mxfp4_codes_match_an_independent_e2m1_cast(rng):
    """Our packed codes decode to ml_dtypes' float4_e2m1fn rounding of the same scaled values
    (round to nearest even), and pack / unpack round-trips every code."""
    w = rng.standard_normal((64, 96)).astype(np.float32) * 3
    q = qf.quantize(w, "mxfp4")
    scale = np.repeat(np.asarray(q.scales, np.float32), 32, axis=0)
    want = np.clip(w / scale, -6, 6).astype(jnp.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(qf.unpack_e2m1(q.values)), want)
    codes = np.arange(256, dtype=np.uint8).reshape(1, 256)
    values = np.asarray(qf.unpack_e2m1(jnp.asarray(codes)))
    repacked = qf._pack_pairs(qf._e2m1_codes(jnp.asarray(values)))
    # -0 (code 8) packs as +0 (code 0): the same value
    np.testing.assert_array_equal(np.asarray(qf.unpack_e2m1(repacked)), values)


@pytest.mark.parametrize("fmt, manifest_name", [("fp8", "fp8"), ("mxfp4", "mxfp4")])
def test_bits_per_value_are_what_the_manifests_count(rng, fmt, manifest_name):
    q = qf.quantize(rng.standard_normal((256, 256)).astype(np.float32), fmt)
    assert q.bits_per_value == pytest.approx(quantization.BITS_PER_VALUE[manifest_name])
    assert qf.quantize(rng.standard_normal((256, 256)), "mxfp8").bits_per_value == pytest.approx(8.25)


@pytest.mark.parametrize("fmt", qf.FORMATS)
def test_the_reference_matmul_is_x_times_the_dequantized_weight(rng, fmt):
    w = rng.standard_normal((256, 128)).astype(np.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    q = qf.quantize(w, fmt)
    got = np.asarray(qf.matmul_ref(x, q))
    want = x.astype(np.float64) @ np.asarray(qf.dequantize(q), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # and near the unquantized product, by the format's precision
    rel = np.linalg.norm(got - x @ w) / np.linalg.norm(x @ w)
    assert rel < {"fp8": 0.04, "mxfp8": 0.06, "mxfp4": 0.25}[fmt]


@pytest.mark.parametrize("fmt", qf.FORMATS)
def test_members_quantized_apart_are_the_group_quantized_whole(rng, fmt):
    """A fused projection group [W1 | W2 | W3] along N: with member widths on the block grid the
    quantized group is the members' quantized values and scales concatenated, bit for bit."""
    widths = (256, 128, 384)
    ws = [rng.standard_normal((256, n)).astype(np.float32) * (i + 1) for i, n in enumerate(widths)]
    whole = qf.quantize(np.concatenate(ws, axis=1), fmt)
    parts = [qf.quantize(w, fmt) for w in ws]
    for field in ("values", "scales"):
        np.testing.assert_array_equal(
            np.asarray(getattr(whole, field)).view(np.uint8),
            np.concatenate([np.asarray(getattr(p, field)) for p in parts], axis=-1).view(np.uint8),
        )


def test_bad_inputs_and_corrupt_entries_are_refused(rng):
    w = rng.standard_normal((64, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="unknown format"):
        qf.quantize(w, "int4")
    with pytest.raises(ValueError, match="multiple"):
        qf.quantize(w[:48], "mxfp8")
    with pytest.raises(ValueError, match="odd"):
        qf.quantize(w[:, :63], "mxfp4")
    for fmt in qf.FORMATS:
        q = qf.quantize(w, fmt)
        bad_scales = np.asarray(q.scales, np.float32).copy()
        bad_scales.flat[0] = np.nan  # an fp32 NaN, or e8m0's NaN code
        corrupt = dataclasses.replace(q, scales=jnp.asarray(bad_scales).astype(q.scales.dtype))
        with pytest.raises(ValueError, match="corrupt scale"):
            qf.check(corrupt)
        with pytest.raises(ValueError, match="scales for a"):
            qf.check(dataclasses.replace(q, scales=q.scales[:0]))
        with pytest.raises(ValueError, match="values for a"):
            qf.check(dataclasses.replace(q, shape=(64, 128)))
    fp8 = qf.quantize(w, "fp8")
    with pytest.raises(ValueError, match="non-finite or non-positive"):
        qf.check(dataclasses.replace(fp8, scales=-fp8.scales))
