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
from serving import spec_programs


# Bumped whenever a page's or a snapshot's byte layout changes (2: the KDA conv rows as one
# [W-1, 3, H*D] entry; 3: a snapshot packs key by key, each key's rows of every layer): cache
# keys carry it, so blocks stored by an older layout are misses.
LAYOUT_VERSION = 3


def padded_index(blocks) -> np.ndarray:
    """int32 [2^k >= len(blocks)]: `blocks` padded with the null block (0, never handed out; its
    contents are never read as a request's).  The page and snapshot moves run one program per
    bucket this way, where every distinct count of blocks moved compiled its own while serving."""
    n = len(blocks)
    return np.asarray(list(blocks) + [0] * ((1 << max(0, n - 1).bit_length()) - n), np.int32)


def padded_rows(arrays, rows: int) -> np.ndarray:
    """np.stack(arrays), zero rows appended up to `rows` (`padded_index`'s length)."""
    data = np.stack(arrays)
    return (
        np.concatenate([data, np.zeros((rows - len(data),) + data.shape[1:], data.dtype)]) if rows > len(data) else data
    )


@jax.jit
def _take_rows(pool, index):
    return pool[index]


@functools.partial(jax.jit, donate_argnums=(0,))
def set_rows(pool, index, rows):
    """pool.at[index].set(rows), in place: the pool is donated (an eager `.at[].set` copies
    the whole pool, e.g. every snapshot block to write one).  Callers keep the result."""
    return pool.at[index].set(rows.astype(pool.dtype))


# The moves below are one program each over every layer: run eagerly, layer by layer and key by
# key, a KDA slot <-> snapshot move of `small` is ~50 dispatches (~28 ms on an H200, more than
# a prefill chunk), paid at every admission and snapshot.


def _pack(rows):
    """One fp32 vector from {key: [n_kda, ...] every KDA layer's entries}: sorted keys, then layer
    order (the order `_restore_slot` unpacks and `KVPools.snapshot_size` sizes)."""
    return jnp.concatenate([rows[k].astype(jnp.float32).reshape(-1) for k in sorted(rows)])


def _rows_of(kda_pool, slot, n_kda):
    """Row indices of `slot` in every KDA layer of the pool (`kimik3.caches.PagedPools`)."""
    s = kda_pool["state"].shape[0] // n_kda
    return slot + jnp.arange(n_kda, dtype=jnp.int32) * s


@functools.partial(jax.jit, static_argnames=("n_kda",), donate_argnums=(0,))
def _restore_slot(kda_pool, slot, packed, *, n_kda):
    """Every KDA layer's rows of `slot` from one packed vector (pool donated: written in place)."""
    rows, out, off = _rows_of(kda_pool, slot, n_kda), {}, 0
    for k in sorted(kda_pool):
        shape = (n_kda,) + kda_pool[k].shape[1:]
        n = int(np.prod(shape))
        out[k] = kda_pool[k].at[rows].set(packed[off : off + n].reshape(shape).astype(kda_pool[k].dtype))
        off += n
    return out


@functools.partial(jax.jit, static_argnames=("n_kda",), donate_argnums=(0,))
def _restore_block(kda_pool, slot, snapshots, block, *, n_kda):
    """`_restore_slot` from snapshots[block] (the block read inside the move, not by an eager op)."""
    return _restore_slot(kda_pool, slot, snapshots[block], n_kda=n_kda)


def _slot_packed(kda_pool, slot, n_kda):
    rows = _rows_of(kda_pool, slot, n_kda)
    return _pack({k: v[rows] for k, v in kda_pool.items()})


@functools.partial(jax.jit, static_argnames=("n_kda",), donate_argnums=(0,))
def _save_slot(snapshots, block, kda_pool, slot, *, n_kda):
    """snapshots[block] = every KDA layer's rows of `slot`, packed (snapshots donated)."""
    return snapshots.at[block].set(_slot_packed(kda_pool, slot, n_kda))


