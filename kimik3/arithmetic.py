"""Whether this process computes in exact fp32: where a cache hit and its recompute agree to the bit.

Below it (bf16 weights, or a GPU's TF32 matmuls at the default precision) a recomputed page and
a hit round differently, so near-tied greedy tokens can flip between runs that reuse state and
runs that do not; the benchmarks that compare such runs are strict only here.
"""

from __future__ import annotations

import jax
import numpy as np


def matmul_precision() -> str:
    """JAX's default matmul precision setting ("default" when unset)."""
    return str(jax.config.jax_default_matmul_precision or "default")


def exact_arithmetic(params) -> bool:
    """fp32 weights with fp32 matmuls: the CPU, or a GPU at "highest" precision (else TF32)."""
    if np.dtype(params["embed_vd"].dtype) != np.float32:
        return False
    return jax.default_backend() == "cpu" or matmul_precision() in ("highest", "float32", "fp32")
