"""Per-shard layer pieces, run inside `jax.shard_map` by `sharding.prefill` and `sharding.decode`.

The layer math is the model's own: the KDA and MLA Flax modules are applied
to each rank's parameter shard with a config whose head counts are the local
ones (heads are independent, so a head shard is a smaller model of the same
kind), and the LatentMoE is reassembled from its pure functions (`route`,
`experts_grouped`, `rms_norm`, `glu_mlp`) around the expert-parallel
dispatch and combine.

Expert dispatch (`moe_ep`), over the ``EXPERT`` mesh axis:

* ``"ragged"`` (GPU): rows sorted by destination rank, `jax.lax.ragged_all_to_all`
  there and back; only routed rows travel.
* ``"dense"`` (CPU, where XLA has no ragged-all-to-all): a fixed-capacity
  `jax.lax.all_to_all` of per-destination buffers ``[ep, C, L]`` with
  ``C = tokens * top_k`` per rank, so nothing is ever dropped.

Both produce the same per-(token, k) expert outputs; the owner of the token
combines them with its routing weights, then LatentMoE's RMSNorm runs on the
complete routed sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimik3.config import ModelConfig
from kimik3.layers.kda import KDA
from kimik3.layers.mla import MLA
from kimik3.layers.mlp import glu_activation, glu_mlp
from kimik3.layers.moe import combine, experts_grouped, route, routed_tail
from kimik3.layers.primitives import rms_norm
from sharding.rules import EXPERT

DISPATCH_CHOICES = ("auto", "dense", "ragged")


def resolve_dispatch(dispatch: str) -> str:
    """'dense' or 'ragged' for a dispatch setting ('auto': ragged on GPU, dense elsewhere)."""
    if dispatch not in DISPATCH_CHOICES:
        raise ValueError(f"dispatch must be one of {DISPATCH_CHOICES}; got {dispatch!r}")
    if dispatch == "auto":
        return "ragged" if jax.default_backend() == "gpu" else "dense"
    return dispatch


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config of one tensor-parallel rank: heads / tp (the head dims are unchanged)."""
    if tp == 1:
        return cfg
    return cfg.replace(kda_heads=cfg.kda_heads // tp, mla_heads=cfg.mla_heads // tp)


def mixer(cfg_local: ModelConfig, layer: int, p_layer, h_btd, positions_bt, cache, kernels: str):
    """The token mixer (KDA or MLA) of `layer` on this rank's heads.

    h_btd [B, T, D] normed inputs (all tokens of the span); positions_bt [B, T];
    cache: this rank's slice of the layer's cache entry (`kimik3.caches`) or None.  Returns the
    partial output [B, T, D] (summed over this rank's heads only) and the entry written.
    """
    if cfg_local.mixer_kind(layer) == "kda":
        y, entry, _ = KDA(cfg_local, kernels).apply({"params": p_layer["kda"]}, h_btd, cache)
        return y, entry
    return MLA(cfg_local, kernels).apply({"params": p_layer["mla"]}, h_btd, positions_bt, cache)


def block_norms(cfg: ModelConfig, p_layer) -> dict:
    """A layer's two RMSNorms as `kimik3.block.residual_block` takes them (mixer_norm, ffn_norm)."""
    return {
        f"{half}_norm": lambda x, scale=p_layer[f"{half}_norm"]["scale"]: rms_norm(x, scale, cfg.norm_eps)
        for half in ("mixer", "ffn")
    }


def dense_ffn(cfg: ModelConfig, p_mlp, h_btd):
    """The dense GLU MLP (replicated weights; the config's activation) on this rank's tokens."""
    return glu_mlp(h_btd, p_mlp["w_gate_df"], p_mlp["w_up_df"], p_mlp["w_out_fd"], act=glu_activation(cfg))


def moe_ep(cfg: ModelConfig, p_moe, h_btd, *, ep: int, dispatch: str, kernels: str = "auto"):
    """LatentMoE with experts split over the EXPERT axis (ep ranks); h_btd [B, T, D] this rank's tokens.
    Without a latent (`ModelConfig.moe_latent` False) the experts read the tokens themselves and
    the combine is only scaled.

    Route (fp32, all experts) -> down-project to the latent -> dispatch each
    (token, k) row to the rank holding its expert -> grouped expert GEMMs on
    everything received -> return -> weighted combine -> RMSNorm -> up-project;
    plus the shared experts on full width.  Returns [B, T, D].
    """
    b, t, d = h_btd.shape
    x_nd = h_btd.reshape(b * t, d)
    ids_nk, weights_nk = route(
        x_nd, p_moe["w_router_de"], p_moe["router_bias_e"], cfg.n_active_experts, cfg.moe_biased_weights
    )
    x_nl = x_nd @ p_moe["w_down_dl"] if cfg.moe_latent else x_nd
    experts = (p_moe["w_gate_elf"], p_moe["w_up_elf"], p_moe["w_out_efl"])
    caps = glu_activation(cfg)
    if ep == 1:
        y_nkl = _expert_rows(
            x_nl[:, None, :].repeat(ids_nk.shape[1], 1).reshape(-1, x_nl.shape[-1]),
            ids_nk.reshape(-1),
            jnp.ones(ids_nk.size, bool),
            experts,
            caps,
            kernels,
        )
        y_nkl = y_nkl.reshape(ids_nk.shape + (-1,))
    elif dispatch == "dense":
        y_nkl = _dispatch_dense(x_nl, ids_nk, experts, caps, ep, kernels)
    elif dispatch == "ragged":
        y_nkl = _dispatch_ragged(x_nl, ids_nk, experts, caps, ep, kernels)
    else:
        raise ValueError(f"dispatch must be 'dense' or 'ragged'; got {dispatch!r}")
    # the combine of experts_grouped, on the rows that came back, then the model's own tail
    y_btd = routed_tail(
        combine(weights_nk, y_nkl), cfg, p_moe.get("latent_norm_l"), p_moe.get("w_up_ld"), (b, t, d), h_btd.dtype
    )
    if cfg.n_shared_experts:
        y_btd = y_btd + dense_ffn(cfg, p_moe["shared"], h_btd)
    return y_btd


def _expert_rows(rows_rl, local_ids_r, valid_r, experts, caps, kernels):
    """Each row through its (local) expert: experts_grouped with k = 1 and weight 1 (0 for padding rows)."""
    ids = jnp.where(valid_r, local_ids_r, 0)[:, None]
    return experts_grouped(rows_rl, ids, valid_r.astype(rows_rl.dtype)[:, None], *experts, caps, kernels)


def _dispatch_dense(x_nl, ids_nk, experts, caps, ep: int, kernels: str):
    """Fixed-capacity all-to-all there and back.  Returns expert outputs [N, k, L] in (token, k) order."""
    n, k = ids_nk.shape
    e_local = experts[0].shape[0]
    cap = n * k  # every row could go to one rank: nothing is dropped
    flat_ids = ids_nk.reshape(-1)
    dest = flat_ids // e_local  # [N*k] destination rank within the EXPERT axis
    onehot = dest[:, None] == jnp.arange(ep)[None, :]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, dest[:, None], axis=1)[:, 0]  # row within dest
    rows = jnp.repeat(x_nl, k, axis=0)  # row r = token r // k
    send_x = jnp.zeros((ep, cap, x_nl.shape[-1]), x_nl.dtype).at[dest, slot].set(rows)
    send_e = jnp.full((ep, cap), -1, jnp.int32).at[dest, slot].set(flat_ids % e_local)
    recv_x = jax.lax.all_to_all(send_x, EXPERT, 0, 0, tiled=True)  # [ep (source), cap, L]
    recv_e = jax.lax.all_to_all(send_e, EXPERT, 0, 0, tiled=True)
    valid = recv_e.reshape(-1) >= 0
    out = _expert_rows(recv_x.reshape(ep * cap, -1), recv_e.reshape(-1), valid, experts, caps, kernels)
    back = jax.lax.all_to_all(out.reshape(ep, cap, -1), EXPERT, 0, 0, tiled=True)  # [ep (dest), cap, L]
    return back[dest, slot].reshape(n, k, -1)