@functools.partial(jax.jit, donate_argnums=(0,))
def _save_export(snapshots, block, exports, index):
    """snapshots[block] = the entries a prefill pass exported at its `index`-th position, packed
    (exports: per KDA layer a `kimik3.caches.KDAState`, state [1, E, H, K, V] and conv
    [1, E, W-1, 3, H*D]; row 0's)."""
    rows = {
        "state": jnp.stack([e.state[0, index] for e in exports]),
        "conv": jnp.stack([e.conv[0, index] for e in exports]),
    }
    return snapshots.at[block].set(_pack(rows))


_slot_rows = jax.jit(_slot_packed, static_argnames=("n_kda",))


def _page_rows(pages, index, n_mla):
    """[n, n_mla] page indices of pages `index` in every MLA layer of the pool."""
    return index[:, None] + jnp.arange(n_mla, dtype=jnp.int32)[None] * (pages.shape[0] // n_mla)


@functools.partial(jax.jit, static_argnames=("n_mla",))
def _read_pages(pages, index, *, n_mla):
    """[n, n_mla, page, D] fp32: pages `index` of every MLA layer, in one gather."""
    return pages[_page_rows(pages, index, n_mla)].astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("n_mla",), donate_argnums=(0,))
def _write_pages(pages, index, data, *, n_mla):
    """Pages `index` of every MLA layer from data [n, n_mla, page, D] (pool donated)."""
    return pages.at[_page_rows(pages, index, n_mla)].set(data.astype(pages.dtype))


def bytes_per_page(cfg: ModelConfig, page_tokens: int, dtype, draft: bool = False) -> int:
    """One MLA page: page_tokens latent rows in every MLA layer (with an EAGLE-3 draft, in its
    layer too, and the fp32 feature of the page's last slot: `serving.spec_programs.init_draft_pools`)."""
    layers = cfg.mixer_kinds.count("mla") + int(draft)
    return layers * page_tokens * cfg.mla_latent_dim * jnp.dtype(dtype).itemsize + (4 * cfg.d_model if draft else 0)


def bytes_per_draft_slot(cfg: ModelConfig, draft_tokens: int) -> int:
    """A running request's speculative extra: the fp32 features of its k + 1 pending draft slots."""
    return (draft_tokens + 1) * cfg.d_model * 4 if draft_tokens else 0


def bytes_per_state(cfg: ModelConfig, dtype) -> int:
    """One KDA state row (a running request's slot, or a snapshot): fp32 state + conv rows, all KDA layers."""
    h, d, w = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size
    per_layer = h * d * d * 4 + 3 * (w - 1) * h * d * jnp.dtype(dtype).itemsize
    return cfg.mixer_kinds.count("kda") * per_layer


