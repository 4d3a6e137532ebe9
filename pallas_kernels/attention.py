"""Softmax attention over explicit positions: the one attention core that the
MLA naive form, the MLA absorbed form, the ViT, and the MLA kernels'
references share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def attend(q_bthd, k_bshd, v_bshe, *, scale: float, q_pos_bt=None, k_pos_bs=None, return_lse: bool = False):
    """Multi-head attention with an fp32 softmax.

    Args:
      q_bthd: [B, T, H, D] queries.
      k_bshd: [B, S, Hk, D], v_bshe: [B, S, Hk, E] with Hk == H or Hk == 1
        (one shared latent head: MLA's absorbed form).
      q_pos_bt, k_pos_bs: absolute positions; when given, query t sees key s
        iff k_pos[s] <= q_pos[t] (causal).  None: bidirectional.
    Returns:
      [B, T, H, E] in v's dtype; with `return_lse` also the log-sum-exp of
      the scaled logits, fp32 [B, T, H] (-inf where no key is visible).
    """
    if k_bshd.shape[2] == 1:
        k_bshd = jnp.broadcast_to(k_bshd, k_bshd.shape[:2] + (q_bthd.shape[2], k_bshd.shape[3]))
        v_bshe = jnp.broadcast_to(v_bshe, v_bshe.shape[:2] + (q_bthd.shape[2], v_bshe.shape[3]))
    logits = (
        jnp.einsum("bthd,bshd->bhts", q_bthd.astype(jnp.float32), k_bshd.astype(jnp.float32), precision=HIGHEST) * scale
    )
    if q_pos_bt is not None:
        visible = k_pos_bs[:, None, None, :] <= q_pos_bt[:, None, :, None]  # [B, 1, T, S]
        logits = jnp.where(visible, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhts,bshe->bthe", probs, v_bshe.astype(jnp.float32), precision=HIGHEST).astype(v_bshe.dtype)
    if return_lse:
        return out, jnp.moveaxis(jax.nn.logsumexp(logits, axis=-1), 1, 2)
    return out
