"""The one place that chooses how the model's heavy operators run.

Layers call these functions, never a kernel or a reference directly.  Today
every operator runs its pure-jnp reference from `pallas_kernels`; the Pallas
kernels (issues 3 and 4) plug in here, chosen by backend, so the model, the
oracle and the serving engine all switch together.
"""

from __future__ import annotations

from pallas_kernels import kda as kda_ref


def kda(q, k, v, g, beta, *, initial_state=None, chunk_size=64):
    """KDA over a span of tokens: [B, T, H, K] q/k/g, [B, T, H, V] v, [B, T, H] beta.

    One token (decode) takes the recurrent form; longer spans take the
    chunked form.  Returns (o [B, T, H, V], final_state [B, H, K, V] fp32).
    """
    if q.shape[1] == 1:
        return kda_ref.kda_recurrent_ref(q, k, v, g, beta, initial_state=initial_state)
    return kda_ref.kda_chunked_ref(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size)
