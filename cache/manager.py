"""The paged KV manager: hybrid prefix caching for MLA pages + KDA state snapshots.

Granularity (docs/design.md): one hash block = one MLA page = `page_tokens` (128)
tokens, for every MLA layer at once.  KDA keeps a recurrent state, so a prefix
can only be resumed where a *snapshot* of every KDA layer's state exists:
snapshots are taken at KDA-block boundaries (`kda_block_tokens`, 1536) and at
a request's last full page (a partial unit of 128).  A prefix hit is the
longest page boundary where every MLA page up to it *and* a KDA snapshot at it
exist (GPU pool or host tier), capped at n - 1 tokens (the last prompt token is
always recomputed for its logits).

Lifecycle of a request's blocks::

    begin()            hit pages: a reference each (host-tier hits are loaded into
                       fresh GPU pages); new pages for the rest of the prompt; one
                       private checkpoint block for mid-pass KDA states
    extend()           more pages as the sequence grows
    commit_pages()     full pages the prefill has written become shareable
    commit_snapshot()  the checkpoint block, once the pass through that boundary
                       is complete, is published as the shared snapshot and the
                       request gets a fresh private one
    finish()           every reference dropped; the blocks stay cached until
                       evicted, and eviction offloads them to the host tier

A request only ever writes to blocks it allocated and has not published: shared
prefix blocks are read-only.  The manager holds block ids and hashes; the block
contents live in `BlockStore`s (device pools in the engine, host arrays here).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol, Sequence

import numpy as np

from cache.block_hash import MMItem, block_hashes
from cache.block_pool import BlockPool, NoFreeBlocks
from cache.host_tier import HostKVTier, make_key

log = logging.getLogger(__name__)


class BlockStore(Protocol):
    """Contents of a pool's blocks: one array of `block_shape` / `dtype` per block id."""

    block_shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, blocks: Sequence[int]) -> list[np.ndarray]: ...

    def write(self, blocks: Sequence[int], arrays: Sequence[np.ndarray]) -> None: ...


class ArrayBlockStore:
    """Block contents in one host array [num_blocks, *block_shape]."""

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype):
        self.data = np.zeros((num_blocks,) + tuple(block_shape), dtype)

    @property
    def block_shape(self):
        return self.data.shape[1:]

    @property
    def dtype(self):
        return self.data.dtype

    def read(self, blocks):
        return [self.data[b].copy() for b in blocks]

    def write(self, blocks, arrays):
        for b, a in zip(blocks, arrays):
            self.data[b] = a


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    namespace: str  # model / quantization / dtype: keys of different models never meet
    page_tokens: int = 128
    kda_block_tokens: int = 1536

    def __post_init__(self):
        if self.kda_block_tokens % self.page_tokens:
            raise ValueError(
                f"kda_block_tokens {self.kda_block_tokens} must be a multiple of page_tokens {self.page_tokens}"
            )


@dataclasses.dataclass
class PrefixHit:
    tokens: int  # prompt tokens served from cache (a multiple of page_tokens, <= n - 1)
    pages_gpu: int  # of the hit's pages, how many were in the GPU pool
    pages_host: int  # ... and how many came from the host tier
    snapshot_tier: str | None  # "gpu", "host" or None (no hit)
    dropped_tokens: int = 0  # what `begin(drop_tail=True)` gave up: the hit without the drop minus this one


@dataclasses.dataclass
class RequestBlocks:
    request_id: str
    hashes: list[bytes]  # of the prompt's full pages
    page_table: list[int]  # MLA pages, in token order
    hit: PrefixHit
    snapshot_block: int | None  # shared KDA snapshot to resume from (None: start from zeros)
    checkpoint_block: int  # private: mid-pass KDA states land here
    committed_pages: int = 0
    owned_snapshots: list[int] = dataclasses.field(default_factory=list)  # snapshot refs to drop at finish
    published: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)  # (snapshot block, hash)


@dataclasses.dataclass
class ManagerStats:
    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens_gpu: int = 0
    hit_tokens_host: int = 0
    offloaded_pages: int = 0
    offloaded_snapshots: int = 0
    loaded_pages: int = 0
    loaded_snapshots: int = 0

    def cache_rate(self) -> float:
        return (self.hit_tokens_gpu + self.hit_tokens_host) / max(1, self.prompt_tokens)


