"""The serving engine: params, the paged pools, the cache manager, and jitted steps.

One `Engine` owns:

* device pools (`kimik3.model.init_paged_cache`): MLA latent pages shared by all
  requests (block ids = the manager's page ids) and KDA state rows (one slot
  per running request);
* a KDA snapshot pool (the manager's snapshot blocks), packed per snapshot as
  one fp32 vector of every KDA layer's state and conv rows;
* a `PagedKVManager` over both, optionally backed by a host tier.

`step()` runs one scheduler iteration under a token budget (`max_step_tokens`):
admit waiting requests the pools can hold (prefix hits restore pages and a KDA
snapshot and skip that prefill); decode one token for every running request in
one batched call (decode rows are charged to the budget first: they are what
TPOT waits on); then spend what is left on prefill chunks of the prefilling
requests, oldest first.  The KDA state at each of the manager's snapshot
boundaries comes out of the chunk's own pass (`export_at`: the kernel writes the
state there while it runs, no replay), is packed into the request's private
checkpoint block and published; a chunk ends at a boundary only where its pass
cannot export it (not a KDA-chunk multiple from the chunk's start), and then
the state row is copied after the pass (`_plan_chunk`).
When the pool runs short while decoding, the most recently admitted requests are
preempted: with a host tier their KV (pages and KDA state) is offloaded there and
installed back when they resume; without one, or if an entry was evicted or is
corrupt, they resume by recomputing prompt + output (prefix hits still apply).
Prefill chunks have power-of-two lengths and decode batches are padded to
power-of-two buckets with a scratch slot and the null page, so recompiles stay
rare; `compiles` counts them.

On a device mesh (issue 8)
--------------------------
``Engine(..., mesh=...)`` runs the model steps sharded (`sharding.paged.PagedStep`):

* role "prefill": ``mesh=sharding.mesh.prefill_mesh(tp, ep, devices)``; prefill chunks run
  through `ShardedPrefill` (TP/SP attention, EP MoE);
* role "decode": ``mesh=sharding.mesh.decode_mesh(dp, ep, devices)``; decode batches run
  through `ShardedDecode` (DP attention, EP MoE);
* role "both": ``mesh=(prefill_mesh, decode_mesh)``; either may be None (that phase then
  runs on the default device).

A phase without a mesh runs as before (`kimik3.model` on the default device; a decode
engine's short tail prefills after a store handoff or a preemption, for instance).  The
pools, the `PagedKVManager`, snapshots, prefix hits and the host tier are unchanged: each
sharded step gathers its rows from the pools into the contiguous `init_cache` layout, runs
on the mesh, and writes the new latent rows and KDA rows back (`sharding.paged`).
Shapes: sharded prefill chunks are ``tp * 2**k`` tokens (prefix hits and snapshot
boundaries are page multiples, so ``tp`` must divide ``page_tokens``); a prompt's last
``< tp`` tokens run unsharded on the default device, exactly (padding a chunk would push
pad tokens through the KDA recurrence and conv state).  Decode batches are padded (scratch
slot, null pages) to a power of two rounded up to a multiple of dp.  A mesh that does not
fit the config or these sizes raises ValueError at construction.

Not yet production-like: the pools are not split per rank; they stay on the default
device, so every sharded step moves its requests' rows (the full ``max_pages * page``
latent width) onto the mesh and the new rows back; the engine also keeps an unsharded copy
of the params there for the unsharded pieces; and a prefill chunk is one request (B = 1).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_hash import MMItem
from cache.block_pool import NULL_BLOCK, NoFreeBlocks
from cache.host_tier import HostKVTier, make_key
from cache.manager import CacheSpec, PagedKVManager
from kimik3 import model, ops, tokenizer
from kimik3.config import ModelConfig
from serving.model_runner import DecodeRows, DecodeRunner
from serving.sampling import GREEDY, SamplingParams, choose_token
from sharding.paged import PagedStep, helper_programs

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_at_eos: bool = False
    arrival_s: float = dataclasses.field(default_factory=time.monotonic)
    sampling: SamplingParams = GREEDY
    images: np.ndarray | None = None  # [N, S, S, C] for the prompt's <|image|> placeholders
    mm_items: tuple = ()  # cache.block_hash.MMItem per image: its content hash enters the block hashes
    # filled by the engine
    output: list[int] = dataclasses.field(default_factory=list)
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    cached_tokens_host: int = 0
    admitted_s: float | None = None
    done: bool = False
    error: str | None = None
    _slot: int = -1
    _context: list[int] = dataclasses.field(default_factory=list)  # tokens to prefill (prompt, + output on resume)
    _computed: int = 0  # tokens of _context whose KV is in the cache
    _cached_len: int = 0  # tokens in the cache once prefilled (decode writes at this position)
    _boundaries: list[int] = dataclasses.field(default_factory=list)
    _last_logits: np.ndarray | None = None
    _offload_keys: list[str] | None = None  # host-tier entries of its KV while preempted
    _resume_kv: tuple | None = None  # (page contents, packed KDA state) fetched back for re-admission
    _image_rows: object = None  # the images' ViT embeddings [N * P, D], computed once at first prefill


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_rows(pool, index, rows):
    """pool.at[index].set(rows), in place: the pool is donated (an eager `.at[].set` copies
    the whole pool, e.g. every snapshot block to write one).  Callers keep the result."""
    return pool.at[index].set(rows.astype(pool.dtype))


class _MLAPageStore:
    """BlockStore over the engine's MLA page pools: one block = [n_mla_layers, page, D]."""

    def __init__(self, engine: "Engine"):
        self.e = engine
        self.block_shape = (len(engine.mla_layers), engine.page_tokens, engine.cfg.mla_latent_dim)
        self.dtype = np.dtype(jnp.dtype(engine.dtype).name if engine.dtype != jnp.bfloat16 else "float32")

    def read(self, blocks):
        layers = self.e.pools["layers"]
        idx = jnp.asarray(blocks, jnp.int32)
        stacked = np.stack([np.asarray(layers[i]["pages"][idx], np.float32) for i in self.e.mla_layers], 1)
        return [stacked[j].astype(self.dtype) for j in range(len(blocks))]

    def write(self, blocks, arrays):
        idx = jnp.asarray(blocks, jnp.int32)
        data = np.stack(arrays)  # [n, n_mla, page, D]
        layers = list(self.e.pools["layers"])
        for k, i in enumerate(self.e.mla_layers):
            layers[i] = {"pages": _set_rows(layers[i]["pages"], idx, jnp.asarray(data[:, k]))}
        self.e.pools = {"layers": tuple(layers)}


