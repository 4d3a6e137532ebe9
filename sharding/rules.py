"""Logical axes: what each dimension of a param or cache leaf *means*, and how a
mode (prefill or decode) maps those meanings onto mesh axes.

Every mesh here has the same two axes, ``(REPLICA, EXPERT)`` (see
`sharding.mesh`):

* prefill: the whole mesh is the tensor-parallel group (attention heads) and
  the sequence-parallel group (token shards between the layers); experts are
  split over ``EXPERT`` and copied over ``REPLICA``;
* decode: the whole mesh is the data-parallel group (requests, with their KV
  and KDA state); experts again over ``EXPERT``.

Params carry their logical axes by name (`PARAM_AXES`, first regex match wins);
`param_specs` turns them into `PartitionSpec`s through a `Rules` table.  A
param that no rule names is an error, so a new layer cannot silently end up
replicated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

REPLICA = "replica"
EXPERT = "expert"
MESH_AXES = (REPLICA, EXPERT)
ALL = MESH_AXES  # the whole mesh as one (flattened) axis: rank = replica * ep + expert


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis name -> mesh axis (a name, a tuple of names, or None = replicated)."""

    name: str
    table: tuple[tuple[str, Any], ...]

    def mesh_axes(self, logical: str | None):
        if logical is None:
            return None
        return dict(self.table).get(logical)

    def spec(self, logical_axes: tuple[str | None, ...]) -> P:
        """PartitionSpec of a leaf whose dims have these logical names."""
        return P(*(self.mesh_axes(a) for a in logical_axes))


# Logical names: batch, seq (tokens of a span), cache_len (rows of the MLA cache), embed (d_model),
# heads (KDA and MLA heads; also the flattened heads*dim conv channels, head-major), head_dim,
# kv_latent (MLA c_kv ++ k_pe and the q-LoRA rank), rank (KDA low-rank gate projections),
# experts, latent (LatentMoE latent width), expert_mlp, mlp (dense / shared FFN width),
# vocab, router (expert scores: every rank routes over all experts), conv (conv taps), vit.
PREFILL_RULES = Rules(
    "prefill",
    (
        ("batch", None),
        ("seq", ALL),
        ("heads", ALL),
        ("experts", EXPERT),
    ),
)
DECODE_RULES = Rules(
    "decode",
    (
        ("batch", ALL),
        ("seq", None),
        ("heads", None),
        ("experts", EXPERT),
    ),
)
RULES = {"prefill": PREFILL_RULES, "decode": DECODE_RULES}

# (regex over the param path "layer_3/mla/w_kb_rhn", logical axes); first match wins.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"^vit/", ()),  # the vision encoder is small and runs replicated (an empty tuple: all dims None)
    (r"^embed_vd$", ("vocab", "embed")),
    (r"^lm_head_dv$", ("embed", "vocab")),
    (r"(norm|scale|norm_l|norm_v)$", (None,)),  # every norm weight: replicated
    # KDA
    (r"kda/w_(q|k)_dhk$", ("embed", "heads", "head_dim")),
    (r"kda/w_v_dhv$", ("embed", "heads", "head_dim")),
    (r"kda/conv_[qkv]_wc$", ("conv", "heads")),
    (r"kda/w_(fa|ga)_dr$", ("embed", "rank")),
    (r"kda/w_(fb_rhk|gb_rhv)$", ("rank", "heads", "head_dim")),
    (r"kda/dt_bias_hk$", ("heads", "head_dim")),
    (r"kda/a_log_h$", ("heads",)),
    (r"kda/w_beta_dh$", ("embed", "heads")),
    (r"kda/w_o_hvd$", ("heads", "head_dim", "embed")),
    # MLA
    (r"mla/w_qa_dq$", ("embed", "kv_latent")),
    (r"mla/w_qb_qhk$", ("kv_latent", "heads", "head_dim")),
    (r"mla/w_q_dhk$", ("embed", "heads", "head_dim")),
    (r"mla/w_kva_dr$", ("embed", "kv_latent")),
    (r"mla/w_(kb_rhn|vb_rhv)$", ("kv_latent", "heads", "head_dim")),
    (r"mla/w_gate_dhv$", ("embed", "heads", "head_dim")),
    (r"mla/w_o_hvd$", ("heads", "head_dim", "embed")),
    # LatentMoE
    (r"moe/w_router_de$", ("embed", "router")),
    (r"moe/router_bias_e$", ("router",)),
    (r"moe/w_down_dl$", ("embed", "latent")),
    (r"moe/w_(gate|up)_elf$", ("experts", "latent", "expert_mlp")),
    (r"moe/w_out_efl$", ("experts", "expert_mlp", "latent")),
    (r"moe/w_up_ld$", ("latent", "embed")),
    # dense MLP (layer 0) and the shared experts
    (r"(mlp|shared)/w_(gate|up)_df$", ("embed", "mlp")),
    (r"(mlp|shared)/w_out_fd$", ("mlp", "embed")),
)

# Cache leaves (kimik3.model.init_cache layout), by key or entry field (`kimik3.caches`).
CACHE_AXES = {
    "lengths": ("batch",),
    "state": ("batch", "heads", "head_dim", "head_dim"),
    "conv": ("batch", "conv", None, "heads"),  # [B, W-1, q|k|v, H*D]
    "latent": ("batch", "cache_len", "kv_latent"),
}


def path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def logical_axes_of(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the param at `path` (a "/"-joined path) with `ndim` dims."""
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path):
            axes = axes or (None,) * ndim
            if len(axes) != ndim:
                raise ValueError(f"param {path!r} has {ndim} dims but its rule {pattern!r} names {len(axes)}")
            return axes
    raise ValueError(f"no logical-axis rule for param {path!r}; add one to sharding.rules.PARAM_AXES")


def param_logical_axes(params) -> Any:
    """Tree like `params` of logical-axis tuples."""
    return jax.tree_util.tree_map_with_path(lambda p, x: logical_axes_of(path_str(p), x.ndim), params)


def param_specs(params, rules: Rules) -> Any:
    """Tree like `params` of PartitionSpecs under `rules`."""
    return jax.tree_util.tree_map_with_path(lambda p, x: rules.spec(logical_axes_of(path_str(p), x.ndim)), params)


def cache_specs(cache, rules: Rules) -> Any:
    """Tree like a contiguous cache (`kimik3.model.init_cache`) of PartitionSpecs."""

    def spec(path, x):
        last = path[-1]  # a dict key ("lengths") or a cache entry's field (`kimik3.caches.KDAState.state`)
        return rules.spec(CACHE_AXES[last.name if isinstance(last, jax.tree_util.GetAttrKey) else last.key])

    return jax.tree_util.tree_map_with_path(spec, cache)


def named(mesh: Mesh, specs) -> Any:
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def shard_params(params, mesh: Mesh, rules: Rules):
    """Place params on `mesh` as `rules` say (each device receives only its shard)."""
    return jax.device_put(params, named(mesh, param_specs(params, rules)))


def shard_cache(cache, mesh: Mesh, rules: Rules):
    """Place a contiguous cache on `mesh` (also the prefill -> decode handoff: a reshard)."""
    return jax.device_put(cache, named(mesh, cache_specs(cache, rules)))