class PagedKVManager:
    def __init__(
        self,
        spec: CacheSpec,
        pages: BlockStore,
        num_pages: int,
        snapshots: BlockStore,
        num_snapshots: int,
        host: HostKVTier | None = None,
    ):
        self.spec = spec
        self.pages, self.snapshots, self.host = pages, snapshots, host
        self.page_pool = BlockPool(num_pages, on_evict=self._offload("mla", pages))
        self.snap_pool = BlockPool(num_snapshots, on_evict=self._offload("kda", snapshots))
        self.requests: dict[str, RequestBlocks] = {}
        self.stats = ManagerStats()

    # ---- host tier plumbing ---------------------------------------------------------------------
    def _key(self, kind: str, h: bytes) -> str:
        return make_key(self.spec.namespace, kind, h)

    def _offload(self, kind: str, store: BlockStore):
        def on_evict(block: int, h: bytes) -> None:
            if self.host is None:
                return
            (arr,) = store.read([block])
            if self.host.batch_put([self._key(kind, h)], [arr])[0]:
                if kind == "mla":
                    self.stats.offloaded_pages += 1
                else:
                    self.stats.offloaded_snapshots += 1

        return on_evict

    def _host_has(self, kind: str, hashes: Sequence[bytes]) -> list[bool]:
        if self.host is None or not hashes:
            return [False] * len(hashes)
        try:
            return self.host.exists([self._key(kind, h) for h in hashes])
        except Exception as e:  # noqa: BLE001 - a tier fault is a miss
            log.warning("host tier exists failed: %r", e)
            return [False] * len(hashes)

    # ---- lookup ---------------------------------------------------------------------------------
    def hashes(self, token_ids, mm_items: Sequence[MMItem] = (), salt: str | None = None) -> list[bytes]:
        return block_hashes(
            token_ids, block_size=self.spec.page_tokens, mm_items=mm_items, salt=salt, namespace=self.spec.namespace
        )

    def _plan_hit(self, hashes: list[bytes], n_tokens: int, drop_tail: bool = False):
        """(pages, gpu flags, snapshot tier): the longest boundary with all pages and a snapshot.
        drop_tail: never the last page of the matched run (an EAGLE-3 draft's rows of its last
        slot may belong to another continuation: `serving.spec_decode`)."""
        max_pages = min(len(hashes), (n_tokens - 1) // self.spec.page_tokens)
        on_gpu = [self.page_pool.lookup(h) is not None for h in hashes[:max_pages]]
        # Ask the host tier only about pages the GPU pool lacks, up to the first page found nowhere.
        missing = [i for i, g in enumerate(on_gpu) if not g]
        host_pages = dict(zip(missing, self._host_has("mla", [hashes[i] for i in missing])))
        avail = 0
        while avail < max_pages and (on_gpu[avail] or host_pages.get(avail, False)):
            avail += 1
        snap_gpu = [self.snap_pool.lookup(hashes[i - 1]) is not None for i in range(1, avail + 1)]
        has_snapshot = lambda n: snap_gpu[n - 1] or self._host_has("kda", [hashes[n - 1]])[0]
        undropped = avail if drop_tail and avail and has_snapshot(avail) else None
        for n_pages in range(avail - drop_tail, 0, -1):
            if snap_gpu[n_pages - 1]:
                return n_pages, on_gpu[:n_pages], "gpu", (undropped or n_pages) - n_pages
            if self._host_has("kda", [hashes[n_pages - 1]])[0]:
                return n_pages, on_gpu[:n_pages], "host", (undropped or n_pages) - n_pages
        return 0, [], None, undropped or 0

    def lookup(
        self, token_ids, mm_items: Sequence[MMItem] = (), salt: str | None = None, drop_tail: bool = False
    ) -> PrefixHit:
        """What `begin` would hit, without taking anything."""
        hashes = self.hashes(token_ids, mm_items, salt)
        n_pages, gpu, tier, dropped = self._plan_hit(hashes, len(token_ids), drop_tail)
        return PrefixHit(
            n_pages * self.spec.page_tokens, sum(gpu), n_pages - sum(gpu), tier, dropped * self.spec.page_tokens
        )

    # ---- request lifecycle ----------------------------------------------------------------------
    def pages_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.spec.page_tokens)

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a prompt of n tokens fits now (ignoring hits, which only reduce the need)."""
        return self.pages_needed(n_tokens) <= self.page_pool.num_free and self.snap_pool.num_free >= 1

    def begin(
        self,
        request_id: str,
        token_ids,
        mm_items: Sequence[MMItem] = (),
        salt: str | None = None,
        drop_tail: bool = False,
    ) -> RequestBlocks:
        """Take the prefix hit (drop_tail: see `_plan_hit`) and allocate the rest of the prompt's
        pages.  Raises NoFreeBlocks (nothing taken) when the pools cannot hold the request."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        n = len(token_ids)
        if n == 0:
            raise ValueError("empty prompt")
        hashes = self.hashes(token_ids, mm_items, salt)
        n_pages, gpu, tier, dropped = self._plan_hit(hashes, n, drop_tail)
        total_pages = self.pages_needed(n)
        n_new = total_pages - sum(gpu)
        gpu_blocks = {i: self.page_pool.lookup(hashes[i]) for i in range(n_pages) if gpu[i]}
        # Hit blocks sitting on the free list stop being free once referenced: count them out.
        free_pages = self.page_pool.num_free - sum(self.page_pool.is_free(b) for b in gpu_blocks.values())
        snap_hit = self.snap_pool.lookup(hashes[n_pages - 1]) if tier == "gpu" else None
        free_snaps = self.snap_pool.num_free - (snap_hit is not None and self.snap_pool.is_free(snap_hit))
        if n_new > free_pages or free_snaps < 1 + (tier == "host"):
            raise NoFreeBlocks(f"request {request_id!r} needs {n_new} pages, {free_pages} free")
        # Reference the GPU hits first so allocation below cannot evict them.
        self.page_pool.touch(gpu_blocks.values())
        snapshot = None
        if tier == "gpu":
            snapshot = snap_hit
            self.snap_pool.touch([snapshot])
        fresh = self.page_pool.allocate(n_new)
        table, loaded_ok = [], True
        host_idx = [i for i in range(n_pages) if not gpu[i]]
        host_blocks = fresh[: len(host_idx)]
        if host_idx:
            loaded_ok = self._load("mla", self.pages, [hashes[i] for i in host_idx], host_blocks)
        if tier == "host" and loaded_ok:
            (snapshot,) = self.snap_pool.allocate(1)
            if self._load("kda", self.snapshots, [hashes[n_pages - 1]], [snapshot]):
                self.snap_pool.cache_block(snapshot, hashes[n_pages - 1])
            else:
                self.snap_pool.free([snapshot])
                snapshot, loaded_ok = None, False
        if not loaded_ok:  # a host entry vanished or was corrupt: recompute from scratch
            self.page_pool.free(gpu_blocks.values())
            if snapshot is not None:
                self.snap_pool.free([snapshot])
            self.page_pool.free(fresh)
            n_pages, gpu, snapshot, tier = 0, [], None, None
            gpu_blocks, host_idx = {}, []
            fresh = self.page_pool.allocate(total_pages)
            host_blocks = []
        else:
            for b, i in zip(host_blocks, host_idx):  # loaded pages are shared like any cached page
                self.page_pool.cache_block(b, hashes[i])
        it_host = iter(host_blocks)
        it_new = iter(fresh[len(host_blocks) :])
        for i in range(total_pages):
            table.append(gpu_blocks[i] if i in gpu_blocks else next(it_host) if i < n_pages else next(it_new))
        (checkpoint,) = self.snap_pool.allocate(1)
        hit = PrefixHit(
            n_pages * self.spec.page_tokens, sum(gpu), n_pages - sum(gpu), tier, dropped * self.spec.page_tokens
        )
        req = RequestBlocks(
            request_id,
            hashes,
            table,
            hit,
            snapshot,
            checkpoint,
            committed_pages=n_pages,
            owned_snapshots=[snapshot] if snapshot is not None else [],
        )
        self.requests[request_id] = req
        self.stats.lookups += 1
        self.stats.prompt_tokens += n
        self.stats.hit_tokens_gpu += hit.pages_gpu * self.spec.page_tokens
        self.stats.hit_tokens_host += hit.pages_host * self.spec.page_tokens
        return req

    def _load(self, kind: str, store: BlockStore, hashes: list[bytes], blocks: list[int]) -> bool:
        outs = [np.empty(store.block_shape, store.dtype) for _ in blocks]
        found = self.host.batch_get_into([self._key(kind, h) for h in hashes], outs)
        if not all(found):
            return False
        store.write(blocks, outs)
        if kind == "mla":
            self.stats.loaded_pages += len(blocks)
        else:
            self.stats.loaded_snapshots += len(blocks)
        return True

    def extend(self, request_id: str, n_tokens: int) -> list[int]:
        """Grow the page table to hold n_tokens; returns the new pages."""
        req = self.requests[request_id]
        need = self.pages_needed(n_tokens) - len(req.page_table)
        if need <= 0:
            return []
        new = self.page_pool.allocate(need)
        req.page_table += new
        return new

    def commit_pages(self, request_id: str, n_tokens_written: int) -> None:
        """Publish the request's full pages up to n_tokens_written (prompt pages only)."""
        req = self.requests[request_id]
        upto = min(n_tokens_written // self.spec.page_tokens, len(req.hashes))
        for i in range(req.committed_pages, upto):
            self.page_pool.cache_block(req.page_table[i], req.hashes[i])
        req.committed_pages = max(req.committed_pages, upto)

    def snapshot_boundaries(self, request_id: str) -> list[int]:
        """Token counts at which this request should export KDA states: every KDA-block
        boundary past the hit, and the prompt's last full page (capped at n - 1)."""
        req = self.requests[request_id]
        n_full = len(req.hashes)
        last = n_full * self.spec.page_tokens
        start = req.hit.tokens
        out = list(
            range(
                start - start % self.spec.kda_block_tokens + self.spec.kda_block_tokens,
                last + 1,
                self.spec.kda_block_tokens,
            )
        )
        if last > start and last not in out:
            out.append(last)
        return out

    def commit_snapshot(self, request_id: str, boundary_tokens: int, state: np.ndarray | None = None) -> bool:
        """Publish the checkpoint block (holding the state after `boundary_tokens`; written by the
        kernel, or `state` here) as the shared snapshot for that prefix.  The pages up to the
        boundary must be committed first: a snapshot is never shared before its prefix is."""
        req = self.requests[request_id]
        if boundary_tokens % self.spec.page_tokens or boundary_tokens // self.spec.page_tokens > len(req.hashes):
            raise ValueError(f"boundary {boundary_tokens} is not a full-page boundary of the prompt")
        if boundary_tokens // self.spec.page_tokens > req.committed_pages:
            raise ValueError(f"pages up to {boundary_tokens} tokens are not committed yet")
        if state is not None:
            self.snapshots.write([req.checkpoint_block], [state])
        h = req.hashes[boundary_tokens // self.spec.page_tokens - 1]
        if self.snap_pool.lookup(h) is not None:
            return False  # already shared (another request got there first); keep our block private
        try:
            (fresh,) = self.snap_pool.allocate(1)
        except NoFreeBlocks:
            log.info("no free snapshot block: state at %d tokens of %s stays unpublished", boundary_tokens, request_id)
            return False  # a missed cache opportunity, never an error on the serving path
        self.snap_pool.cache_block(req.checkpoint_block, h)
        # Published snapshots are immutable and this request never reads them again: drop
        # our reference at once so they age in the LRU like any cached block.
        self.snap_pool.free([req.checkpoint_block])
        req.published.append((req.checkpoint_block, h))
        req.checkpoint_block = fresh
        return True

    def release_hit_snapshot(self, request_id: str) -> None:
        """The engine has copied the hit's snapshot into the request's state row: let it go."""
        req = self.requests[request_id]
        if req.snapshot_block is not None and req.snapshot_block in req.owned_snapshots:
            req.owned_snapshots.remove(req.snapshot_block)
            self.snap_pool.free([req.snapshot_block])

    def publish_to_host(self, request_id: str) -> int:
        """Write the request's committed pages and published snapshots to the host tier now
        (not only on eviction), so another engine can find them.  Returns entries written."""
        if self.host is None:
            return 0
        req = self.requests[request_id]
        written = 0
        live = [(b, h) for b, h in req.published if self.snap_pool.block_hash[b] == h]  # not yet reused
        for kind, store, blocks, hashes in (
            ("mla", self.pages, req.page_table[: req.committed_pages], req.hashes[: req.committed_pages]),
            ("kda", self.snapshots, [b for b, _ in live], [h for _, h in live]),
        ):
            todo = [(b, h) for b, h, there in zip(blocks, hashes, self._host_has(kind, hashes)) if h and not there]
            if todo:
                ok = self.host.batch_put([self._key(kind, h) for _, h in todo], store.read([b for b, _ in todo]))
                written += sum(ok)
        return written

    def finish(self, request_id: str) -> None:
        """Drop every reference the request holds (pages stay cached until evicted)."""
        req = self.requests.pop(request_id)
        self.page_pool.free(req.page_table)
        self.snap_pool.free(req.owned_snapshots + [req.checkpoint_block])
