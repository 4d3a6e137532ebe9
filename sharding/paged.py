"""Sharded prefill over paged pools: the serving engine's bridge to `ShardedPrefill`.

The serving engine keeps its KV in pools shared by all its requests
(`kimik3.model.init_paged_cache`): MLA latent *pages* ``[num_pages, page, R]``
addressed through block tables, and KDA state *slots* ``[num_slots, ...]``.
The sharded classes take the contiguous per-request cache of
`kimik3.model.init_cache`.  `PagedStep` runs one sharded step over the pools::

    view  = model.paged_view(pools, tables [B, P], slots [B], lengths [B])
    cache = contiguous_cache(cfg, view)       on the pools' device; init_cache layout:
              MLA layer: MLALatent(latent=[B, P * page, R])   each request's pages, in table order
              KDA layer: KDAState(state=f32 [B, H, K, V], conv=[B, W-1, 3, H*D])   its slot's rows
              "lengths": int32 [B]
    cache = sharded.place_cache(cache)        onto the mesh (prefill: heads split, latent
                                              replicated; decode: requests split over dp)
    logits, cache = sharded.run(params, tokens [B, T], cache)
    delta = new_entries(cfg, cache, T)        on the mesh: per MLA layer the T new latent rows
                                              (MLALatent [B, T, R]); per KDA layer its KDAState
    pools = write_back(cfg, view, delta)      on the pools' device: latent rows into their pages
                                              at lengths + arange(T), KDA rows into their slots

Rows whose slot is the engine's scratch slot and whose table is all null pages
(the padding rows of a decode batch) read and write only those, exactly as in
the unsharded paged path.

The pools are those of the request's rank (one device): a TP prefill chunk
moves its request's rows from there onto the prefill mesh and its new rows back,
device to device, so the KV lands where the decode side reads it.  The rows moved
are the whole ``max_pages * page`` width of the tables, not just the filled part.

Decode does not come here: under DP each rank owns its pools and the decode step
runs on them in place (`sharding.decode.PagedDecode`, `sharding.rank_pools`).
"""

from __future__ import annotations

import collections
import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kimik3 import model
from kimik3.caches import KDAState, MLALatent, kind_index
from kimik3.config import ModelConfig

# The MLA layer's own paged read / write (pallas_kernels.mla, re-exported where the layer uses them).
from kimik3.layers.mla import gather_pages, write_latent
from sharding.decode import ShardedDecode
from sharding.prefill import ShardedPrefill

log = logging.getLogger(__name__)

MODES = ("prefill",)  # decode over paged pools: sharding.decode.PagedDecode, on the ranks' own pools


@functools.partial(jax.jit, static_argnames=("cfg",))
def contiguous_cache(view, *, cfg: ModelConfig):
    """A paged view (`model.paged_view`) -> the contiguous cache of its B rows (`init_cache` layout).

    Per MLA layer an `MLALatent` [B, max_pages * page, R] (the rows of each row's pages, in
    block-table order), per KDA layer a `KDAState` of each row's slot; lengths [B]."""
    tables, slots = view["block_tables"], view["slots"]
    num_slots, num_pages = model.pool_offsets(cfg, view)
    pools, pages = view["kda"], view["mla"]["pages"]
    kda = lambda rows: KDAState(pools["state"][rows], pools["conv"][rows])
    layers = tuple(
        kda(slots + kind_index(cfg, i) * num_slots)
        if kind == "kda"
        else MLALatent(gather_pages(pages, tables + kind_index(cfg, i) * num_pages))
        for i, kind in enumerate(cfg.mixer_kinds)
    )
    return {"lengths": view["lengths"], "layers": layers}


@functools.partial(jax.jit, static_argnames=("cfg", "t"))
def new_entries(cache, *, cfg: ModelConfig, t: int):
    """What a step of `t` tokens added to a contiguous cache (whose lengths already count them):
    per MLA layer an `MLALatent` of the t new rows [B, t, R] (the latent rows at old lengths +
    arange(t)); per KDA layer its whole `KDAState` (replaced, not appended)."""
    start = cache["lengths"] - t
    take = jax.vmap(lambda lat, s: jax.lax.dynamic_slice_in_dim(lat, s, t, axis=0))
    return tuple(
        layer if isinstance(layer, KDAState) else MLALatent(take(layer.latent, start)) for layer in cache["layers"]
    )


