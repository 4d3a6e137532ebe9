"""LatentMoE: routed experts in a shared latent space, plus full-width shared experts.

    scores  = sigmoid(x W_router)                 (fp32, full width)
    chosen  = top_k(scores + bias)                (bias steers selection only)
    weights = scores[chosen] / sum(scores[chosen])
    z       = sum_k weights_k * Expert_k(x W_down)     (experts live in the latent)
    routed  = RMSNorm(z) W_up * routed_scaling_factor
    y       = routed + SharedExperts(x)

Without a latent (`ModelConfig.moe_latent` False: Kimi-Linear, DeepSeek-V3's form) the experts
read x itself and ``routed = z * routed_scaling_factor`` (no W_down, norm or W_up).  With
`ModelConfig.moe_biased_weights` the weights read ``(scores + bias)[chosen]`` instead (Kimi's
remote code).  The experts' GLU is the config's (`kimik3.layers.mlp.glu_activation`).

An expert id of E (padding tokens, `LatentMoE(real_bt=)`) names no expert: every path gives
that assignment 0.  Two equal expert paths: `experts_grouped` (tokens sorted by expert, one
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
from kimik3.layers.mlp import MLP, SituGLU, as_activation, glu_activation
from kimik3.layers.primitives import fan_in_init, qparam, rms_norm

HIGHEST = jax.lax.Precision.HIGHEST


def router_logits(x_nd, w_router_de):
    """The router's fp32 logits [N, E] (full width, HIGHEST precision)."""
    return jnp.dot(x_nd.astype(jnp.float32), w_router_de.astype(jnp.float32), precision=HIGHEST)


def route_logits(logits_ne, bias_e, top_k: int, biased_weights: bool = False):
    """Sigmoid routing of fp32 logits.  Returns (expert ids [N, k] int32, weights [N, k] fp32):
    the chosen scores renormalised, or with `biased_weights` the chosen scores + bias."""
    scores = jax.nn.sigmoid(logits_ne)
    choice = scores + bias_e.astype(jnp.float32)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(choice if biased_weights else scores, ids, axis=-1)
    return ids.astype(jnp.int32), weights / jnp.sum(weights, axis=-1, keepdims=True)


def route(x_nd, w_router_de, bias_e, top_k: int, biased_weights: bool = False):
    """fp32 sigmoid router.  Returns (expert ids [N, k] int32, weights [N, k] fp32)."""
    return route_logits(router_logits(x_nd, w_router_de), bias_e, top_k, biased_weights)


def _expert_ffn(h_gate, h_up, act):
    return as_activation(act)(h_gate, h_up)


def _gate_up(x, w_gate, w_up, dot):
    """(gate, up) projections of x; w_up None: w_gate holds both, [..., 2F] (`kimik3.fused`)."""
    if w_up is None:
        h = dot(x, w_gate)
        return h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2 :]
    return dot(x, w_gate), dot(x, w_up)


_SituGLU = SituGLU  # the kernels' tests and benchmarks name it here


def experts_grouped(x_nl, ids_nk, weights_nk, w_gate_elf, w_up_elf, w_out_efl, caps, kernels="auto"):
    """Grouped expert GEMMs.  x_nl [N, L] latent tokens; ids/weights [N, k]; expert weights
    [E, L, F] / [E, F, L] (w_up_elf None: w_gate_elf is gate ++ up, [E, L, 2F], one GEMM for
    both); caps: the GLU (a hashable activation, `kimik3.layers.mlp.glu_activation`) or
    SiTU-GLU's (gate_cap, up_cap).  Returns the weighted combine [N, L].

    With fused gate/up on the Pallas path: `ops.grouped_ffn` (both GEMMs and the activation in
    one group-aligned layout).  Otherwise rows sorted by expert and one `ops.grouped_matmul`
    per projection (`_experts_sorted`, also the reference the fused path is tested against)."""
    if w_up_elf is None and ops.grouped_ffn_fits(x_nl, w_gate_elf, w_out_efl, kernels):
        y = ops.grouped_ffn(x_nl, ids_nk, w_gate_elf, w_out_efl, as_activation(caps))
    else:
        y = _experts_sorted(x_nl, ids_nk, w_gate_elf, w_up_elf, w_out_efl, caps, kernels)
    return combine(weights_nk, y)


def combine(weights_nk, y_nkl):
    """The routed output [N, L]: each token's expert outputs [N, k, L] weighted by its routing."""
    return jnp.einsum("nk,nkl->nl", weights_nk.astype(y_nkl.dtype), y_nkl)


def routed_tail(z_nl, cfg: ModelConfig, latent_norm_l, w_up_ld, shape_btd, dtype, *, normed: bool = False):
    """The MoE's tail after its routed experts, written once for every path: the combined rows
    z [N, L] (`combine`) -> the latent RMSNorm (skipped where `normed`: a kernel fused it) and the
    up-projection to D (without a latent, a cast to fp32), times routed_scaling_factor, as
    [B, T, D] (`shape_btd`) in `dtype`.  The shared experts are added by the caller."""
    if cfg.moe_latent:
        z_nl = z_nl if normed else rms_norm(z_nl, latent_norm_l, cfg.norm_eps)
        routed = z_nl @ w_up_ld
    else:
        routed = z_nl.astype(jnp.float32)
    return (routed * cfg.routed_scaling_factor).reshape(shape_btd).astype(dtype)


