"""The engine's device pools and the block stores the cache manager reads and writes through.

`KVPools` owns, on the device:

* the paged pools (`kimik3.model.init_paged_cache`): MLA latent pages shared by every
  request (block ids = the manager's page ids) and KDA state rows, one slot per running
  request plus a scratch slot for a decode batch's padding rows;
* the KDA snapshot pool (the manager's snapshot blocks): every KDA layer's state and conv
  rows of one request at one boundary, packed in one fp32 vector of `snapshot_size`;

and moves state between them (a slot <-> a snapshot block; exports of a prefill pass ->
a snapshot block).  Writes are in place (`set_rows` donates the pool).  Layout only: no
scheduling, no model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import model
from kimik3.config import ModelConfig


# Bumped whenever a page's or a snapshot's byte layout changes (2: the KDA conv rows as one
# [W-1, 3, H*D] entry): cache keys carry it, so blocks stored by an older layout are misses.
LAYOUT_VERSION = 2


@functools.partial(jax.jit, donate_argnums=(0,))
def set_rows(pool, index, rows):
    """pool.at[index].set(rows), in place: the pool is donated (an eager `.at[].set` copies
    the whole pool, e.g. every snapshot block to write one).  Callers keep the result."""
    return pool.at[index].set(rows.astype(pool.dtype))


# The moves below are one program each over every layer: run eagerly, layer by layer and key by
# key, a KDA slot <-> snapshot move of `small` was ~50 dispatches (~28 ms on an H200, more than
# a prefill chunk), paid at every admission and snapshot.


def _pack(rows_per_layer):
    """One fp32 vector from each KDA layer's {key: rows}: layer order, then sorted keys (the order
    `_restore_slot` unpacks and `KVPools.kda_keys` sizes)."""
    return jnp.concatenate([layer[k].astype(jnp.float32).reshape(-1) for layer in rows_per_layer
                            for k in sorted(layer)])


def _slot_packed(kda_pools, slot):
    return _pack([{k: v[slot] for k, v in layer.items()} for layer in kda_pools])


@functools.partial(jax.jit, donate_argnums=(0,))
def _restore_slot(kda_pools, slot, packed):
    """Every KDA layer's rows of `slot` from one packed vector (pools donated: written in place)."""
    out, off = [], 0
    for layer in kda_pools:
        new = {}
        for k in sorted(layer):
            shape = layer[k].shape[1:]
            n = int(np.prod(shape))
            new[k] = layer[k].at[slot].set(packed[off:off + n].reshape(shape).astype(layer[k].dtype))
            off += n
        out.append(new)
    return tuple(out)


@functools.partial(jax.jit, donate_argnums=(0,))
def _save_slot(snapshots, block, kda_pools, slot):
    """snapshots[block] = every KDA layer's rows of `slot`, packed (snapshots donated)."""
    return snapshots.at[block].set(_slot_packed(kda_pools, slot))


@functools.partial(jax.jit, donate_argnums=(0,))
def _save_export(snapshots, block, exports, index):
    """snapshots[block] = the entries a prefill pass exported at its `index`-th position, packed."""
    return snapshots.at[block].set(_pack([{k: v[0, index] for k, v in layer.items()} for layer in exports]))


_slot_rows = jax.jit(_slot_packed)


@jax.jit
def _read_pages(mla_pools, index):
    """[n, n_mla, page, D] fp32: pages `index` of every MLA layer, in one gather."""
    return jnp.stack([layer[index].astype(jnp.float32) for layer in mla_pools], 1)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_pages(mla_pools, index, data):
    """Pages `index` of every MLA layer from data [n, n_mla, page, D] (pools donated)."""
    return tuple(layer.at[index].set(data[:, k].astype(layer.dtype)) for k, layer in enumerate(mla_pools))


def bytes_per_page(cfg: ModelConfig, page_tokens: int, dtype) -> int:
    """One MLA page: page_tokens latent rows in every MLA layer."""
    return cfg.mixer_kinds.count("mla") * page_tokens * cfg.mla_latent_dim * jnp.dtype(dtype).itemsize


def bytes_per_state(cfg: ModelConfig, dtype) -> int:
    """One KDA state row (a running request's slot, or a snapshot): fp32 state + conv rows, all KDA layers."""
    h, d, w = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size
    per_layer = h * d * d * 4 + 3 * (w - 1) * h * d * jnp.dtype(dtype).itemsize
    return cfg.mixer_kinds.count("kda") * per_layer


class MLAPageStore:
    """BlockStore over the MLA page pools: one block = [n_mla_layers, page, D] (host copies in fp32
    for bf16 pools: numpy has no bf16)."""

    def __init__(self, kv: "KVPools"):
        self.kv = kv
        self.block_shape = (len(kv.mla_layers), kv.page_tokens, kv.cfg.mla_latent_dim)
        self.dtype = np.dtype(jnp.dtype(kv.dtype).name if kv.dtype != jnp.bfloat16 else "float32")

    def read(self, blocks):
        stacked = np.asarray(_read_pages(self.kv.mla_pools(), jnp.asarray(blocks, jnp.int32)))
        return [stacked[j].astype(self.dtype) for j in range(len(blocks))]

    def write(self, blocks, arrays):
        pools = _write_pages(self.kv.mla_pools(), jnp.asarray(blocks, jnp.int32), jnp.asarray(np.stack(arrays)))
        self.kv.set_layers(self.kv.mla_layers, [{"pages": p} for p in pools])