@functools.partial(jax.jit, static_argnames=("cfg",))
def write_back(view, delta, *, cfg: ModelConfig):
    """Write `new_entries` into the pools of a paged view: latent rows (`MLALatent` [B, t, R]) into
    the pages at positions lengths + arange(t) (through the block tables), KDA rows (`KDAState`)
    into their slots.  Returns the new pools (`kimik3.model.init_paged_cache`'s layout)."""
    t = next((d.latent.shape[1] for d in delta if isinstance(d, MLALatent)), 0)
    positions = view["lengths"][:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    num_slots, num_pages = model.pool_offsets(cfg, view)
    kda, pages = dict(view["kda"]), view["mla"]["pages"]
    for i, new in enumerate(delta):
        k = kind_index(cfg, i)
        match new:
            case KDAState():
                rows = view["slots"] + k * num_slots
                kda = {
                    "state": kda["state"].at[rows].set(new.state.astype(kda["state"].dtype)),
                    "conv": kda["conv"].at[rows].set(new.conv.astype(kda["conv"].dtype)),
                }
            case MLALatent():
                pages = write_latent(pages, new.latent, view["block_tables"] + k * num_pages, positions)
    return {"kda": kda, "mla": {"pages": pages}}


def helper_programs() -> int:
    """Compiled programs so far of `contiguous_cache`, `new_entries` and `write_back` (all meshes)."""
    return sum(f._cache_size() for f in (contiguous_cache, new_entries, write_back))


@functools.lru_cache(maxsize=32)
def sharded_step(
    cfg: ModelConfig, mesh: Mesh, mode: str, dispatch: str = "auto", kernels: str = "auto"
) -> ShardedPrefill | ShardedDecode:
    """The `ShardedPrefill` (mode 'prefill') or `ShardedDecode` ('decode') of `cfg` on `mesh`, one
    per (cfg, mesh, mode, dispatch, kernels): engines on the same mesh share its compiled programs."""
    if mode not in MODES:
        raise ValueError(
            f"mode must be one of {MODES}; got {mode!r} (decode over paged pools runs on the "
            f"ranks' own pools: sharding.decode.PagedDecode)"
        )
    cls = ShardedPrefill if mode == "prefill" else ShardedDecode
    return cls(cfg, mesh, dispatch=dispatch, kernels=kernels)


class PagedStep:
    """One sharded prefill or decode step of `cfg` on `mesh`, over paged pools.

    ``PagedStep(cfg, mesh, "prefill" | "decode")(params, pools, tokens [B, T], tables [B, P],
    slots [B], lengths [B])`` -> (logits f32 [B, T, V] on the mesh, new pools on the pools'
    device).  ``params`` must come from `place_params`.  Prefill: T a multiple of tp; decode:
    B a multiple of dp.  Raises ValueError for a mesh that does not fit `cfg` (at construction).
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh, mode: str, *, dispatch: str = "auto", kernels: str = "auto"):
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"{mode} mesh must be a jax.sharding.Mesh (sharding.mesh.{mode}_mesh); got {type(mesh).__name__}"
            )
        self.cfg, self.mesh, self.mode = cfg, mesh, mode
        self.sharded = sharded_step(cfg, mesh, mode, dispatch, kernels)
        self.shape = self.sharded.shape
        self.size = self.shape.size  # tp (prefill) or dp (decode)
        self.calls: collections.Counter[tuple[int, int]] = collections.Counter()  # this step's runs by (B, T)

    def place_params(self, params):
        return self.sharded.place_params(params)

    def programs(self) -> int:
        """Compiled programs so far of the sharded model step (shared by all PagedSteps of the same
        cfg and mesh; the gather / write-back programs are counted by `helper_programs`)."""
        return self.sharded._jitted._cache_size()

    def check(self, batch: int, t: int) -> None:
        if self.mode == "prefill" and t % self.size:
            raise ValueError(f"prefill span of {t} tokens is not a multiple of tp={self.size}")
        if self.mode == "decode" and batch % self.size:
            raise ValueError(f"decode batch of {batch} rows is not a multiple of dp={self.size}")

    def __call__(self, params, pools, tokens, tables, slots, lengths):
        """Run the step.  Keep the pools committed to their device (`jax.device_put`): the new
        rows come back committed there, and the gather / write-back programs are compiled per
        placement, so uncommitted pools would compile them twice."""
        tokens = jnp.asarray(tokens, jnp.int32)
        b, t = tokens.shape
        self.check(b, t)
        self.calls[b, t] += 1
        view = model.paged_view(pools, tables, slots, lengths)
        cache = self.sharded.place_cache(contiguous_cache(view, cfg=self.cfg))
        logits, cache = self.sharded.run(params, tokens, cache)
        home = jax.tree_util.tree_leaves(pools)[0].sharding
        delta = jax.device_put(new_entries(cache, cfg=self.cfg, t=t), home)
        return logits, write_back(view, delta, cfg=self.cfg)


__all__ = ["PagedStep", "contiguous_cache", "new_entries", "write_back", "sharded_step", "helper_programs"]