class _SnapshotStore:
    """BlockStore of KDA snapshots: every KDA layer's state and conv rows, packed in one vector."""

    def __init__(self, engine: "Engine", num_blocks: int):
        self.e = engine
        self.block_shape = (engine.snapshot_size,)
        self.dtype = np.dtype(np.float32)
        self.data = jnp.zeros((num_blocks, engine.snapshot_size), jnp.float32)

    def read(self, blocks):
        return list(np.asarray(self.data[jnp.asarray(blocks, jnp.int32)]))

    def write(self, blocks, arrays):
        self.data = _set_rows(self.data, jnp.asarray(blocks, jnp.int32), jnp.asarray(np.stack(arrays)))


class Engine:
    def __init__(self, params, cfg: ModelConfig, *, num_pages: int, num_slots: int = 8, num_snapshots: int = 16,
                 page_tokens: int = 128, kda_block_tokens: int = 1536, max_pages_per_request: int | None = None,
                 prefill_chunk_tokens: int = 512, host: HostKVTier | None = None, kernels: str = "auto",
                 namespace: str | None = None, role: str = "both", publish_to_host: bool = False,
                 max_step_tokens: int | None = None, mesh=None, dispatch: str = "auto"):
        """max_step_tokens: tokens one step may run (decode rows + prefill chunk tokens); default
        one full prefill chunk plus a decode row per slot.
        role: "both" (colocated), "prefill" (stops after the first token; `on_prefilled`
        hands the request over while its KV is still held), or "decode".
        publish_to_host: write each finished request's pages and snapshots to the host tier
        at once (a shared store then serves them to other engines, and to this one after a
        restart), not only when they are evicted.
        mesh: None (one device), or the mesh(es) the model steps run on: a `prefill_mesh` for
        role "prefill", a `decode_mesh` for role "decode", a pair (prefill_mesh, decode_mesh)
        for role "both" (either may be None).  dispatch: the sharded MoE's all-to-all
        ("auto", "dense", "ragged"; see `sharding.layers`)."""
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode; got {role!r}")
        self.role = role
        self.publish_to_host = publish_to_host
        self.on_prefilled = None  # callable(engine, request) for role "prefill"
        self.params, self.cfg = params, cfg
        self.dtype = params["embed_vd"].dtype
        self.page_tokens = page_tokens
        self.kernels = ops.resolve(kernels)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # KDA states one unsharded prefill chunk can export in its own pass (`_plan_chunk`): every
        # KDA-block boundary inside it plus the prompt's last full page.  A fixed count, so the
        # chunk programs keep one shape (`_export_at`).
        self.export_slots = prefill_chunk_tokens // kda_block_tokens + 2
        self.max_step_tokens = max_step_tokens or prefill_chunk_tokens + num_slots
        if self.max_step_tokens <= num_slots:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must exceed num_slots ({num_slots}): "
                             f"a step with every slot decoding must leave room for prefill")
        self.max_pages = max_pages_per_request or -(-cfg.max_seq_len // page_tokens)
        self._prefill_step, self._decode_step = self._mesh_steps(mesh, dispatch, num_slots)
        self.runner = DecodeRunner(cfg, self.kernels)  # unsharded decode steps: persistent buffers, device sampling
        self._inflight = None  # (requests, DecodeRows, device tokens, dispatch id) of the decode step not yet read
        self._mesh_params = {s.mode: s.place_params(params) for s in (self._prefill_step, self._decode_step) if s}
        self.mla_layers = [i for i, k in enumerate(cfg.mixer_kinds) if k == "mla"]
        self.kda_layers = [i for i, k in enumerate(cfg.mixer_kinds) if k == "kda"]
        # slot num_slots is scratch for padded decode rows
        self.pools = model.init_paged_cache(cfg, num_pages, num_slots + 1, page_tokens, self.dtype)
        self.scratch_slot = num_slots
        if self._prefill_step or self._decode_step:  # commit them (see PagedStep.__call__)
            self.pools = jax.device_put(self.pools, next(iter(jax.tree_util.tree_leaves(self.pools)[0].devices())))
        self._free_slots = list(range(num_slots))
        kda0 = self.pools["layers"][self.kda_layers[0]] if self.kda_layers else {}
        self._kda_keys = sorted(kda0)
        self.snapshot_size = sum(int(np.prod(kda0[k].shape[1:])) for k in self._kda_keys) * len(self.kda_layers)
        ns = namespace or f"{cfg.name}/{jnp.dtype(self.dtype).name}"
        self.pages = _MLAPageStore(self)
        self.snapshots = _SnapshotStore(self, num_snapshots)
        self.manager = PagedKVManager(CacheSpec(ns, page_tokens, kda_block_tokens), self.pages, num_pages,
                                      self.snapshots, num_snapshots, host)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admitted: prefilling or decoding
        self.finished: list[Request] = []
        self.compiles = 0
        self.preemptions = 0
        self.offloaded_resumes = 0  # preempted requests resumed from their offloaded KV (no recompute)
        self.recomputed_tokens = 0  # tokens re-prefilled after a preemption (offload missing or no host tier)
        # tokens each recent step ran (decode rows + prefill tokens); bounded for long-running servers
        self.step_tokens: collections.deque[int] = collections.deque(maxlen=4096)
        self._ids = itertools.count()

    def _mesh_steps(self, mesh, dispatch: str, num_slots: int) -> tuple[PagedStep | None, PagedStep | None]:
        """(prefill step, decode step) from the `mesh` argument; ValueError for one that does not fit."""
        if mesh is None:
            return None, None
        if self.role == "both":
            if not (isinstance(mesh, (tuple, list)) and len(mesh) == 2):
                raise ValueError("role 'both' takes mesh=(prefill_mesh, decode_mesh) (either may be None); "
                                 f"got {type(mesh).__name__}")
            pm, dm = mesh
        elif isinstance(mesh, (tuple, list)):
            raise ValueError(f"role {self.role!r} takes one mesh (its {self.role} mesh), not a pair")
        else:
            pm, dm = (mesh, None) if self.role == "prefill" else (None, mesh)
        pre = None if pm is None else PagedStep(self.cfg, pm, "prefill", dispatch=dispatch, kernels=self.kernels)
        dec = None if dm is None else PagedStep(self.cfg, dm, "decode", dispatch=dispatch, kernels=self.kernels)
        if pre is not None:
            tp = pre.size
            if self.page_tokens % tp:
                raise ValueError(f"tp={tp} must divide page_tokens={self.page_tokens} (prefix hits and KDA "
                                 f"snapshot boundaries are page multiples; sharded chunks are tp multiples)")
            if self.prefill_chunk_tokens < tp:
                raise ValueError(f"prefill_chunk_tokens={self.prefill_chunk_tokens} is below tp={tp}")
            if self.max_step_tokens - num_slots < tp:
                raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must leave tp={tp} prefill tokens "
                                 f"beside a decode row for each of the {num_slots} slots")
        for s in (pre, dec):
            if s is not None:
                log.info("engine (%s): %s steps on %s=%d ep=%d over devices %s", self.role, s.mode,
                         s.shape.group_axis, s.size, s.shape.ep, [d.id for d in s.mesh.devices.flat])
        return pre, dec

    # ---- sizing --------------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_tokens: int, dtype) -> int:
        """One MLA page: page_tokens latent rows in every MLA layer."""
        return cfg.mixer_kinds.count("mla") * page_tokens * cfg.mla_latent_dim * jnp.dtype(dtype).itemsize

    @staticmethod
    def bytes_per_state(cfg: ModelConfig, dtype) -> int:
        """One KDA state row (a running request's slot, or a snapshot): fp32 state + conv rows, all KDA layers."""
        h, d, w = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size
        per_layer = h * d * d * 4 + 3 * (w - 1) * h * d * jnp.dtype(dtype).itemsize
        return cfg.mixer_kinds.count("kda") * per_layer

    @classmethod
    def from_memory_budget(cls, params, cfg: ModelConfig, budget_bytes: int | None = None, *,
                           fraction: float = 0.5, page_tokens: int = 128, num_slots: int = 8,
                           snapshots_per_slot: int = 4, **kw) -> "Engine":
        """Size the pools from a byte budget (default: `fraction` of the device's free memory on
        GPU; required on CPU).  Slots and snapshots are carved out first, pages get the rest."""
        if budget_bytes is None:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" not in stats:
                raise ValueError("no device memory statistics here: pass budget_bytes")
            budget_bytes = int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
        dtype = params["embed_vd"].dtype
        state = cls.bytes_per_state(cfg, dtype)
        num_snapshots = num_slots * snapshots_per_slot
        fixed = (num_slots + 1) * state + num_snapshots * state
        page = cls.bytes_per_page(cfg, page_tokens, dtype)
        num_pages = (budget_bytes - fixed) // page if page else 0
        if num_pages < 2:
            raise ValueError(f"a budget of {budget_bytes} bytes does not hold {num_slots} state slots, "
                             f"{num_snapshots} snapshots and two pages")
        return cls(params, cfg, num_pages=int(num_pages), num_slots=num_slots, num_snapshots=num_snapshots,
                   page_tokens=page_tokens, **kw)

    def capacity(self) -> dict:
        """What the pools hold: tokens of KV, concurrent sessions, and the per-request
        checkpoint block's cost."""
        page = self.bytes_per_page(self.cfg, self.page_tokens, self.dtype)
        state = self.bytes_per_state(self.cfg, self.dtype)
        n_pages = self.manager.page_pool.num_blocks - 1
        return {"kv_tokens": n_pages * self.page_tokens, "pages": n_pages, "sessions": len(self._free_slots) +
                len(self.running), "snapshots": self.manager.snap_pool.num_blocks - 1,
                "page_bytes": page, "state_bytes": state, "checkpoint_block_bytes_per_request": state,
                "pool_bytes": (n_pages + 1) * page + (self.scratch_slot + 1 + self.manager.snap_pool.num_blocks) * state}

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, *, request_id: str | None = None,
               stop_at_eos: bool = False, sampling: SamplingParams = GREEDY, images=None) -> Request:
        """Queue a request.  Raises ValueError for a prompt the engine can never serve.
        `sampling`: greedy by default; temperature / top-p draws are seeded per position
        (serving.sampling), so preemption and handoffs do not change them.
        `images`: [N, S, S, C] (float in [0, 1] or uint8) for the prompt's N * tokens_per_image
        <|image|> placeholders; their content hashes enter the prefix-cache block hashes, so a
        prefix hit never crosses a different image."""
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a serving.sampling.SamplingParams; got {type(sampling).__name__}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
        if any(t < 0 or t >= self.cfg.vocab_size for t in prompt):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        images, mm_items = self._check_images(prompt, images)
        total = len(prompt) + max_new_tokens
        # Beyond the pool's usable pages a request could never be admitted: refuse it now.
        usable_pages = self.manager.page_pool.num_blocks - 1
        limit = min(self.cfg.max_seq_len, min(self.max_pages, usable_pages) * self.page_tokens)
        if total > limit:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                             f"context limit of {limit} tokens")
        req = Request(request_id or f"req-{next(self._ids)}", prompt, max_new_tokens, stop_at_eos,
                      sampling=sampling, images=images, mm_items=mm_items)
        self.waiting.append(req)
        return req

    def _check_images(self, prompt: list[int], images) -> tuple[np.ndarray | None, tuple]:
        """(images as an array, one MMItem per image) for a prompt, or ValueError."""
        n_slots = prompt.count(tokenizer.IMAGE_ID)
        if images is None:
            if n_slots:
                raise ValueError(f"the prompt holds {n_slots} <|image|> placeholders but no images were given")
            return None, ()
        if self._prefill_step is not None:
            raise ValueError("images on an engine with a prefill mesh are not supported yet")
        arr = np.asarray(model._as_images(images, np.asarray([prompt]), self.cfg))  # checks shape, count, values
        per = self.cfg.vit.tokens_per_image
        where = [i for i, t in enumerate(prompt) if t == tokenizer.IMAGE_ID]
        items = tuple(MMItem(hashlib.blake2b(np.ascontiguousarray(img).tobytes(), digest_size=16).digest(),
                             where[k * per], per) for k, img in enumerate(arr))
        return arr, items

    def stream(self, prompt: Sequence[int], max_new_tokens: int, **kw):
        """Submit a request and yield its tokens as they come, stepping the engine (which also
        advances every other request).  For notebooks and simple clients."""
        req = self.submit(prompt, max_new_tokens, **kw)
        sent = 0
        while not req.done or sent < len(req.output):
            while sent < len(req.output):
                yield req.output[sent]
                sent += 1
            if not req.done:
                self.step()
        if req.error:
            raise RuntimeError(f"request {req.request_id} ended: {req.error}")

    def cancel(self, request_id: str) -> bool:
        """Stop a request and free its KV; False if it is unknown or already done."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._release(req, error="cancelled")
                    return True
        return False

    def load(self) -> dict:
        """What a router balances on: queue depth, running requests, free slots and pages, KV use."""
        pool = self.manager.page_pool
        total = pool.num_blocks - 1
        return {"waiting": len(self.waiting), "running": len(self.running), "free_slots": len(self._free_slots),
                "sessions": len(self._free_slots) + len(self.running), "free_pages": pool.num_free,
                "total_pages": total, "kv_use": (total - pool.num_free) / total if total else 0.0,
                "preemptions": self.preemptions}

    def pop_finished(self) -> list[Request]:
        """The requests finished since the last call (and forget them: a long-running server
        reads results here so `finished` does not grow without bound)."""
        done, self.finished = self.finished, []
        return done

    # ---- the loop -----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, max_steps: int = 1_000_000) -> list[Request]:
        for _ in range(max_steps):
            if not self.has_work():
                break
            self.step()
        return self.finished

    def step(self) -> None:
        if self._chainable():  # a decode-only phase: step n+1 goes out before step n's tokens are read
            self._chain_decode()
            return
        self._settle_decode()
        self._admit()
        # Decide both sets before running either: a request whose prefill ends this step
        # emits its first token and decodes from the next step on.
        decoding = [r for r in self.running if r._computed >= len(r._context) and not r.done]
        prefilling = [r for r in self.running if r._computed < len(r._context)]
        used = self._decode(decoding) if decoding else 0
        for req in prefilling:
            left = self.max_step_tokens - used
            if left < 1:
                break
            if req in self.running:  # a decode preemption may have sent it back to the queue
                used += self._prefill_chunk(req, left)
        if prefilling or self.waiting:  # not a decode-only phase: read this step's tokens now
            self._settle_decode()
        if used:
            self.step_tokens.append(used)

    # ---- async decode: one step in flight ------------------------------------------------------------
    def _chainable(self) -> bool:
        """Whether the next step may be dispatched on the in-flight step's device tokens: the same
        requests, none of which can have reached max_new_tokens with the in-flight token, nothing
        waiting or prefilling, and pages for the next position without preempting."""
        if self._inflight is None or self.waiting:
            return False
        reqs = self._inflight[0]
        if len(reqs) != len(self.running) or any(r.done or len(r.output) + 1 >= r.max_new_tokens
                                                 or r.stop_at_eos and r.output[-1:] == [tokenizer.EOS_ID]
                                                 for r in reqs):
            return False
        if set(map(id, reqs)) != set(map(id, self.running)):
            return False
        need = sum(max(0, self.manager.pages_needed(r._cached_len + 1)
                       - len(self.manager.requests[r.request_id].page_table)) for r in reqs)
        return need <= self.manager.page_pool.num_free

    def _chain_decode(self) -> None:
        reqs = self._inflight[0]
        for r in reqs:
            self.manager.extend(r.request_id, r._cached_len + 1)
        rows = self._decode_rows(reqs, tokens=[0] * len(reqs))  # tokens: the device's, from the step in flight
        self.pools, tokens, did = self.runner.dispatch(self.params, self.pools, rows, tokens_on_device=True)
        for r in reqs:
            r._cached_len += 1
        previous, self._inflight = self._inflight, (reqs, rows, tokens, did)
        self._resolve_decode(previous)
        self.step_tokens.append(len(reqs))

    def _settle_decode(self) -> None:
        """Read the in-flight decode step's tokens, if any."""
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._resolve_decode(previous)

    def _resolve_decode(self, inflight) -> None:
        """Emit a dispatched decode step's tokens (waits for them).  Requests that ended since it
        was dispatched (EOS in the step before, cancellation) drop theirs."""
        reqs, rows, tokens, did = inflight
        before = self._programs()
        tokens = np.asarray(tokens)
        self.runner.settle(rows, tokens, did)
        self.compiles += self._programs() - before
        for r, token in zip(reqs, tokens):
            if not r.done and r in self.running:
                self._emit(r, int(token))

    def _admit(self) -> None:
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            if req._offload_keys is not None:
                self._fetch_offloaded(req)
            req._context = req._context or list(req.prompt)
            try:
                blocks = self.manager.begin(req.request_id, req._context, req.mm_items)
            except NoFreeBlocks:
                return  # admission by capacity: it waits until running requests free pages
            self.waiting.pop(0)
            req._slot = self._free_slots.pop()
            if req.admitted_s is None:  # a resumed request keeps its first admission's numbers
                req.admitted_s = time.monotonic()
                req.cached_tokens = blocks.hit.tokens
                req.cached_tokens_host = blocks.hit.pages_host * self.page_tokens
            self.manager.release_hit_snapshot(req.request_id)
            if req._resume_kv is not None:  # back from an offload: install its KV, no recompute
                pages, state = req._resume_kv
                req._resume_kv = None
                self._install_kv(req, blocks, pages, state)
                req._computed = req._cached_len = len(req._context)
                self.offloaded_resumes += 1
            else:
                req._computed = blocks.hit.tokens
                if req.output:
                    self.recomputed_tokens += len(req._context) - req._computed
                self._restore_state(req._slot, blocks.snapshot_block)
            req._boundaries = [b for b in self.manager.snapshot_boundaries(req.request_id) if b > req._computed]
            self.running.append(req)

    def _install_kv(self, req: Request, blocks, pages: list[np.ndarray], state: np.ndarray) -> None:
        """Write a request's page contents (those not already shared through its prefix hit) and
        its KDA state after `len(req._context)` tokens into the pools and its slot."""
        first_new = blocks.hit.tokens // self.page_tokens  # hit pages are shared: never written
        new_pages = blocks.page_table[first_new:len(pages)]
        if new_pages:
            self.pages.write(new_pages, pages[first_new:first_new + len(new_pages)])
        self.manager.commit_pages(req.request_id, len(req._context))
        self.snapshots.data = _set_rows(self.snapshots.data, blocks.checkpoint_block, jnp.asarray(state))
        self._restore_state(req._slot, blocks.checkpoint_block)

    def adopt(self, prompt: Sequence[int], first_token: int, max_new_tokens: int, pages: list[np.ndarray],
              state: np.ndarray, *, request_id: str, arrival_s: float, stop_at_eos: bool = False,
              sampling: SamplingParams = GREEDY, images=None) -> Request | None:
        """Take over a request another engine prefilled (direct P/D handoff): its prompt's
        page contents and its KDA state after the whole prompt.  None if it does not fit now."""
        if not self._free_slots:
            return None
        images, mm_items = self._check_images(list(prompt), images)
        try:
            blocks = self.manager.begin(request_id, prompt, mm_items)
        except NoFreeBlocks:
            return None
        req = Request(request_id, list(prompt), max_new_tokens, stop_at_eos, arrival_s=arrival_s, sampling=sampling,
                      images=images, mm_items=mm_items)
        req.admitted_s = time.monotonic()
        req.cached_tokens = blocks.hit.tokens
        req.cached_tokens_host = blocks.hit.pages_host * self.page_tokens
        req._slot = self._free_slots.pop()
        req._context = list(prompt)
        self._install_kv(req, blocks, pages, state)
        req._computed = req._cached_len = len(prompt)
        self.running.append(req)
        self._emit(req, first_token)
        return req

    def export_kv(self, req: Request) -> tuple[list[np.ndarray], np.ndarray]:
        """(prompt page contents, packed KDA state) of a request this engine holds."""
        return self._read_kv(req, len(req.prompt))

    def _read_kv(self, req: Request, n_tokens: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(contents of the pages holding the request's first `n_tokens`, its packed KDA state)."""
        table = self.manager.requests[req.request_id].page_table
        return self.pages.read(table[:-(-n_tokens // self.page_tokens)]), np.asarray(self._packed_state(req._slot))

    # ---- KDA state rows <-> snapshot blocks ----------------------------------------------------------
    def _restore_state(self, slot: int, snapshot_block: int | None) -> None:
        vec = (self.snapshots.data[snapshot_block] if snapshot_block is not None
               else jnp.zeros((self.snapshot_size,), jnp.float32))
        layers, off = list(self.pools["layers"]), 0
        for i in self.kda_layers:
            layer = dict(layers[i])
            for k in self._kda_keys:
                shape = layer[k].shape[1:]
                n = int(np.prod(shape))
                layer[k] = _set_rows(layer[k], slot, vec[off:off + n].reshape(shape))
                off += n
            layers[i] = layer
        self.pools = {"layers": tuple(layers)}

    def _pack(self, entries_per_layer):
        """One snapshot vector (fp32) from each KDA layer's {state, conv_*} entries, in layer order."""
        return jnp.concatenate([layer[k].astype(jnp.float32).reshape(-1)
                                for layer in entries_per_layer for k in self._kda_keys])

    def _packed_state(self, slot: int):
        return self._pack({k: v[slot] for k, v in self.pools["layers"][i].items()} for i in self.kda_layers)

    def _save_state(self, slot: int, snapshot_block: int) -> None:
        self.snapshots.data = _set_rows(self.snapshots.data, snapshot_block, self._packed_state(slot))

    def _save_export(self, exports, index: int, snapshot_block: int) -> None:
        """Snapshot the KDA entries a prefill pass exported at its `index`-th export position
        (`_forward`'s exports; packed as `_packed_state` packs a state row)."""
        packed = self._pack({k: v[0, index] for k, v in layer.items()} for layer in exports)
        self.snapshots.data = _set_rows(self.snapshots.data, snapshot_block, packed)

    # ---- model calls --------------------------------------------------------------------------------
    def _table(self, req: Request) -> list[int]:
        table = self.manager.requests[req.request_id].page_table
        return table + [NULL_BLOCK] * (self.max_pages - len(table))

    def _programs(self) -> int:
        """Compiled step programs so far (the unsharded model and the sharded steps)."""
        steps = [s for s in (self._prefill_step, self._decode_step) if s]
        return (model._forward._cache_size() + model.forward_step._cache_size() + sum(s.programs() for s in steps)
                + (helper_programs() if steps else 0) + self.runner.programs())

    def _forward(self, tokens, tables, slots, lengths, step: PagedStep | None = None, images=None,
                 export_at=None):
        """Run [B, T] tokens on rows (tables [B, max_pages], slots [B], lengths [B]); returns the
        last position's logits f32 [B, V] as numpy and, with export_at (int32 [E] token counts of
        this call; unsharded only), the KDA exports (`kimik3.model.paged_view`), else None.
        `step`: a sharded step, else the unsharded model."""
        before = self._programs()
        exports = None
        # Inputs were checked at submit; generated ids (a random model may emit <|image|>) are
        # not prompts, so the steps call the jitted cores directly.
        if step is not None:
            logits, self.pools = step(self._mesh_params[step.mode], self.pools, tokens, tables, slots, lengths)
        else:
            view = model.paged_view(self.pools, tables, slots, lengths, export_at)
            positions = view["lengths"][:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
            logits, view = model.forward_step(self.params, jnp.asarray(tokens), positions, view, images,
                                              **self._step_static())
            self.pools = {"layers": view["layers"]}
            exports = view.get("exports")
        self.compiles += self._programs() - before  # new XLA programs this call needed
        return np.asarray(logits[:, -1], np.float32), exports

    def _step_static(self) -> dict:
        """The unsharded step's static arguments (warm-up compiles exactly these): logits for
        the last position only, which is all a step samples from."""
        return dict(cfg=self.cfg, expert_path="grouped", kernels=self.kernels, logits_tail=1)

    def _export_at(self, chunk_tokens: int, offsets=()) -> list[int] | None:
        """The export positions an unsharded prefill chunk passes (`offsets` padded with -1 to
        `export_slots`), or None for chunks shorter than one KDA chunk: those never export, and
        a one-token chunk then shares the decode program of batch 1."""
        if chunk_tokens < self.cfg.kda_chunk_size:
            return None
        return list(offsets) + [-1] * (self.export_slots - len(offsets))

    def _prefill_lengths(self) -> list[tuple[int, PagedStep | None]]:
        """Every prefill chunk length this engine runs, with the step that runs it (None: unsharded)."""
        c, pre = self.prefill_chunk_tokens, self._prefill_step
        if pre is None:
            return [(1 << i, None) for i in range(c.bit_length())]
        tp = pre.size
        return ([(1 << i, None) for i in range((tp - 1).bit_length())]
                + [(tp << i, pre) for i in range((c // tp).bit_length())])

    def _decode_bucket(self, n: int) -> int:
        """Rows of a decode batch of n requests: the next power of two, rounded up to a multiple of dp."""
        bucket = 1 << (n - 1).bit_length()
        if self._decode_step is not None:
            bucket = -(-bucket // self._decode_step.size) * self._decode_step.size
        return bucket

    def warmup(self, threads: int | None = None) -> int:
        """Compile every step shape this engine can use (`_prefill_lengths`; decode buckets for 1 ..
        num_slots requests) and run each once on scratch rows (the scratch slot and null pages).

        threads: unsharded shapes compile ahead of time concurrently on this many threads
        (default: one per shape, at most half the CPU cores): XLA's compile of a whole-model
        step is mostly single-threaded (~30 s per shape for `small` on an H200 host), so the
        ~20 shapes of a serving engine take minutes one by one.  The runs that follow (one by
        one: each donates the pools) then find their executables compiled.  Returns the
        number of new programs."""
        before = self._programs()
        shapes = [(1, t, step) for t, step in self._prefill_lengths()]
        buckets = sorted({self._decode_bucket(n) for n in range(1, self.scratch_slot + 1)})
        if self._decode_step is not None:
            shapes += [(b, 1, self._decode_step) for b in buckets]

        def rows(b):
            return [[NULL_BLOCK] * self.max_pages] * b, [self.scratch_slot] * b, [0] * b

        def step_args(shape):
            b, t = shape
            view = model.paged_view(self.pools, *rows(b), self._export_at(t) if b == 1 else None)
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
            return self.params, jnp.zeros((b, t), jnp.int32), positions, view, None

        def decode_rows(b):  # padding only: writes land in the scratch slot and the null page
            return DecodeRows.build(b, [], [], [], [], [], max_pages=self.max_pages, null_page=NULL_BLOCK,
                                    scratch_slot=self.scratch_slot)

        static = self._step_static()

        for b, t, step in shapes:
            if step is not None:  # writes land in the scratch slot and the null page only
                logits, self.pools = step(self._mesh_params[step.mode], self.pools, jnp.zeros((b, t), jnp.int32),
                                          *rows(b))
                jax.block_until_ready(logits)
        unsharded = sorted({(b, t) for b, t, step in shapes if step is None})
        decode = buckets if self._decode_step is None else []
        jobs = [functools.partial(lambda shape: model.forward_step.lower(*step_args(shape), **static).compile(), s)
                for s in unsharded]
        jobs += [functools.partial(lambda b: self.runner.compile(self.params, self.pools, decode_rows(b)), b)
                 for b in decode]
        workers = threads or max(1, min(len(jobs), (os.cpu_count() or 2) // 2))
        # Lowering and compiling neither run nor donate anything, so they may overlap.
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda job: job(), jobs))
        for shape in unsharded:
            logits, view = model.forward_step(*step_args(shape), **static)
            self.pools = {"layers": view["layers"]}
            jax.block_until_ready(logits)
        for b in decode:
            self.pools, tokens, _ = self.runner.dispatch(self.params, self.pools, decode_rows(b))
            jax.block_until_ready(tokens)
        return self._programs() - before

    def _prefill_chunk(self, req: Request, budget_tokens: int) -> int:
        """Prefill the next chunk of `req` (at most `budget_tokens`); returns its token count."""
        start, ctx = req._computed, req._context
        end = min(len(ctx), start + self.prefill_chunk_tokens, start + budget_tokens)
        if req.images is not None and start < len(req.prompt) < end:
            # Placeholders take image rows only inside the prompt (a recompute after preemption
            # may include generated <|image|> ids, which decode embedded as plain tokens).
            end = len(req.prompt)
        step = self._prefill_step
        export: list[int] = []  # KDA snapshot boundaries this chunk exports in its own pass
        if step is not None and len(ctx) - start >= step.size:
            if req._boundaries and req._boundaries[0] < end:
                end = req._boundaries[0]  # end the chunk where a KDA snapshot is due
            # Sharded: tp * 2^k tokens.  `start` is a multiple of tp here (hits and boundaries are
            # page multiples, tp divides the page, every earlier chunk was a tp multiple).
            spans = (end - start) // step.size
            if spans == 0:
                return 0  # the budget left this step is below one tp span: next step
            end = start + step.size * (1 << (spans.bit_length() - 1))
        else:
            # Power-of-two chunk lengths: exact (no padding) and at most log2(chunk) compiled shapes.
            # With a prefill mesh this is only the prompt's last < tp tokens, unsharded.
            step = None
            end, export = self._plan_chunk(start, end, req._boundaries)
        tokens = np.asarray([ctx[start:end]], np.int32)
        images = None
        if req.images is not None and start < len(req.prompt) and tokenizer.IMAGE_ID in ctx[start:end]:
            if req._image_rows is None:  # the ViT runs once per request, at its first image chunk
                req._image_rows = model.image_embeddings(self.params, self.cfg, req.images)
            # this chunk's placeholders take the rows after those of earlier chunks
            images = {"rows": req._image_rows, "first": jnp.int32(ctx[:start].count(tokenizer.IMAGE_ID))}
        export_at = self._export_at(end - start, [b - start for b in export]) if step is None else None
        logits, exports = self._forward(tokens, [self._table(req)], [req._slot], [start], step, images, export_at)
        req._last_logits = logits[0]
        req._computed = end
        self.manager.commit_pages(req.request_id, end)
        for i, boundary in enumerate(export):
            req._boundaries.remove(boundary)
            self._save_export(exports, i, self.manager.requests[req.request_id].checkpoint_block)
            self.manager.commit_snapshot(req.request_id, boundary)
        if req._boundaries and req._boundaries[0] == end:
            req._boundaries.pop(0)
            blocks = self.manager.requests[req.request_id]
            self._save_state(req._slot, blocks.checkpoint_block)
            self.manager.commit_snapshot(req.request_id, end)
        if end == len(ctx):
            req._cached_len = end
            if self.role == "prefill" and self.on_prefilled is not None:
                req.output.append(self._choose(req, req._last_logits))
                req.token_times_s.append(time.monotonic())
                self.on_prefilled(self, req)  # hands the KV over while this engine still holds it
                self.running.remove(req)
                self._release(req)
            else:
                self._emit(req, self._choose(req, req._last_logits))
        return end - start

    def _plan_chunk(self, start: int, end: int, boundaries: list[int]) -> tuple[int, list[int]]:
        """The end of an unsharded prefill chunk from `start` (at most `end`), and the snapshot
        boundaries strictly inside it, which its pass exports (`export_at`).

        Chunk lengths are powers of two (exact: no padding, few compiled shapes).  A boundary
        inside the chunk is exported where the KDA pass produces its state, at a multiple of
        the KDA chunk from `start`, and only up to `export_slots` of them; any other boundary
        ends the chunk there instead (its state is then the slot row after the pass)."""
        unit = self.cfg.kda_chunk_size
        while True:
            end = start + (1 << ((end - start).bit_length() - 1))
            inside = [b for b in boundaries if start < b < end]
            not_exportable = [b for b in inside if (b - start) % unit]
            if not_exportable:
                end = not_exportable[0]
            elif len(inside) > self.export_slots:
                end = inside[self.export_slots]
            else:
                return end, inside

    def _make_room(self, reqs: list[Request]) -> list[Request]:
        """Pages for the token each request is about to write, preempting the most recently
        admitted requests (by recompute: their committed pages stay cached) when the pool is
        short.  Returns the requests that can decode this step."""
        reqs = list(reqs)
        need = lambda rs: sum(max(0, self.manager.pages_needed(r._cached_len + 1)
                                  - len(self.manager.requests[r.request_id].page_table)) for r in rs)
        while reqs and need(reqs) > self.manager.page_pool.num_free:
            victim = max(reqs, key=lambda r: r.admitted_s or 0.0)
            reqs.remove(victim)
            if not reqs and need([victim]) > self.manager.page_pool.num_free + len(
                    self.manager.requests[victim.request_id].page_table):
                self.running.remove(victim)
                self._release(victim, error="out of KV capacity")
                return []
            self._preempt(victim)
        for r in reqs:
            self.manager.extend(r.request_id, r._cached_len + 1)
        return reqs

    def _preempt(self, req: Request) -> None:
        """Free a running request's pages and slot and queue it first to resume.

        With a host tier its KV (pages of the tokens in the cache and the KDA state) is
        offloaded there first and installed back on resume; recomputing prompt + output
        is the last resort (no host tier, or the entries were evicted or are corrupt)."""
        self.preemptions += 1
        self.running.remove(req)
        req._context = list(req.prompt) + list(req.output)
        host = self.manager.host
        if host is not None and req._cached_len == len(req._context) - 1:
            pages, state = self._read_kv(req, req._cached_len)
            tag = f"{req.request_id}/{self.preemptions}"
            keys = [make_key(self.manager.spec.namespace, "preempt",
                             hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest())
                    for i in range(len(pages) + 1)]
            if all(host.batch_put(keys, pages + [state])):
                req._offload_keys = keys
            else:
                host.remove(keys)
        self.manager.finish(req.request_id)
        self._free_slots.append(req._slot)
        req._slot, req._computed, req._cached_len = -1, 0, 0
        self.waiting.insert(0, req)

    def _fetch_offloaded(self, req: Request) -> None:
        """Bring a preempted request's offloaded KV back from the host tier (once); on any
        missing or corrupt entry it resumes by recompute instead."""
        keys, req._offload_keys = req._offload_keys, None
        cached = len(req.prompt) + len(req.output) - 1  # the last output token is not in the cache yet
        pages = [np.empty(self.pages.block_shape, self.pages.dtype) for _ in range(len(keys) - 1)]
        state = np.empty((self.snapshot_size,), np.float32)
        found = self.manager.host.batch_get_into(keys, pages + [state])
        self.manager.host.remove(keys)
        if all(found):
            req._resume_kv = (pages, state)
            req._context = req._context[:cached]
        else:
            log.info("request %s: offloaded KV incomplete in the host tier; resuming by recompute", req.request_id)

    def _decode(self, reqs: list[Request]) -> int:
        """One token for each of `reqs` in one batched call; returns the rows decoded."""
        reqs = self._make_room(reqs)
        if not reqs:
            return 0
        bucket = self._decode_bucket(len(reqs))
        if self._decode_step is None:  # one device: the decode program with its persistent buffers
            before = self._programs()
            rows = self._decode_rows(reqs, [r.output[-1] for r in reqs])
            self.pools, tokens, did = self.runner.dispatch(self.params, self.pools, rows)
            self.compiles += self._programs() - before
            for r in reqs:
                r._cached_len += 1
            self._inflight = (reqs, rows, tokens, did)  # read by the next step (or at this one's end)
            return len(reqs)
        pad = bucket - len(reqs)
        tokens = np.asarray([[r.output[-1]] for r in reqs] + [[0]] * pad, np.int32)
        tables = [self._table(r) for r in reqs] + [[NULL_BLOCK] * self.max_pages] * pad
        slots = [r._slot for r in reqs] + [self.scratch_slot] * pad  # padding rows share the scratch slot
        lengths = [r._cached_len for r in reqs] + [0] * pad
        logits, _ = self._forward(tokens, tables, slots, lengths, self._decode_step)
        for r, row in zip(reqs, logits):
            r._cached_len += 1
            self._emit(r, self._choose(r, row))
        return len(reqs)

    def _decode_rows(self, reqs: list[Request], tokens: list[int]) -> DecodeRows:
        return DecodeRows.build(self._decode_bucket(len(reqs)), tokens, [self._table(r) for r in reqs],
                                [r._slot for r in reqs], [r._cached_len for r in reqs], [r.sampling for r in reqs],
                                max_pages=self.max_pages, null_page=NULL_BLOCK, scratch_slot=self.scratch_slot)

    def records(self):
        """Metrics records of the finished requests (serving.metrics)."""
        from serving.metrics import RequestRecord

        return [RequestRecord(r.arrival_s, r.token_times_s, len(r.prompt), r.cached_tokens - r.cached_tokens_host,
                              r.cached_tokens_host, r.admitted_s) for r in self.finished if r.error is None]

    @staticmethod
    def _choose(req: Request, logits_v: np.ndarray) -> int:
        """The next token of `req` (its absolute position seeds a sampled draw)."""
        return choose_token(logits_v, req.sampling, len(req.prompt) + len(req.output))

    def _emit(self, req: Request, token: int) -> None:
        req.output.append(token)
        req.token_times_s.append(time.monotonic())
        if len(req.output) >= req.max_new_tokens or (req.stop_at_eos and token == tokenizer.EOS_ID):
            self.running.remove(req)
            self._release(req)

    def _release(self, req: Request, error: str | None = None) -> None:
        if req._offload_keys is not None:  # cancelled while preempted: drop its offloaded KV
            self.manager.host.remove(req._offload_keys)
            req._offload_keys = None
        if req.request_id in self.manager.requests:
            if self.publish_to_host and error is None:
                self.manager.publish_to_host(req.request_id)
            self.manager.finish(req.request_id)
        if req._slot >= 0:
            self._free_slots.append(req._slot)
            req._slot = -1
        req.done, req.error = True, error
        self.finished.append(req)