class SnapshotStore:
    """BlockStore of KDA snapshots: every KDA layer's state and conv rows, packed in one vector."""

    def __init__(self, kv: "KVPools", num_blocks: int):
        self.block_shape = (kv.snapshot_size,)
        self.dtype = np.dtype(np.float32)
        self.data = jnp.zeros((num_blocks, kv.snapshot_size), jnp.float32)

    def read(self, blocks):
        return list(np.asarray(self.data[jnp.asarray(blocks, jnp.int32)]))

    def write(self, blocks, arrays):
        self.data = set_rows(self.data, jnp.asarray(blocks, jnp.int32), jnp.asarray(np.stack(arrays)))


class KVPools:
    """The paged pools, the snapshot pool and the moves between them (see the module comment)."""

    def __init__(self, cfg: ModelConfig, *, num_pages: int, num_slots: int, num_snapshots: int, page_tokens: int,
                 dtype, commit: bool = False):
        """commit: place the pools on the default device explicitly (sharded steps compile their
        gather / write-back programs per placement)."""
        self.cfg, self.dtype, self.page_tokens = cfg, dtype, page_tokens
        self.mla_layers = [i for i, k in enumerate(cfg.mixer_kinds) if k == "mla"]
        self.kda_layers = [i for i, k in enumerate(cfg.mixer_kinds) if k == "kda"]
        self.scratch_slot = num_slots  # the extra slot: padding rows of decode batches
        self.pools = model.init_paged_cache(cfg, num_pages, num_slots + 1, page_tokens, dtype)
        if commit:
            self.pools = jax.device_put(self.pools, next(iter(jax.tree_util.tree_leaves(self.pools)[0].devices())))
        kda0 = self.pools["layers"][self.kda_layers[0]] if self.kda_layers else {}
        self.kda_keys = sorted(kda0)
        self.snapshot_size = sum(int(np.prod(kda0[k].shape[1:])) for k in self.kda_keys) * len(self.kda_layers)
        self.pages = MLAPageStore(self)
        self.snapshots = SnapshotStore(self, num_snapshots)
        self._zeros = None  # a fresh request's packed state, made once

    # ---- the pools' layers by kind ------------------------------------------------------------------
    def kda_pools(self) -> tuple:
        return tuple(self.pools["layers"][i] for i in self.kda_layers)

    def mla_pools(self) -> tuple:
        return tuple(self.pools["layers"][i]["pages"] for i in self.mla_layers)

    def set_layers(self, indices, layers) -> None:
        """Replace the pools of layers `indices` (after a program that donated them)."""
        new = list(self.pools["layers"])
        for i, layer in zip(indices, layers):
            new[i] = layer
        self.pools = {"layers": tuple(new)}

    # ---- moves (one program each) -------------------------------------------------------------------
    def restore_state(self, slot: int, snapshot_block: int | None) -> None:
        """A slot's KDA rows from a snapshot block (zeros: no block, a fresh request)."""
        if snapshot_block is None:
            if self._zeros is None:
                self._zeros = jnp.zeros((self.snapshot_size,), jnp.float32)
            packed = self._zeros
        else:
            packed = self.snapshots.data[snapshot_block]
        self.set_layers(self.kda_layers, _restore_slot(self.kda_pools(), jnp.int32(slot), packed))

    def packed_state(self, slot: int):
        return _slot_rows(self.kda_pools(), jnp.int32(slot))

    def save_state(self, slot: int, snapshot_block: int) -> None:
        self.snapshots.data = _save_slot(self.snapshots.data, jnp.int32(snapshot_block), self.kda_pools(),
                                         jnp.int32(slot))

    def save_export(self, exports, index: int, snapshot_block: int) -> None:
        """Snapshot the KDA entries a prefill pass exported at its `index`-th export position
        (`kimik3.model.paged_view`'s exports; packed as `packed_state` packs a state row)."""
        self.snapshots.data = _save_export(self.snapshots.data, jnp.int32(snapshot_block), tuple(exports),
                                           jnp.int32(index))

    def write_snapshot(self, snapshot_block: int, packed: np.ndarray) -> None:
        self.snapshots.data = set_rows(self.snapshots.data, snapshot_block, jnp.asarray(packed))

    def read_kv(self, page_table: list[int], n_tokens: int, slot: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(contents of the pages holding the first `n_tokens` of a table, the slot's packed KDA state)."""
        return self.pages.read(page_table[:-(-n_tokens // self.page_tokens)]), np.asarray(self.packed_state(slot))
