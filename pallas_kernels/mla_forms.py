"""MLA's two forms over the latent cache, written once: the layer (`kimik3.layers.mla`),
`kimik3.ops` and the kernels' references (`pallas_kernels.mla`) all call these.

A latent row is ``c_kv ++ k_pe`` ([kv_lora + rope]).  With W_UK [kv_lora, H, nope] and W_UV
[kv_lora, H, v]:

* naive (expanded): keys ``c_kv W_UK ++ k_pe`` and values ``c_kv W_UV`` per head (`expand_heads`),
  attention with head dims (nope + rope) / v;
* absorbed: the query folded into the latent (``q_latent = q_nope W_UK``, `absorb_query`), one
  latent KV head of key dim kv_lora + rope and value dim kv_lora (`latent_attention`), W_UV
  applied to the latent output (`unabsorb`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.attention import attend


def expand_heads(latent_nsr, w_kb, w_vb):
    """Latent rows [N, S, kv_lora + rope] -> per-head keys [N, S, H, nope + rope] (the rope part
    shared by all heads) and values [N, S, H, v], through W_UK [kv_lora, H, nope] and W_UV
    [kv_lora, H, v]: the expanded (naive) form's operands, in the latent's dtype."""
    r = w_kb.shape[0]
    c, k_pe = latent_nsr[..., :r], latent_nsr[..., r:]
    k_nope = jnp.einsum("nsr,rhd->nshd", c, w_kb.astype(c.dtype))
    v = jnp.einsum("nsr,rhd->nshd", c, w_vb.astype(c.dtype))
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], k_pe.shape[:2] + (k_nope.shape[2], k_pe.shape[-1]))
    return jnp.concatenate([k_nope, k_pe], axis=-1), v


def absorb_query(q_bthd, w_kb_rhn):
    """Queries [B, T, H, nope + rope] -> (q_latent [B, T, H, kv_lora] = q_nope W_UK, q_pe
    [B, T, H, rope])."""
    nope = w_kb_rhn.shape[-1]
    return jnp.einsum("bthn,rhn->bthr", q_bthd[..., :nope], w_kb_rhn), q_bthd[..., nope:]


def unabsorb(o_latent_bthr, w_vb_rhv):
    """The latent attention's output [B, T, H, kv_lora] -> [B, T, H, v] through W_UV."""
    return jnp.einsum("bthr,rhv->bthv", o_latent_bthr, w_vb_rhv)


def latent_attention(q_latent, q_pe, kv_bsr, *, scale: float, q_pos_bt, k_pos_bs, return_lse: bool = False):
    """MQA over the latent rows: q_latent [B, T, H, kv_lora] ++ q_pe [B, T, H, rope] against one
    KV head whose keys are the rows kv [B, S, kv_lora + rope] and values their first kv_lora
    columns, causal by positions -> [B, T, H, kv_lora] (and the log-sum-exp [B, T, H])."""
    r = q_latent.shape[-1]
    q = jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1)
    kv = kv_bsr[:, :, None, :].astype(q.dtype)
    return attend(q, kv, kv[..., :r], scale=scale, q_pos_bt=q_pos_bt, k_pos_bs=k_pos_bs, return_lse=return_lse)


def mla_naive(q_bthd, latent_bsr, w_kb_rhn, w_vb_rhv, *, scale: float, q_pos_bt, k_pos_bs):
    """Expanded form: q [B, T, H, nope + rope] over latent rows [B, S, kv_lora + rope] -> [B, T, H, v]."""
    k, v = expand_heads(latent_bsr, w_kb_rhn, w_vb_rhv)
    return attend(q_bthd, k, v, scale=scale, q_pos_bt=q_pos_bt, k_pos_bs=k_pos_bs)


def mla_absorbed(q_bthd, latent_bsr, w_kb_rhn, w_vb_rhv, *, scale: float, q_pos_bt, k_pos_bs):
    """Absorbed form, same contract as `mla_naive`: MQA over the latent, one KV head."""
    q_latent, q_pe = absorb_query(q_bthd, w_kb_rhn)
    o_latent = latent_attention(q_latent, q_pe, latent_bsr, scale=scale, q_pos_bt=q_pos_bt, k_pos_bs=k_pos_bs)
    return unabsorb(o_latent, w_vb_rhv)