def _experts_sorted(x_nl, ids_nk, w_gate_elf, w_up_elf, w_out_efl, caps, kernels="auto"):
    """Unweighted expert outputs [N, k, L]: rows sorted by expert, a grouped GEMM per projection."""
    n, k = ids_nk.shape
    n_experts = w_gate_elf.shape[0]
    flat_ids = ids_nk.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    rows = x_nl[order // k]  # [N*k, L], grouped by expert
    group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)
    gmm = lambda a, w: ops.grouped_matmul(a, w, group_sizes, kernels=kernels)
    h = _expert_ffn(*_gate_up(rows, w_gate_elf, w_up_elf, gmm), caps)
    y_sorted = gmm(h, w_out_efl)  # [N*k, L]
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, -1)


def experts_dense_ref(x_nl, ids_nk, weights_nk, w_gate_elf, w_up_elf, w_out_efl, caps, kernels="auto"):
    """Reference: every expert on every token, masked by its routing weight."""
    w_gate_elf, w_out_efl = ops.expert_weights(w_gate_elf, x_nl.dtype), ops.expert_weights(w_out_efl, x_nl.dtype)
    w_up_elf = None if w_up_elf is None else ops.expert_weights(w_up_elf, x_nl.dtype)
    out = jnp.zeros(x_nl.shape, jnp.float32)
    for e in range(w_gate_elf.shape[0]):
        w_e = jnp.sum(jnp.where(ids_nk == e, weights_nk, 0.0), axis=-1)  # [N]
        up_e = None if w_up_elf is None else w_up_elf[e]
        y_e = _expert_ffn(*_gate_up(x_nl, w_gate_elf[e], up_e, jnp.matmul), caps) @ w_out_efl[e]
        out = out + w_e[:, None] * y_e.astype(jnp.float32)
    return out.astype(x_nl.dtype)


EXPERT_PATHS = {"grouped": experts_grouped, "dense": experts_dense_ref}


class LatentMoE(nn.Module):
    """x [B, T, D] -> [B, T, D]."""

    cfg: ModelConfig
    expert_path: str = "grouped"
    kernels: str = "auto"  # see kimik3.ops

    @nn.compact
    def __call__(self, x_btd, real_bt=None):
        """real_bt: bool [B, T] or None; tokens marked False (padding) are routed to no expert
        (their routed part is 0; the shared experts still run) and read no expert weights."""
        cfg = self.cfg
        latent = cfg.moe_latent
        d, f, e = cfg.d_model, cfg.moe_expert_dim, cfg.n_routed_experts
        l = cfg.moe_latent_dim if latent else d  # the width the experts read and write
        w_router = self.param("w_router_de", fan_in_init(d), (d, e))
        bias = self.param("router_bias_e", nn.initializers.zeros, (e,))
        fs = cfg.n_shared_experts * cfg.moe_shared_dim  # n shared GLU experts summed == one of n * F units
        act = glu_activation(cfg)
        b, t, _ = x_btd.shape
        x_nd = x_btd.reshape(b * t, d)
        fused = self.has_variable("params", "w_in_dx") or self.has_variable("params", "w_gateup_elf")
        shared_gate = shared_up = None
        if fused:
            # `kimik3.fused`: x's bf16 projections (latent down, shared gate, shared up) as one
            # GEMM, and each expert's gate and up as one grouped GEMM
            down = l if latent else 0
            if down + 2 * fs:
                x_in = x_nd @ self.param("w_in_dx", fan_in_init(d), (d, down + 2 * fs))
                shared_gate, shared_up = x_in[:, down : down + fs], x_in[:, down + fs :]
            x_nl = x_in[:, :l] if latent else x_nd
            w_gate, w_up = qparam(self, "w_gateup_elf", fan_in_init(l), (e, l, 2 * f)), None
        else:
            x_nl = x_nd @ self.param("w_down_dl", fan_in_init(d), (d, l)) if latent else x_nd
            w_gate = qparam(self, "w_gate_elf", fan_in_init(l), (e, l, f))
            w_up = qparam(self, "w_up_elf", fan_in_init(l), (e, l, f))
        w_out = qparam(self, "w_out_efl", fan_in_init(f), (e, f, l))
        if latent:
            latent_norm = self.param("latent_norm_l", nn.initializers.ones, (l,))
            w_upproj = self.param("w_up_ld", fan_in_init(l), (l, d))

        logits = router_logits(x_nd, w_router)
        if (
            latent
            and not cfg.moe_biased_weights
            and self.expert_path == "grouped"
            and w_up is None
            and ops.routed_ffn_fits(x_nl, w_gate, w_out, cfg.n_active_experts, self.kernels)
        ):
            # a decode step's few tokens: routing and layout in one kernel, the grouped FFN, then
            # the combine and the latent norm in one kernel
            z, normed = (
                ops.routed_ffn(
                    x_nl,
                    logits,
                    bias,
                    None if real_bt is None else real_bt.reshape(-1),
                    w_gate,
                    w_out,
                    act,
                    cfg.n_active_experts,
                    latent_norm,
                    cfg.norm_eps,
                ),
                True,
            )
        else:
            ids, weights = route_logits(logits, bias, cfg.n_active_experts, cfg.moe_biased_weights)
            if real_bt is not None:
                ids = jnp.where(real_bt.reshape(b * t, 1), ids, e)  # id E: dropped by every expert path
            z = EXPERT_PATHS[self.expert_path](x_nl, ids, weights, w_gate, w_up, w_out, act, self.kernels)
            normed = False
        y = routed_tail(
            z, cfg, latent_norm if latent else None, w_upproj if latent else None, (b, t, d), x_btd.dtype, normed=normed
        )
        if fs and fused:
            w_shared_out = self.param("w_shared_out_fd", fan_in_init(fs), (fs, d))
            y = y + (act(shared_gate, shared_up) @ w_shared_out).reshape(b, t, d).astype(y.dtype)
        elif fs:
            y = y + MLP(d, fs, cfg.situ_gate_cap, cfg.situ_up_cap, cfg.ffn_activation, name="shared")(x_btd)
        return y
