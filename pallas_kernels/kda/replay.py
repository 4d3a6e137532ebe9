"""The replay baselines (for comparison only): states at cache boundaries from replaying the
prefix, before the single-pass export."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.chunk import chunk_kda


# ---- replay baselines (for comparison only) ---------------------------------------------------
#
# Without single-pass export, states at cache boundaries come from replaying
# the prefix through a kernel that only returns its final state:
#   align:   the prefill, plus one replay in KDA-block segments (1536) -> 2 passes
#   partial: align, plus one replay in partial-unit segments (128)    -> 3 passes


def _replay_states(q, k, v, g, beta, segment, n_tokens, initial_state, scale, interpret):
    """States after every `segment` tokens up to `n_tokens`, by running the kernel
    segment after segment (each launch returns only its final state)."""
    n_seg = n_tokens // segment
    seg = lambda x: jnp.moveaxis(x[:, : n_seg * segment].reshape((x.shape[0], n_seg, segment) + x.shape[2:]), 1, 0)

    def step(s, xs):
        _, s, _ = chunk_kda(*xs, scale=scale, initial_state=s, output_final_state=True, interpret=interpret)
        return s, s

    _, states = jax.lax.scan(step, initial_state, tuple(seg(x) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(states, 0, 1)  # [B, n_seg, H, K, V]


def chunk_kda_replay(
    q, k, v, g, beta, *, mode, block_tokens=1536, unit_tokens=128, scale=None, initial_state=None, interpret=None
):
    """The replay baselines.  Returns (o, block_states [B, n_blocks, ...],
    unit_states [B, n_units, ...] or None for mode 'align')."""
    if mode not in ("align", "partial"):
        raise ValueError(f"mode must be 'align' or 'partial'; got {mode!r}")
    b, t, h, dk = q.shape
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    o, _, _ = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, interpret=interpret)
    blocks = _replay_states(q, k, v, g, beta, block_tokens, t, initial_state, scale, interpret)
    units = None
    if mode == "partial":
        units = _replay_states(q, k, v, g, beta, unit_tokens, t, initial_state, scale, interpret)
    return o, blocks, units