def _dispatch_ragged(x_nl, ids_nk, experts, caps, ep: int, kernels: str):
    """ragged_all_to_all there and back (GPU).  Returns expert outputs [N, k, L] in (token, k) order."""
    n, k = ids_nk.shape
    e_local = experts[0].shape[0]
    cap = n * k
    flat_ids = ids_nk.reshape(-1)
    dest = flat_ids // e_local
    order = jnp.argsort(dest, stable=True)
    rows = jnp.repeat(x_nl, k, axis=0)[order]
    local_ids = (flat_ids % e_local)[order]
    send_sizes = jnp.bincount(dest, length=ep).astype(jnp.int32)
    send_offsets = jnp.cumsum(send_sizes) - send_sizes
    sizes_sd = jax.lax.all_gather(send_sizes, EXPERT)  # [ep (source), ep (dest)] rows each rank sends each rank
    me = jax.lax.axis_index(EXPERT)
    recv_sizes = sizes_sd[:, me]
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    # where my rows land in each destination's buffer: after the rows of lower-ranked sources
    out_offsets = (jnp.cumsum(sizes_sd, axis=0) - sizes_sd)[me]
    recv_x = jax.lax.ragged_all_to_all(
        rows,
        jnp.zeros((ep * cap, rows.shape[-1]), rows.dtype),
        send_offsets,
        send_sizes,
        out_offsets,
        recv_sizes,
        axis_name=EXPERT,
    )
    recv_e = jax.lax.ragged_all_to_all(
        local_ids,
        jnp.zeros((ep * cap,), jnp.int32),
        send_offsets,
        send_sizes,
        out_offsets,
        recv_sizes,
        axis_name=EXPERT,
    )
    valid = jnp.arange(ep * cap) < jnp.sum(recv_sizes)
    out = _expert_rows(recv_x, recv_e, valid, experts, caps, kernels)
    # back: my received chunk from source s returns to s at the offset s used to send it to me
    back_offsets = (jnp.cumsum(sizes_sd, axis=1) - sizes_sd)[:, me]
    back = jax.lax.ragged_all_to_all(
        out,
        jnp.zeros((cap, out.shape[-1]), out.dtype),
        recv_offsets,
        recv_sizes,
        back_offsets,
        send_sizes,
        axis_name=EXPERT,
    )
    y = jnp.zeros_like(back).at[order].set(back)
    return y.reshape(n, k, -1)
