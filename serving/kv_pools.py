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


@functools.partial(jax.jit, donate_argnums=(0,))
def set_rows(pool, index, rows):
    """pool.at[index].set(rows), in place: the pool is donated (an eager `.at[].set` copies
    the whole pool, e.g. every snapshot block to write one).  Callers keep the result."""
    return pool.at[index].set(rows.astype(pool.dtype))


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
        layers = self.kv.pools["layers"]
        idx = jnp.asarray(blocks, jnp.int32)
        stacked = np.stack([np.asarray(layers[i]["pages"][idx], np.float32) for i in self.kv.mla_layers], 1)
        return [stacked[j].astype(self.dtype) for j in range(len(blocks))]

    def write(self, blocks, arrays):
        idx = jnp.asarray(blocks, jnp.int32)
        data = np.stack(arrays)  # [n, n_mla, page, D]
        layers = list(self.kv.pools["layers"])
        for k, i in enumerate(self.kv.mla_layers):
            layers[i] = {"pages": set_rows(layers[i]["pages"], idx, jnp.asarray(data[:, k]))}
        self.kv.pools = {"layers": tuple(layers)}


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

    def restore_state(self, slot: int, snapshot_block: int | None) -> None:
        """A slot's KDA rows from a snapshot block (zeros: no block, a fresh request)."""
        vec = (self.snapshots.data[snapshot_block] if snapshot_block is not None
               else jnp.zeros((self.snapshot_size,), jnp.float32))
        layers, off = list(self.pools["layers"]), 0
        for i in self.kda_layers:
            layer = dict(layers[i])
            for k in self.kda_keys:
                shape = layer[k].shape[1:]
                n = int(np.prod(shape))
                layer[k] = set_rows(layer[k], slot, vec[off:off + n].reshape(shape))
                off += n
            layers[i] = layer
        self.pools = {"layers": tuple(layers)}

    def pack(self, entries_per_layer):
        """One snapshot vector (fp32) from each KDA layer's {state, conv_*} entries, in layer order."""
        return jnp.concatenate([layer[k].astype(jnp.float32).reshape(-1)
                                for layer in entries_per_layer for k in self.kda_keys])

    def packed_state(self, slot: int):
        return self.pack({k: v[slot] for k, v in self.pools["layers"][i].items()} for i in self.kda_layers)

    def save_state(self, slot: int, snapshot_block: int) -> None:
        self.snapshots.data = set_rows(self.snapshots.data, snapshot_block, self.packed_state(slot))

    def save_export(self, exports, index: int, snapshot_block: int) -> None:
        """Snapshot the KDA entries a prefill pass exported at its `index`-th export position
        (`kimik3.model.paged_view`'s exports; packed as `packed_state` packs a state row)."""
        packed = self.pack({k: v[0, index] for k, v in layer.items()} for layer in exports)
        self.snapshots.data = set_rows(self.snapshots.data, snapshot_block, packed)

    def write_snapshot(self, snapshot_block: int, packed: np.ndarray) -> None:
        self.snapshots.data = set_rows(self.snapshots.data, snapshot_block, jnp.asarray(packed))

    def read_kv(self, page_table: list[int], n_tokens: int, slot: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(contents of the pages holding the first `n_tokens` of a table, the slot's packed KDA state)."""
        return self.pages.read(page_table[:-(-n_tokens // self.page_tokens)]), np.asarray(self.packed_state(slot))
