"""LatentMoE: routed experts in a shared latent space, plus full-width shared experts.

    scores  = sigmoid(x W_router)                 (fp32, full width)
    chosen  = top_k(scores + bias)                (bias steers selection only)
    weights = scores[chosen] / sum(scores[chosen])
    z       = sum_k weights_k * Expert_k(x W_down)     (experts live in the latent)
    routed  = RMSNorm(z) W_up * routed_scaling_factor
    y       = routed + SharedExperts(x)

Two equal expert paths: `experts_grouped` (tokens sorted by expert, one
grouped GEMM per projection: `kimik3.ops.grouped_matmul`, the Pallas kernel on
GPU, `lax.ragged_dot` elsewhere) and `experts_dense_ref` (a loop over experts;
the reference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from kimik3 import ops
from kimik3.config import ModelConfig
from kimik3.layers.mlp import MLP
from kimik3.layers.primitives import fan_in_init, rms_norm, situ_glu

HIGHEST = jax.lax.Precision.HIGHEST


def route(x_nd, w_router_de, bias_e, top_k: int):
    """fp32 sigmoid router.  Returns (expert ids [N, k] int32, weights [N, k] fp32)."""
    scores = jax.nn.sigmoid(jnp.dot(x_nd.astype(jnp.float32), w_router_de.astype(jnp.float32),
                                    precision=HIGHEST))
    _, ids = jax.lax.top_k(scores + bias_e.astype(jnp.float32), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    return ids.astype(jnp.int32), weights / jnp.sum(weights, axis=-1, keepdims=True)


def _expert_ffn(h_gate, h_up, caps):
    return situ_glu(h_gate, h_up, *caps)


def experts_grouped(x_nl, ids_nk, weights_nk, w_gate_elf, w_up_elf, w_out_efl, caps, kernels="auto"):
    """Grouped expert GEMMs: rows sorted by expert, one `ops.grouped_matmul` per projection.

    x_nl [N, L] latent tokens; ids/weights [N, k]; expert weights [E, L, F] /
    [E, F, L].  Returns the weighted combine [N, L].
    """
    n, k = ids_nk.shape
    n_experts = w_gate_elf.shape[0]
    flat_ids = ids_nk.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    rows = x_nl[order // k]  # [N*k, L], grouped by expert
    group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)
    gmm = lambda a, w: ops.grouped_matmul(a, w, group_sizes, kernels=kernels)
    h = _expert_ffn(gmm(rows, w_gate_elf), gmm(rows, w_up_elf), caps)
    y_sorted = gmm(h, w_out_efl)  # [N*k, L]
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, -1)
    return jnp.einsum("nk,nkl->nl", weights_nk.astype(y.dtype), y)


def experts_dense_ref(x_nl, ids_nk, weights_nk, w_gate_elf, w_up_elf, w_out_efl, caps, kernels="auto"):
    """Reference: every expert on every token, masked by its routing weight."""
    out = jnp.zeros(x_nl.shape, jnp.float32)
    for e in range(w_gate_elf.shape[0]):
        w_e = jnp.sum(jnp.where(ids_nk == e, weights_nk, 0.0), axis=-1)  # [N]
        y_e = _expert_ffn(x_nl @ w_gate_elf[e], x_nl @ w_up_elf[e], caps) @ w_out_efl[e]
        out = out + w_e[:, None] * y_e.astype(jnp.float32)
    return out.astype(x_nl.dtype)


EXPERT_PATHS = {"grouped": experts_grouped, "dense": experts_dense_ref}


class LatentMoE(nn.Module):
    """x [B, T, D] -> [B, T, D]."""

    cfg: ModelConfig
    expert_path: str = "grouped"
    kernels: str = "auto"  # see kimik3.ops

    @nn.compact
    def __call__(self, x_btd):
        cfg = self.cfg
        d, l, f, e = cfg.d_model, cfg.moe_latent_dim, cfg.moe_expert_dim, cfg.n_routed_experts
        w_router = self.param("w_router_de", fan_in_init(d), (d, e))
        bias = self.param("router_bias_e", nn.initializers.zeros, (e,))
        w_down = self.param("w_down_dl", fan_in_init(d), (d, l))
        w_gate = self.param("w_gate_elf", fan_in_init(l), (e, l, f))
        w_up = self.param("w_up_elf", fan_in_init(l), (e, l, f))
        w_out = self.param("w_out_efl", fan_in_init(f), (e, f, l))
        latent_norm = self.param("latent_norm_l", nn.initializers.ones, (l,))
        w_upproj = self.param("w_up_ld", fan_in_init(l), (l, d))

        b, t, _ = x_btd.shape
        x_nd = x_btd.reshape(b * t, d)
        ids, weights = route(x_nd, w_router, bias, cfg.n_active_experts)
        z = EXPERT_PATHS[self.expert_path](x_nd @ w_down, ids, weights, w_gate, w_up, w_out,
                                           (cfg.situ_gate_cap, cfg.situ_up_cap), self.kernels)
        routed = (rms_norm(z, latent_norm, cfg.norm_eps) @ w_upproj) * cfg.routed_scaling_factor
        y = routed.reshape(b, t, d).astype(x_btd.dtype)
        if cfg.n_shared_experts:
            # n shared SiTU-GLU experts summed == one with n * F intermediate units.
            y = y + MLP(d, cfg.n_shared_experts * cfg.moe_shared_dim, cfg.situ_gate_cap, cfg.situ_up_cap,
                        name="shared")(x_btd)
        return y
