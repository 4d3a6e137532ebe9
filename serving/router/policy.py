"""Which worker of a pool gets an attempt: the least loaded available one, or, for a prompt whose
deepest known prefix lives in one prefill worker's GPU pool (and not in the shared store), that
worker -- unless it is busier than the best by more than `affinity_slack`.

The policy remembers which worker ran each block hash (`PrefixAffinity.remember`, bounded to
`affinity_entries`, least recently used first out).  Hashes are the workers' own (`cache.block_hash`:
namespace, page size, the tenant's salt and the images' content), so a remembered prefix is one
the worker's prefix cache can serve.  A prefix in the shared store (`StoreProbe`) is served
equally well by any worker: then load alone decides.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import random

import numpy as np

from cache.block_hash import block_hashes, image_items
from cache.guarded_tier import GuardedHostKVTier
from cache.host_tier import make_key
from cache.mooncake_tier import MooncakeHostKVTier
from kimik3 import tokenizer
from serving.router.registry import Worker, WorkerPools

log = logging.getLogger(__name__)


class StoreProbe:
    """Whether a prefix's last page and KDA snapshot are in the shared Mooncake store.  Blocking
    (the router calls `has` on a thread); a dead store answers "not there" within 0.5 s."""

    def __init__(self, master: str, metadata: str):
        # a probe is a hint: a dead store answers "not there" at once, never stalls routing
        self.tier = GuardedHostKVTier(MooncakeHostKVTier(master, metadata, staging_bytes=1 << 20), timeout_s=0.5)

    def has(self, namespace: str, block_hash: bytes) -> bool:
        return all(self.tier.exists([make_key(namespace, "mla", block_hash), make_key(namespace, "kda", block_hash)]))

    def close(self) -> None:
        self.tier.close()


class PrefixAffinity:
    """The placement policy over `pools` (`WorkerPools`: their facts name the hash namespace and
    page size).  `store`: the shared store's probe, or None (every known prefix is then GPU-only);
    `metrics.affinity` counts each prefill choice by how it was made (load, affinity, store)."""

    def __init__(self, cfg, model_cfg, pools: WorkerPools, metrics):
        self.cfg, self.model_cfg, self.pools, self.metrics = cfg, model_cfg, pools, metrics
        self.entries: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # block hash -> worker URL
        self.store: StoreProbe | None = None

    @staticmethod
    def least_loaded(cands: list[Worker]) -> Worker:
        """The lowest `Worker.score` of `cands`; ties drawn at random (spreads an idle pool)."""
        low = min(w.score() for w in cands)
        return random.choice([w for w in cands if w.score() == low])

    async def pick(
        self,
        pool: list[Worker],
        tried: set[str],
        prompt: list[int] | None,
        salt: str | None = None,
        images_b64: list[str] | None = None,
    ) -> Worker | None:
        """The worker of `pool` for the next attempt, or None when none is available.  Workers in
        `tried` (URLs this request already failed on) come last: one is chosen again only when no
        other is available.  With `prompt` (a first stage), prefix affinity may override load."""
        cands = [w for w in pool if w.available()]
        cands = [w for w in cands if w.url not in tried] or cands
        if not cands:
            return None
        best = self.least_loaded(cands)
        if prompt is None:
            return best
        decision, chosen = "load", best
        holder, h = self.holder(prompt, salt, images_b64)
        if holder is not None:
            ns = self.pools.fact("namespace")
            in_store = False
            if self.store is not None and ns:
                try:
                    in_store = await asyncio.to_thread(self.store.has, ns, h)
                except Exception as e:  # noqa: BLE001
                    log.debug("store probe failed: %r", e)
            if in_store:
                decision = "store"
            else:
                w = next((c for c in cands if c.url == holder), None)
                if w is not None and w.score() <= best.score() + self.cfg.affinity_slack:
                    decision, chosen = "affinity", w
        self.metrics.affinity.labels(decision).inc()
        return chosen

    def hashes(self, prompt: list[int], salt: str | None = None, images_b64: list[str] | None = None) -> list[bytes]:
        """The workers' block hashes of `prompt` for a tenant's `salt` with its images (as their
        caches key them: a block holding an image's placeholders carries the image's hash, so
        image prompts match the workers' blocks and prompts that differ only in an image do not)."""
        ns, page = self.pools.fact("namespace"), self.pools.fact("page_tokens")
        if not ns or not page:
            return []
        items = ()
        if images_b64:
            vit = self.model_cfg.vit
            shape = (vit.image_size, vit.image_size, vit.channels)
            images = [np.frombuffer(base64.b64decode(b), np.uint8).reshape(shape) for b in images_b64]
            items = image_items(prompt, images, vit.tokens_per_image, tokenizer.IMAGE_ID)
            items = tuple(it for it in items if it.offset + it.length <= len(prompt))
        return block_hashes(prompt, block_size=page, namespace=ns, salt=salt, mm_items=items)

    def holder(
        self, prompt: list[int], salt: str | None = None, images_b64: list[str] | None = None
    ) -> tuple[str | None, bytes | None]:
        """(URL of the worker that ran the deepest remembered block of `prompt`, that block's hash),
        or (None, None)."""
        hashes = self.hashes(prompt[:-1], salt, images_b64)  # hits are capped at n - 1 tokens
        for h in reversed(hashes):
            if h in self.entries:
                self.entries.move_to_end(h)
                return self.entries[h], h
        return None, None

    def remember(
        self, prompt: list[int], url: str, salt: str | None = None, images_b64: list[str] | None = None
    ) -> None:
        """Remember that `url` now holds every block of `prompt` (it just ran it)."""
        for h in self.hashes(prompt, salt, images_b64):
            self.entries[h] = url
            self.entries.move_to_end(h)
        while len(self.entries) > self.cfg.affinity_entries:
            self.entries.popitem(last=False)
