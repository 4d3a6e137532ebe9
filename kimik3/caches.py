"""The caches the forward threads through its layers: typed, and the same for scanned layers.

Each block reads its layer's cache with ``caches.get(cfg, layer, period)`` and hands back what
it wrote with ``caches.put(cfg, layer, period, new)``.  ``layer`` is static (it fixes the
mixer's kind); ``period`` is None for an unrolled layer, or the traced index of the scanned
period (`kimik3.stacked`) that `layer` stands for, so one traced block serves every period.

* `LayerCaches` (the contiguous cache, one entry per layer): while the scanned periods run,
  their entries are stacked per period position (`stack`), read and written by index, and
  unstacked after (`unstack`).
* `PagedPools` (the paged pools viewed by a batch): one pool per kind for every layer, so a
  layer (scanned or not) reads and writes its rows in place by offset: KDA layer k's slot s is
  row ``k * num_slots + s``; MLA layer m's page p is page ``m * num_pages + p``::

      kda: {"state": f32 [n_kda * S, H, K, V], "conv": [n_kda * S, W-1, 3, H*D]}
      mla: {"pages": [n_mla * P, page_tokens, kv_lora + rope]}

A KDA layer's "exports" (the states a prefill pass snapshots) come out of `put`, not the cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kimik3 import stacked
from kimik3.config import ATTENTION_PERIOD, ModelConfig


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
    """The contiguous cache's per-layer entries (`kimik3.model.init_cache`)."""

    layers: tuple  # per layer: KDA {"state", "conv"}, MLA {"latent"}; None where `periods` holds it
    periods: Any = None  # while scanning: per period position j, layer first + i*P + j stacked on i
    first: int = dataclasses.field(default=0, metadata=dict(static=True))

    def stack(self, first: int, n: int) -> "LayerCaches":
        periods = stacked.stack_positions(lambda l: self.layers[l], first, n)
        layers = tuple(None if first <= l < first + n * ATTENTION_PERIOD else c for l, c in enumerate(self.layers))
        return LayerCaches(layers, periods, first)

    def unstack(self, n: int) -> "LayerCaches":
        layers = stacked.unstack_positions(self.periods, self.first, n)
        return LayerCaches(tuple(layers.get(l, c) for l, c in enumerate(self.layers)))

    def get(self, cfg, layer, period):
        if period is None:
            return self.layers[layer]
        return jax.tree_util.tree_map(lambda x: x[period], self.periods[layer - self.first])

    def put(self, cfg, layer, period, new):
        exports = new.get("exports")
        new = {k: v for k, v in new.items() if k != "exports"}
        if period is None:
            return dataclasses.replace(self, layers=self.layers[:layer] + (new,) + self.layers[layer + 1 :]), exports
        j = layer - self.first
        rows = jax.tree_util.tree_map(lambda s, x: s.at[period].set(x), self.periods[j], new)
        return dataclasses.replace(self, periods=self.periods[:j] + (rows,) + self.periods[j + 1 :]), exports


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedPools:
    """A batch's view of the paged pools (see the module comment): block_tables int32 [B, max_pages]
    (this layer-0 page ids), slots int32 [B] (layer-0 slot ids), and optionally export_at int32 [E]
    and valid int32 [B] (see `kimik3.model.paged_view`)."""

    kda: dict
    mla: dict
    slots: jax.Array
    block_tables: jax.Array
    export_at: Any = None
    valid: Any = None

    def _index(self, cfg, layer, period):
        k = kind_index(cfg, layer)
        return k if period is None else k + period * per_period(cfg, layer)

    def get(self, cfg, layer, period):
        k = self._index(cfg, layer, period)
        num_slots, num_pages = pool_offsets(cfg, {"kda": self.kda, "mla": self.mla})
        extra = {} if self.valid is None else {"valid": self.valid}
        if cfg.mixer_kind(layer) == "kda":
            if self.export_at is not None:
                extra["export_at"] = self.export_at
            return dict(self.kda, slots=self.slots + k * num_slots, **extra)
        return {"pages": self.mla["pages"], "block_tables": self.block_tables + k * num_pages, **extra}

    def put(self, cfg, layer, period, new):
        if cfg.mixer_kind(layer) == "kda":
            return dataclasses.replace(self, kda={k: new[k] for k in self.kda}), new.get("exports")
        return dataclasses.replace(self, mla={"pages": new["pages"]}), None
