"""Dot precisions the Pallas kernels share.

fp32 operands on the GPU: 3xTF32 on tensor cores (~fp32 accuracy; what the
kernels use where fp32 inputs promise fp32 results), single TF32, or IEEE fp32
on CUDA cores.  Interpret mode (CPU) computes exact fp32 whatever is asked.
"""

from __future__ import annotations

import jax

HIGHEST = jax.lax.Precision.HIGHEST

GPU_DOT_ALGORITHMS = {
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,  # ~fp32 accuracy on tensor cores
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "ieee": HIGHEST,  # exact fp32 on CUDA cores
}


def fp32_precision(interpret: bool, algorithm: str = "tf32x3"):
    """The `precision=` for a kernel dot of fp32 operands."""
    return HIGHEST if interpret else GPU_DOT_ALGORITHMS[algorithm]
