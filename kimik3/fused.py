"""The serving layout of the params: projections that read the same input as one GEMM.

`fuse_projections(params, cfg)` (`fuse_layer` over every block) rewrites the checkpoint layout
(`kimik3.model.init_params`, what checkpoints, sharding rules and quantization manifests name)
once, at load:

* KDA: q, k, v, the gate's f_a, beta and the output gate's g_a -> ``kda/w_in_dx`` [D, 3HK + K + H + K],
  and the two gates' low-rank up-projections -> ``kda/w_fg_srn`` [2, K, H*K] (one batched GEMM);
* MLA: q (or its LoRA-down), the kv latent and the output gate (where there is one) -> ``mla/w_in_dx``;
* MoE: the latent down-projection (where there is a latent) and the shared experts' gate and up -> ``moe/w_in_dx``
  (the shared experts' out -> ``moe/w_shared_out_fd``), each routed expert's gate and up ->
  ``moe/w_gateup_elf`` [E, L, 2F] (one grouped GEMM).

The layers take either layout (they look for ``w_in_dx``) and compute the same math: a decode
step of `small` launches one GEMM where it launched up to six, per layer.  Quantized members
(`kimik3.quant.formats.QTensor`, in their GEMM form) fuse by `formats.concat`: each member keeps
its own bits and scale blocks, so the fused GEMM's columns are the members' GEMMs bit for bit.  The fp32 router
stays apart (its own dtype and precision).  Sharded steps keep the checkpoint layout (their
rules shard heads; a fused matrix would interleave them).
"""

from __future__ import annotations

import jax.numpy as jnp

from kimik3.config import ModelConfig
from kimik3.quant import formats as qformats


def is_fused(params) -> bool:
    return any(
        "w_in_dx" in layer.get(kind, {})
        for name, layer in params.items()
        if name.startswith("layer_")
        for kind in ("kda", "mla", "moe")
    )


def _cat(*ws):
    """Members [K, ...] as one [K, sum N_i] GEMM weight (quantized members: all or none)."""
    quantized = [isinstance(w, qformats.QTensor) for w in ws]
    if any(quantized):
        if not all(quantized):
            raise ValueError(
                "a fused projection group is quantized whole or not at all; got "
                f"{[getattr(w, 'fmt', 'array') for w in ws]}"
            )
        return qformats.concat(ws)
    return jnp.concatenate([w.reshape(w.shape[0], -1) for w in ws], axis=-1)


def fuse_layer(layer: dict) -> dict:
    """One block's params (``params["layer_i"]``: its "kda" or "mla" mixer, its "moe" or dense
    FFN, its norms) in the serving layout (the module comment); a fused block comes back as is.
    The arrays are new: callers drop the checkpoint-layout block to free its memory."""
    if any("w_in_dx" in layer.get(kind, {}) for kind in ("kda", "mla", "moe")):
        return layer
    layer = dict(layer)
    if "kda" in layer:
        p = dict(layer["kda"])
        names = ("w_q_dhk", "w_k_dhk", "w_v_dhv", "w_fa_dr", "w_beta_dh", "w_ga_dr")
        p["w_in_dx"] = _cat(*(p.pop(n) for n in names))
        p["w_fg_srn"] = jnp.stack([_cat(p.pop("w_fb_rhk")), _cat(p.pop("w_gb_rhv"))])  # [2, R, H*K]
        layer["kda"] = p
    if "mla" in layer:
        p = dict(layer["mla"])
        q = "w_qa_dq" if "w_qa_dq" in p else "w_q_dhk"
        p["w_in_dx"] = _cat(*(p.pop(n) for n in (q, "w_kva_dr", "w_gate_dhv") if n in p))
        layer["mla"] = p
    if "moe" in layer:
        p = dict(layer["moe"])
        ins = [p.pop("w_down_dl")] if "w_down_dl" in p else []  # none without a latent (`moe_latent`)
        if "shared" in p:
            shared = p.pop("shared")
            ins += [shared["w_gate_df"], shared["w_up_df"]]
            p["w_shared_out_fd"] = shared["w_out_fd"]
        if ins:
            p["w_in_dx"] = _cat(*ins)
        gate, up = p.pop("w_gate_elf"), p.pop("w_up_elf")
        p["w_gateup_elf"] = (
            qformats.concat([gate, up]) if isinstance(gate, qformats.QTensor) else jnp.concatenate([gate, up], axis=-1)
        )
        layer["moe"] = p
    return layer


def fuse_projections(params, cfg: ModelConfig):
    """params in the serving layout (see the module comment): `fuse_layer` of every block; a
    fused tree comes back as is.  The arrays are new: callers drop the checkpoint-layout tree to
    free its memory."""
    if is_fused(params):
        return params
    out = dict(params)
    for i in range(cfg.n_layers):
        out[f"layer_{i}"] = fuse_layer(params[f"layer_{i}"])
    return out
