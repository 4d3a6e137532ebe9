"""Multi-head Latent Attention (DeepSeek-V3 shapes, NoPE, a sigmoid output gate where the config
has one: `ModelConfig.mla_output_gate`).

Per token and layer the cache holds one latent row ``c_kv ++ k_pe``
([kv_lora + rope] values).  Two mathematically equal forms read it:

* naive (prefill): expand c_kv through W_UK / W_UV into per-head keys and
  values, attend with head dims (nope + rope) / v.
* absorbed (decode): fold W_UK into the query (``q_latent = q_nope W_UK``) and
  attend with a single latent KV head (key dim kv_lora + rope, value dim
  kv_lora); W_UV is applied to the latent output.

Both are written once, in `pallas_kernels.mla_forms` (the kernels' references use them too).

NoPE: the rope dims are kept as a separate shared key part but never rotated,
so positions enter only through causality.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn

from kimik3 import ops
from kimik3.caches import MLALatent, MLAPages
from kimik3.config import ModelConfig
from kimik3.layers.primitives import fan_in_init, gemm_form, qparam, rms_norm
from pallas_kernels.mla import gather_pages, write_latent
from pallas_kernels.mla_forms import expand_heads, mla_absorbed, mla_naive  # noqa: F401 (the forms, re-exported)


def init_mla_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> MLALatent:
    """An empty `MLALatent`: latent [B, max_len, kv_lora + rope] zeros in `dtype`."""
    return MLALatent(jnp.zeros((batch, max_len, cfg.mla_latent_dim), dtype))


def write_rows(cache_bsr, rows_btr, start_b):
    """Write rows [B, T, R] into cache [B, S, R] at per-sequence offsets start_b [B]."""
    write = lambda c, r, s: jax.lax.dynamic_update_slice(c, r.astype(c.dtype), (s, 0))
    return jax.vmap(write)(cache_bsr, rows_btr, start_b)


def input_widths(cfg: ModelConfig) -> tuple[int, ...]:
    """The widths of the projections of x, in the fused GEMM's column order: q (or its LoRA-down),
    the kv latent and, where the config has one, the output gate."""
    q_in = cfg.q_lora_rank or cfg.mla_heads * cfg.mla_qk_dim
    gate = (cfg.mla_heads * cfg.v_head_dim,) if cfg.mla_output_gate else ()
    return (q_in, cfg.mla_latent_dim) + gate


def mla_project(cfg: ModelConfig, w: dict, x_btd, kernels: str = "auto"):
    """The layer's projections of x [B, T, D_in] from its weights `w` (separate or `kimik3.fused`):
    (q [B, T, H, nope + rope], the new latent rows [B, T, kv_lora + rope], the output gate's
    pre-activation [B, T, H, v], or None without an output gate).  D_in is the model width, or
    2D in an EAGLE-3 draft layer.  Any projection may be a quantized `QTensor` in its GEMM form
    (`kimik3.ops.linear`)."""
    h, r = cfg.mla_heads, cfg.kv_lora_rank
    lin = lambda x, name: ops.linear(x, gemm_form(w[name], 1), kernels=kernels)
    heads = lambda y, dim: y.reshape(y.shape[:-1] + (h, dim))
    xg = None
    if "w_in_dx" in w:
        parts = jnp.split(lin(x_btd, "w_in_dx"), np.cumsum(input_widths(cfg))[:-1].tolist(), axis=-1)
        xq, kv = parts[:2]
        xg = parts[2] if cfg.mla_output_gate else None
    else:
        xq = lin(x_btd, "w_qa_dq" if cfg.q_lora_rank else "w_q_dhk")
        kv = lin(x_btd, "w_kva_dr")
        if cfg.mla_output_gate:
            xg = lin(x_btd, "w_gate_dhv")
    xg = None if xg is None else heads(xg, cfg.v_head_dim)
    if cfg.q_lora_rank:
        q = heads(lin(rms_norm(xq, w["q_norm"], cfg.mla_eps), "w_qb_qhk"), cfg.mla_qk_dim)
    else:
        q = heads(xq, cfg.mla_qk_dim)
    latent_new = jnp.concatenate([rms_norm(kv[..., :r], w["kv_norm"], cfg.mla_eps), kv[..., r:]], axis=-1)
    return q, latent_new, xg


def mla_output(w: dict, o_bthv, xg_bthv, dtype, kernels: str = "auto"):
    """Gate the attention output o [B, T, H, v] by sigmoid(xg) (fp32; xg None: no gate) and
    project it to [B, T, D]."""
    if xg_bthv is None:
        return ops.linear_heads(o_bthv.astype(dtype), w["w_o_hvd"], kernels=kernels)
    gate = jax.nn.sigmoid(xg_bthv.astype(jnp.float32))
    o = (o_bthv.astype(jnp.float32) * gate).astype(dtype)
    return ops.linear_heads(o, w["w_o_hvd"], kernels=kernels)


class MLA(nn.Module):
    """x [B, T, D_in], positions [B, T], cache -> (y [B, T, D], the cache entry written).

    The cache entry's type picks the path (`kimik3.caches`):

    * None: attention over the span's own tokens; the entry written is None.
    * `MLALatent` (latent [B, S, R]): the new latents are written at ``positions[:, 0]``
      onwards; the entry written is the `MLALatent` after.
    * `MLAPages` (pages [P, page, R], block_tables [B, max_pages]): the new latents are written
      into their pages; with valid_b (int32 [B]) only row b's first valid_b[b] latents, the rest
      pad a prefill chunk and are dropped.  The entry written is the `MLAPages` after.

    Attention reads the whole cache (causality masks unwritten rows).  Spans of
    at most `cfg.mla_absorb_max_tokens` tokens use the absorbed form.  D_in is the model width
    D, or 2D in an EAGLE-3 draft layer (`kimik3.eagle`); the output is always D wide.
    """

    cfg: ModelConfig
    kernels: str = "auto"  # see kimik3.ops

    @nn.compact
    def __call__(self, x_btd, positions_bt, cache: MLALatent | MLAPages | None = None, *, valid_b=None):
        cfg = self.cfg
        d, h, r = x_btd.shape[-1], cfg.mla_heads, cfg.kv_lora_rank
        p = lambda name, shape, fan_in: qparam(self, name, fan_in_init(fan_in), shape)
        w = {}
        if self.has_variable("params", "w_in_dx"):  # `kimik3.fused`: the projections of x as one GEMM
            w["w_in_dx"] = p("w_in_dx", (d, sum(input_widths(cfg))), d)
        if cfg.q_lora_rank:
            if "w_in_dx" not in w:
                w["w_qa_dq"] = p("w_qa_dq", (d, cfg.q_lora_rank), d)
            w["q_norm"] = self.param("q_norm", nn.initializers.ones, (cfg.q_lora_rank,))
            w["w_qb_qhk"] = p("w_qb_qhk", (cfg.q_lora_rank, h, cfg.mla_qk_dim), cfg.q_lora_rank)
        elif "w_in_dx" not in w:
            w["w_q_dhk"] = p("w_q_dhk", (d, h, cfg.mla_qk_dim), d)
        if "w_in_dx" not in w:
            w["w_kva_dr"] = p("w_kva_dr", (d, cfg.mla_latent_dim), d)
        w["kv_norm"] = self.param("kv_norm", nn.initializers.ones, (r,))
        w_kb = p("w_kb_rhn", (r, h, cfg.qk_nope_dim), r)
        w_vb = p("w_vb_rhv", (r, h, cfg.v_head_dim), r)
        if "w_in_dx" not in w and cfg.mla_output_gate:
            w["w_gate_dhv"] = p("w_gate_dhv", (d, h, cfg.v_head_dim), d)
        w["w_o_hvd"] = p("w_o_hvd", (h, cfg.v_head_dim, cfg.d_model), h * cfg.v_head_dim)

        q, latent_new, xg = mla_project(cfg, w, x_btd, self.kernels)
        t = x_btd.shape[1]
        paged = None
        match cache:
            case None:
                latent, k_pos, new_cache, absorbed = latent_new, positions_bt, None, False
            case MLAPages():
                pages = write_latent(cache.pages, latent_new, cache.block_tables, positions_bt, valid_b)
                new_cache = MLAPages(pages, cache.block_tables)
                paged = (pages, cache.block_tables)
                latent = gather_pages(pages, cache.block_tables)
            case MLALatent():
                latent = write_rows(cache.latent, latent_new, positions_bt[:, 0])
                new_cache = MLALatent(latent)
            case _:
                raise TypeError(f"an MLA layer's cache is an MLALatent or MLAPages; got {type(cache).__name__}")
        if cache is not None:
            k_pos = jnp.broadcast_to(jnp.arange(latent.shape[1])[None], latent.shape[:2])
            absorbed = t <= cfg.mla_absorb_max_tokens
        o = ops.mla_attention(
            q,
            latent.astype(q.dtype),
            w_kb,
            w_vb,
            kv_lora=r,
            scale=cfg.mla_qk_dim**-0.5,
            q_pos_bt=positions_bt,
            k_pos_bs=k_pos,
            absorbed=absorbed,
            contiguous_cache=cache is not None,
            paged=paged,
            kernels=self.kernels,
        )
        return mla_output(w, o, xg, x_btd.dtype, self.kernels), new_cache