def pages_in_budget(
    cfg: ModelConfig,
    dtype,
    budget_bytes: float,
    *,
    num_slots: int,
    num_snapshots: int,
    page_tokens: int,
    draft_tokens: int = 0,
) -> int:
    """KV pages a byte budget holds once the slots' states (and an EAGLE-3 draft's pending
    features) and the snapshots are carved out; a draft's rows ride on every page."""
    state = bytes_per_state(cfg, dtype)
    fixed = (num_slots + 1) * (state + bytes_per_draft_slot(cfg, draft_tokens)) + num_snapshots * state
    page = bytes_per_page(cfg, page_tokens, dtype, draft=draft_tokens > 0)
    return int((budget_bytes - fixed) // page) if page else 0


class MLAPageStore:
    """BlockStore over the MLA page pools: one block = [n_mla_layers, page, D], and with an EAGLE-3
    draft one more layer, the draft's rows of the page (`serving.spec_decode`), so the host tier,
    offloads and P/D handoffs carry them (host copies in fp32 for bf16 pools: numpy has no bf16)."""

    def __init__(self, kv: "KVPools"):
        self.kv = kv
        self.layers = len(kv.mla_layers) + (kv.dpools is not None)
        self.block_shape = (self.layers, kv.page_tokens, kv.cfg.mla_latent_dim)
        self.dtype = np.dtype(jnp.dtype(kv.dtype).name if kv.dtype != jnp.bfloat16 else "float32")

    def read(self, blocks):
        if not len(blocks):
            return []
        index = padded_index(blocks)
        stacked = np.asarray(_read_pages(self.kv.pools["mla"]["pages"], index, n_mla=len(self.kv.mla_layers)))
        if self.kv.dpools is not None:
            stacked = np.concatenate(
                [stacked, np.asarray(_read_pages(self.kv.dpools["pages"], index, n_mla=1))], axis=1
            )
        return [stacked[j].astype(self.dtype) for j in range(len(blocks))]

    def write(self, blocks, arrays):
        """The padding rows of a bucket write zeros into the null page (as a decode batch's padding rows do)."""
        if not len(blocks):
            return
        index = padded_index(blocks)
        data = padded_rows(arrays, len(index))
        n_mla = len(self.kv.mla_layers)
        pages = _write_pages(self.kv.pools["mla"]["pages"], index, data[:, :n_mla], n_mla=n_mla)
        self.kv.pools = dict(self.kv.pools, mla={"pages": pages})
        if self.kv.dpools is not None:
            self.kv.tail_known[np.asarray(blocks, np.int64)] = False
            self.kv.dpools = dict(
                self.kv.dpools, pages=_write_pages(self.kv.dpools["pages"], index, data[:, n_mla:], n_mla=1)
            )


class SnapshotStore:
    """BlockStore of KDA snapshots: every KDA layer's state and conv rows, packed in one vector."""

    def __init__(self, kv: "KVPools", num_blocks: int, device=None):
        self.block_shape = (kv.snapshot_size,)
        self.dtype = np.dtype(np.float32)
        self.data = jnp.zeros((num_blocks, kv.snapshot_size), jnp.float32)
        if device is not None:  # beside its rank's pools (the moves between them are one program each)
            self.data = jax.device_put(self.data, device)

    def read(self, blocks):
        if not len(blocks):
            return []
        return list(np.asarray(_take_rows(self.data, padded_index(blocks)))[: len(blocks)])

    def write(self, blocks, arrays):
        if not len(blocks):
            return
        index = padded_index(blocks)
        self.data = set_rows(self.data, index, padded_rows(arrays, len(index)))


class KVPools:
    """The paged pools, the snapshot pool and the moves between them (see the module comment)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_pages: int,
        num_slots: int,
        num_snapshots: int,
        page_tokens: int,
        dtype,
        commit: bool = False,
        draft_tokens: int = 0,
        device=None,
    ):
        """commit: place the pools on the default device explicitly (sharded steps compile their
        gather / write-back programs per placement).  device: place them (and the snapshots) on
        this device instead: a DP rank's own (`sharding.rank_pools`).  draft_tokens: k > 0 adds
        an EAGLE-3 draft's pools (`serving.spec_programs.init_draft_pools`) as `dpools`."""
        self.dpools = (
            spec_programs.init_draft_pools(cfg, num_pages, num_slots + 1, page_tokens, draft_tokens, dtype)
            if draft_tokens
            else None
        )
        # pages whose dpools["tail_g"] holds their last slot's feature (blocks written from the
        # host tier or a handoff do not carry it)
        self.tail_known = np.zeros(num_pages, bool)
        self.cfg, self.dtype, self.page_tokens = cfg, dtype, page_tokens
        self.mla_layers = [i for i, k in enumerate(cfg.mixer_kinds) if k == "mla"]
        self.kda_layers = [i for i, k in enumerate(cfg.mixer_kinds) if k == "kda"]
        self.scratch_slot = num_slots  # the extra slot: padding rows of decode batches
        self.pools = model.init_paged_cache(cfg, num_pages, num_slots + 1, page_tokens, dtype)
        if commit or device is not None or self.dpools is not None:
            # committed: a program's executable is per placement, and every later call sees the
            # pools as outputs of earlier programs (committed), so warm-up must see them so too
            device = device or next(iter(jax.tree_util.tree_leaves(self.pools)[0].devices()))
            self.pools = jax.device_put(self.pools, device)
            if self.dpools is not None:
                self.dpools = jax.device_put(self.dpools, device)
        n_kda = len(self.kda_layers)
        self.kda_keys = sorted(self.pools["kda"])
        self.snapshot_size = sum(int(np.prod(v.shape[1:])) for v in self.pools["kda"].values()) * n_kda
        self.pages = MLAPageStore(self)
        self.snapshots = SnapshotStore(self, num_snapshots, device)
        self._zeros = None  # a fresh request's packed state, made once

    # ---- moves (one program each) -------------------------------------------------------------------
    # The moves take their slot and block numbers as numpy scalars: a jitted call moves them with
    # its arguments, where `jnp.int32(x)` (or indexing a device array by x) is an eager op of its own,
    # a launch on a GPU before the move's.
    def restore_state(self, slot: int, snapshot_block: int | None) -> None:
        """A slot's KDA rows from a snapshot block (zeros: no block, a fresh request)."""
        n_kda = len(self.kda_layers)
        if snapshot_block is None:
            if self._zeros is None:
                self._zeros = jnp.zeros((self.snapshot_size,), jnp.float32)
            kda = _restore_slot(self.pools["kda"], np.int32(slot), self._zeros, n_kda=n_kda)
        else:
            kda = _restore_block(
                self.pools["kda"], np.int32(slot), self.snapshots.data, np.int32(snapshot_block), n_kda=n_kda
            )
        self.pools = dict(self.pools, kda=kda)

    def packed_state(self, slot: int):
        return _slot_rows(self.pools["kda"], np.int32(slot), n_kda=len(self.kda_layers))

    def save_state(self, slot: int, snapshot_block: int) -> None:
        self.snapshots.data = _save_slot(
            self.snapshots.data, np.int32(snapshot_block), self.pools["kda"], np.int32(slot), n_kda=len(self.kda_layers)
        )

    def warm_moves(self, max_blocks: int) -> None:
        """Compile (and run, on the null page and snapshot block and the scratch slot) the page and
        snapshot moves of every bucket up to `max_blocks` blocks (`padded_index`), as offloads,
        host-tier loads and P/D handoffs use them, and the slot <-> snapshot moves: they then
        compile nothing while serving."""
        for n in sorted({len(padded_index(range(k))) for k in range(1, max_blocks + 1)}):
            for store in (self.pages, self.snapshots):
                store.write([0] * n, store.read([0] * n))
        # a slot <-> snapshot move each way, on the scratch slot and the null block (admissions
        # restore a cached prefix's state; chunks ending at a page boundary save one)
        self.save_state(self.scratch_slot, 0)
        self.restore_state(self.scratch_slot, 0)
        self.restore_state(self.scratch_slot, None)
        jax.block_until_ready((self.pools, self.snapshots.data))

    def save_export(self, exports, index: int, snapshot_block: int) -> None:
        """Snapshot the KDA entries a prefill pass exported at its `index`-th export position
        (`kimik3.model.forward_paged`'s exports, per KDA layer a `kimik3.caches.KDAState`
        [1, E, ...]; packed as `packed_state` packs a state row)."""
        self.snapshots.data = _save_export(
            self.snapshots.data, np.int32(snapshot_block), tuple(exports), np.int32(index)
        )

    def write_snapshot(self, snapshot_block: int, packed: np.ndarray) -> None:
        self.snapshots.write([snapshot_block], [packed])  # the bucketed move `warm_moves` compiled

    def read_kv(self, page_table: list[int], n_tokens: int, slot: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(contents of the pages holding the first `n_tokens` of a table, the slot's packed KDA state)."""
        return self.pages.read(page_table[: -(-n_tokens // self.page_tokens)]), np.asarray(self.packed_state(slot))
