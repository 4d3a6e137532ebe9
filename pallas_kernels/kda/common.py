"""What the KDA kernels share: the chunk and sub-block sizes, where they run (the interpreter off
the GPU), and the dot products the prepare and state kernels take (`precise`: 3xTF32 or exact fp32;
`fast`: bf16 operands with fp32 accumulation, for bf16 inputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dots

CHUNK = 64
SUB = 16


def _default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def _precise_dot(interpret: bool, algorithm: str = "tf32x3"):
    """Dot for the prepare kernel: `algorithm` on the GPU ("bf16": bf16 operands
    with fp32 accumulation, as fla does for bf16 inputs); exact fp32 in
    interpret mode unless the algorithm is "bf16"."""
    if algorithm == "bf16":
        return _fast_dot(True, interpret)
    precision = dots.fp32_precision(interpret, algorithm)

    def dot(a, b):
        return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)

    return dot


def _fast_dot(low_precision: bool, interpret: bool):
    """Dot for the state pass: bf16 operands (fp32 accumulate) for bf16 inputs, else fp32."""
    if not low_precision:
        return _precise_dot(interpret)

    def dot(a, b):
        return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    return dot


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
