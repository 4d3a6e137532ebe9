"""The caches the forward threads through its layers: typed per-layer entries, and the same
containers for scanned layers.

A layer's cache entry is one of four frozen dataclasses (pytrees), and a mixer picks its path by
the entry's type:

* `KDAState`: a KDA layer's rows, one per sequence (the contiguous cache);
* `KDASlots`: a KDA layer's view of the state pools, read and written by slot (the paged cache);
* `MLALatent`: an MLA layer's latent rows, one row block per sequence (the contiguous cache);
* `MLAPages`: an MLA layer's view of the latent pages through block tables (the paged cache).

What a call asks for beside the cache (the positions whose KDA states it exports, the real
tokens of each row) are arguments of the forward and the layers; what it exports comes back
as a return value (`KDAState` rows with an exports axis), never inside a cache.

Each block reads its layer's entry with ``caches.get(cfg, layer, period)`` and hands back what
it wrote with ``caches.put(cfg, layer, period, new)``.  ``layer`` is static (it fixes the
mixer's kind); ``period`` is None for an unrolled layer, or the traced index of the scanned
period (`kimik3.stacked`) that `layer` stands for, so one traced block serves every period.

* `LayerCaches` (the contiguous cache, one entry per layer): while the scanned periods run,
  their entries are stacked per period position (`stack`), read and written by index, and
  unstacked after (`unstack`).
* `PagedPools` (the paged pools viewed by a batch): one pool per kind for every layer, so a
  layer (scanned or not) reads and writes its rows in place by offset: KDA layer k's slot s is
  row ``k * num_slots + s``; MLA layer m's page p is page ``m * num_pages + p``.  The pools
  themselves stay the serving engine's dicts::

      kda: {"state": f32 [n_kda * S, H, K, V], "conv": [n_kda * S, W-1, 3, H*D]}
      mla: {"pages": [n_mla * P, page_tokens, kv_lora + rope]}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kimik3 import stacked
from kimik3.config import ATTENTION_PERIOD, ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDAState:
    """A KDA layer's contiguous entry: state f32 [B, H, K, V] (the recurrence) and conv
    [B, W-1, 3, H*D] (the q, k, v short convs' last W-1 inputs, one array: one gather and one
    scatter per layer when a decode step reads it by slot).

    A pass's exports have this type too, with an exports axis after the batch: state
    [B, E, H, K, V], conv [B, E, W-1, 3, H*D] (`kimik3.layers.kda.KDA`)."""

    state: jax.Array
    conv: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDASlots:
    """A KDA layer's view of state pools: state f32 [S, H, K, V] and conv [S, W-1, 3, H*D] hold
    a row per slot, and sequence b reads and writes row slots[b] (slots int32 [B]).  Sequences
    may share a slot only if its contents are scratch (a decode batch's padding rows)."""

    state: jax.Array
    conv: jax.Array
    slots: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLALatent:
    """An MLA layer's contiguous entry: latent [B, S, kv_lora + rope], row s of sequence b the
    latent of its token at position s."""

    latent: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAPages:
    """An MLA layer's view of latent pages: pages [P, page_tokens, kv_lora + rope] and
    block_tables int32 [B, max_pages]: position s of sequence b lives in page
    block_tables[b, s // page_tokens], row s % page_tokens."""

    pages: jax.Array
    block_tables: jax.Array


# A layer's cache entry, whichever its kind and layout.
LayerEntry = KDAState | KDASlots | MLALatent | MLAPages


def is_paged(cache) -> bool:
    """Whether a cache dict is a paged view (`kimik3.model.paged_view`) rather than a contiguous
    cache (`kimik3.model.init_cache`): the one place the two outer layouts are told apart."""
    return cache is not None and "block_tables" in cache


def kind_index(cfg: ModelConfig, layer: int) -> int:
    """Layer `layer`'s index among the layers of its mixer kind."""
    kind = cfg.mixer_kind(layer)
    return sum(1 for i in range(layer) if cfg.mixer_kind(i) == kind)


def pool_offsets(cfg: ModelConfig, pools) -> tuple[int, int]:
    """(num_slots, num_pages): the rows of one KDA layer and the pages of one MLA layer in the
    pools (or a paged view; anything with "kda" and "mla"): KDA layer k's slot s is row
    k * num_slots + s, MLA layer m's page p is m * num_pages + p."""
    n_kda, n_mla = cfg.mixer_kinds.count("kda"), cfg.mixer_kinds.count("mla")
    return pools["kda"]["state"].shape[0] // max(n_kda, 1), pools["mla"]["pages"].shape[0] // max(n_mla, 1)


def per_period(cfg: ModelConfig, layer: int) -> int:
    """Layers of `layer`'s mixer kind in one scanned period (the stride of its kind index per
    period; every scanned period repeats the first one's mixers: `kimik3.stacked.scan_layout`)."""
    first = stacked.scan_layout(cfg)[0]
    return sum(1 for j in range(ATTENTION_PERIOD) if cfg.mixer_kind(first + j) == cfg.mixer_kind(layer))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCaches:
    """The contiguous cache's per-layer entries (`kimik3.model.init_cache`): `get` gives a
    layer's `KDAState` or `MLALatent`, `put` takes the one it wrote."""

    layers: tuple  # per layer its KDAState or MLALatent; None where `periods` holds it
    periods: Any = None  # while scanning: per period position j, layer first + i*P + j stacked on i
    first: int = dataclasses.field(default=0, metadata=dict(static=True))

    def stack(self, first: int, n: int) -> "LayerCaches":
        periods = stacked.stack_positions(lambda l: self.layers[l], first, n)
        layers = tuple(None if first <= l < first + n * ATTENTION_PERIOD else c for l, c in enumerate(self.layers))
        return LayerCaches(layers, periods, first)

    def unstack(self, n: int) -> "LayerCaches":
        layers = stacked.unstack_positions(self.periods, self.first, n)
        return LayerCaches(tuple(layers.get(l, c) for l, c in enumerate(self.layers)))

    def get(self, cfg, layer, period) -> KDAState | MLALatent:
        if period is None:
            return self.layers[layer]
        return jax.tree_util.tree_map(lambda x: x[period], self.periods[layer - self.first])

    def put(self, cfg, layer, period, new: KDAState | MLALatent) -> "LayerCaches":
        if period is None:
            return dataclasses.replace(self, layers=self.layers[:layer] + (new,) + self.layers[layer + 1 :])
        j = layer - self.first
        rows = jax.tree_util.tree_map(lambda s, x: s.at[period].set(x), self.periods[j], new)
        return dataclasses.replace(self, periods=self.periods[:j] + (rows,) + self.periods[j + 1 :])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedPools:
    """A batch's view of the paged pools (see the module comment): kda and mla the pool dicts,
    slots int32 [B] (layer-0 slot ids), block_tables int32 [B, max_pages] (layer-0 page ids).
    `get` gives a layer's `KDASlots` or `MLAPages` (ids offset to its rows), `put` takes the one
    it wrote."""

    kda: dict
    mla: dict
    slots: jax.Array
    block_tables: jax.Array

    def _index(self, cfg, layer, period):
        k = kind_index(cfg, layer)
        return k if period is None else k + period * per_period(cfg, layer)

    def get(self, cfg, layer, period) -> KDASlots | MLAPages:
        k = self._index(cfg, layer, period)
        num_slots, num_pages = pool_offsets(cfg, {"kda": self.kda, "mla": self.mla})
        if cfg.mixer_kind(layer) == "kda":
            return KDASlots(self.kda["state"], self.kda["conv"], self.slots + k * num_slots)
        return MLAPages(self.mla["pages"], self.block_tables + k * num_pages)

    def put(self, cfg, layer, period, new: KDASlots | MLAPages) -> "PagedPools":
        match new:
            case KDASlots():
                return dataclasses.replace(self, kda={"state": new.state, "conv": new.conv})
            case MLAPages():
                return dataclasses.replace(self, mla={"pages": new.pages})
        raise TypeError(f"a paged layer writes KDASlots or MLAPages; got {type(new).__name__}")
