"""The one place that chooses how the model's heavy operators run.

Layers call these functions, never a kernel or a reference directly.
`kernels` selects the implementation:

* ``"auto"`` (default): the Pallas kernels on GPU, the pure-jnp references elsewhere;
  ``KIMIK3_KERNELS=reference|pallas`` in the environment overrides the choice.
* ``"reference"``: the pure-jnp references (the oracle always uses these).
* ``"pallas"``: the Pallas kernels (interpret mode off the GPU: slow, for tests).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import kda as kda_kernels

KERNEL_CHOICES = ("auto", "reference", "pallas")


def resolve(kernels: str) -> str:
    """'reference' or 'pallas' for a `kernels` setting."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}; got {kernels!r}")
    if kernels == "auto":
        kernels = os.environ.get("KIMIK3_KERNELS", "pallas" if jax.default_backend() == "gpu" else "reference")
        if kernels not in ("reference", "pallas"):
            raise ValueError(f"KIMIK3_KERNELS must be 'reference' or 'pallas'; got {kernels!r}")
    return kernels


def kda(q, k, v, g, beta, *, initial_state=None, chunk_size=64, kernels="auto"):
    """KDA over a span of tokens: [B, T, H, K] q/k/g, [B, T, H, V] v, [B, T, H] beta.

    One token (decode) takes the recurrent form; longer spans the chunked form.
    Returns (o [B, T, H, V], final_state [B, H, K, V] fp32).
    """
    b, t, h, dk = q.shape
    if resolve(kernels) == "reference":
        if t == 1:
            return kda_kernels.kda_recurrent_ref(q, k, v, g, beta, initial_state=initial_state)
        return kda_kernels.kda_chunked_ref(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size)
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    if t == 1:
        return kda_kernels.fused_recurrent_kda(q, k, v, g, beta, state_pool=initial_state,
                                               slots=jnp.arange(b, dtype=jnp.int32))
    o, final_state, _ = kda_kernels.chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
    return o, final_state
