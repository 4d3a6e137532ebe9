"""The scheduler: which requests run in a step, and how much of each (vLLM V1's ``schedule()``).

Pure Python over the cache manager: no JAX, no model, testable with numpy block stores.
``Scheduler.schedule() -> StepPlan`` decides one step under a token budget:

1. **admit** waiting requests while a slot is free and the pools hold their prompt
   (`PagedKVManager.begin`: a prefix hit restores pages and a KDA snapshot and skips that
   prefill; a request back from an offload brings its KV with it);
2. **decode** one token for every running request past its prefill: decode rows are charged
   to the budget first (they are what TPOT waits on; a speculative row as the 1 + k tokens its
   verify pass runs).  Pages for the token each writes come
   first; when the pool runs short the most recently admitted requests are preempted (their
   KV offloaded to the host tier where there is one, recomputed otherwise);
3. **prefill** chunks of the prefilling requests, oldest first, with what is left of the
   budget (and at most `prefill_tokens_while_decoding` while decode rows run, so a long
   prompt does not stretch every running request's next token).  A chunk runs padded to one of
   a few compiled lengths; the KDA snapshot boundaries inside it are exported by
   its own pass where the pass can (a KDA-chunk multiple from its start), else the chunk ends
   at the boundary and the slot's state is snapshotted after it.

The engine executes the plan (`serving.engine.Engine`) and reports back through `emit` and
`release`.  Request bookkeeping (`_computed`, `_boundaries`) advances when a step is planned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import Sequence

import numpy as np

from cache.block_pool import NoFreeBlocks
from cache.host_tier import make_key
from cache.manager import PagedKVManager, RequestBlocks
from kimik3 import tokenizer
from serving.request import Request

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Admission:
    """A request admitted this step: its blocks, and the KV to install if it is back from an
    offload (pages, packed KDA state), else its slot starts from `blocks.snapshot_block`."""

    request: Request
    blocks: RequestBlocks
    resume_kv: tuple | None = None

    def restored(self, manager: PagedKVManager) -> None:
        """The executor has restored the hit's snapshot into the slot: its block may be reused."""
        manager.release_hit_snapshot(self.request.request_id)


@dataclasses.dataclass(frozen=True)
class Preemption:
    """A running request sent back to the queue.  offload_keys: host-tier keys its KV (the pages
    of `page_table` holding `cached_len` tokens, then the packed state of `slot`) is to be
    written under before the step runs; None: it resumes by recompute."""

    request: Request
    page_table: tuple[int, ...]
    slot: int
    cached_len: int
    offload_keys: tuple[str, ...] | None
    rank: int = 0  # whose pools the pages and slot are in


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start, end) of `request.context`.  export: snapshot boundaries strictly inside,
    exported by the chunk's own pass; snapshot_at_end: the chunk ends at a boundary whose state
    is the slot after it; sharded: it runs on the prefill mesh."""

    request: Request
    start: int
    end: int
    export: tuple[int, ...] = ()
    snapshot_at_end: bool = False
    sharded: bool = False

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def last(self) -> bool:
        """The chunk completes its request's prefill (its logits give the next token)."""
        return self.end == len(self.request.context)


@dataclasses.dataclass
class StepPlan:
    """One step, as `Scheduler.schedule` decided it; executed in this order by the engine."""

    preempted: list[Preemption] = dataclasses.field(default_factory=list)
    admitted: list[Admission] = dataclasses.field(default_factory=list)
    failed: list[tuple[Request, str]] = dataclasses.field(default_factory=list)
    decode: list[Request] = dataclasses.field(default_factory=list)
    prefill: list[PrefillChunk] = dataclasses.field(default_factory=list)
    decode_row_tokens: int = 1  # tokens a decode row runs (a speculative verify pass: 1 + k)
    # the decode rows' input tokens are those of the decode step still on the device (`chain_plan`)
    chained: bool = False

    @property
    def tokens(self) -> int:
        return len(self.decode) * self.decode_row_tokens + sum(c.tokens for c in self.prefill)

    @property
    def decode_only(self) -> bool:
        return not (self.prefill or self.admitted or self.preempted or self.failed)


@dataclasses.dataclass
class StepOutput:
    """What one executed plan produced (`serving.executor.StepExecutor.execute`), in the order it was produced.

    tokens: (request, token, mixed, logprobs) per new token: mixed when its step also ran prefill
    chunks (metrics split TPOT by it); logprobs a `TokenLogprobs` where the request asked for them.
    handed_over: prefilled requests a prefill engine gave to its `on_prefilled` hook, to release.
    (A request whose own work raised has already ended alone through the executor's `fail` hook.)"""

    tokens: list[tuple[Request, int, bool, object]] = dataclasses.field(default_factory=list)
    handed_over: list[Request] = dataclasses.field(default_factory=list)

    def extend(self, other: "StepOutput") -> "StepOutput":
        self.tokens += other.tokens
        self.handed_over += other.handed_over
        return self


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    num_slots: int
    page_tokens: int
    prefill_chunk_tokens: int
    max_step_tokens: int
    export_slots: int  # KDA states one unsharded chunk can export in its own pass
    kda_chunk_tokens: int  # the KDA pass's chunk: exports land on its multiples from a chunk's start
    sharded_prefill: int | None = None  # tp of the prefill mesh (chunks of tp * 2^k tokens), None: unsharded
    prefill_tokens_while_decoding: int | None = None  # prefill cap in a step with decode rows (None: budget)
    namespace: str = ""
    # False: no request meets another's blocks (each hashes under a salt of its own id): the
    # ablation's "prefix cache off"; its own blocks still serve its preemption and resume.
    prefix_caching: bool = True
    # "in_pass": a chunk's pass exports the snapshot boundaries inside it; "align": each boundary
    # ends a chunk instead (vLLM's mamba_cache_mode=align), the baseline of the in-pass export.
    snapshots: str = "in_pass"
    # Speculative decoding: each decode row writes 1 + lookahead_tokens positions (a verify pass
    # over t0 and k drafts), so its pages are extended that far; drop_tail: prefix hits never
    # take the last matched page (`PagedKVManager.begin`); offload_preempted False: a preempted
    # request resumes by recompute (its draft features are not offloaded).
    lookahead_tokens: int = 0
    drop_tail: bool = False
    offload_preempted: bool = True
    eos_id: int = tokenizer.EOS_ID  # the tokenizer's end of sequence (requests with stop_at_eos end there)


class Scheduler:
    """Queues, slots and the plan of each step over a `PagedKVManager` (see the module comment).

    Under DP decode each rank owns its pools (`sharding.rank_pools`), so the scheduler is given
    one manager per rank (their host tier shared) and `num_slots` splits evenly over them.  A
    request is placed on a rank at admission (`placements`: the rank whose pool already holds
    the longest run of its prefix, then the one with the most free pages) and stays there;
    every page, slot and snapshot it takes is its rank's, and preemption frees room within a
    rank.  `free_slots` lists the free slots of all ranks as ``rank * slots_per_rank + slot``."""

    def __init__(
        self,
        config: SchedulerConfig,
        manager: PagedKVManager | Sequence[PagedKVManager],
        *,
        publish_to_host: bool = False,
    ):
        self.managers = list(manager) if isinstance(manager, (list, tuple)) else [manager]
        if not self.managers or config.num_slots % len(self.managers):
            raise ValueError(
                f"num_slots ({config.num_slots}) must split evenly over the {len(self.managers)} ranks' pools"
            )
        self.config, self.publish_to_host = config, publish_to_host
        self.manager = self.managers[0]  # rank 0's (the only one without DP); per request: `manager_of`
        self.slots_per_rank = config.num_slots // len(self.managers)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admitted: prefilling or decoding
        self.finished: list[Request] = []
        self.free_slots = list(range(config.num_slots))
        self.preemptions = 0
        self.offloaded_resumes = 0  # preempted requests resumed from their offloaded KV (no recompute)
        self.recomputed_tokens = 0  # tokens re-prefilled after a preemption (offload missing or no host tier)

    # ---- ranks -------------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return len(self.managers)

    def manager_of(self, req: Request) -> PagedKVManager:
        return self.managers[req.rank]

    def placements(self, token_ids, mm_items=(), salt: str | None = None) -> list[int]:
        """Ranks with a free slot, best first for a request of these tokens: the most leading pages
        already in the rank's pool (a prefix hit there), then the most free pages."""
        free = sorted({g // self.slots_per_rank for g in self.free_slots})
        if len(free) <= 1:
            return free
        hashes = self.manager.hashes(token_ids, mm_items, salt)  # every rank hashes alike (one namespace)
        max_pages = min(len(hashes), (len(token_ids) - 1) // self.config.page_tokens)

        def on_rank(rank):
            pool, n = self.managers[rank].page_pool, 0
            while n < max_pages and pool.lookup(hashes[n]) is not None:
                n += 1
            return n, pool.num_free

        return sorted(free, key=on_rank, reverse=True)

    def begin(self, req: Request, token_ids) -> RequestBlocks | None:
        """Place `req` on the best rank that can hold it and take its blocks there (setting its
        rank and slot); None (nothing taken) when no rank with a free slot can."""
        salt = self._salt(req)
        for rank in self.placements(token_ids, req.mm_items, salt):
            try:
                blocks = self.managers[rank].begin(
                    req.request_id, token_ids, req.mm_items, salt=salt, drop_tail=self.config.drop_tail
                )
            except NoFreeBlocks:
                continue
            slot = [g for g in self.free_slots if g // self.slots_per_rank == rank][-1]
            self.free_slots.remove(slot)
            req.rank, req.slot = rank, slot % self.slots_per_rank
            return blocks
        return None

    def _free_slot(self, req: Request) -> None:
        if req.slot >= 0:
            self.free_slots.append(req.rank * self.slots_per_rank + req.slot)
            req.slot = -1

    def fits(self, reqs: list[Request], extra: int = 0) -> bool:
        """Whether every rank's free pages cover its requests' next decode step (`pages_short`)."""
        return all(
            self.pages_short([r for r in reqs if r.rank == rank], extra) <= m.page_pool.num_free
            for rank, m in enumerate(self.managers)
        )

    def _salt(self, req: Request) -> str | None:
        if self.config.prefix_caching:
            return req.cache_salt
        return f"{req.cache_salt or ''}\x00{req.request_id}"

    # ---- planning ----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(decode_row_tokens=1 + self.config.lookahead_tokens)
        self._admit(plan)
        # Both sets are decided before either runs: a request whose prefill ends this step emits
        # its first token then and decodes from the next step on.
        decoding = [r for r in self.running if r.planned_len >= len(r.context) and not r.done]
        prefilling = [r for r in self.running if r.planned_len < len(r.context)]
        if decoding:
            plan.decode = self._make_room(decoding, plan)
        cap = self.config.prefill_tokens_while_decoding if plan.decode else None
        prefill_budget = self.config.max_step_tokens - len(plan.decode) * plan.decode_row_tokens
        if cap is not None:
            prefill_budget = min(prefill_budget, cap)
        for req in prefilling:
            left = prefill_budget - sum(c.tokens for c in plan.prefill)
            if left < 1:
                break
            if req in self.running:  # a decode preemption may have sent it back to the queue
                chunk = self._plan_prefill(req, left)
                if chunk is not None:
                    plan.prefill.append(chunk)
        return plan

    def chain_plan(self, in_flight: list[Request] | None) -> StepPlan | None:
        """A decode-only plan dispatched on the device's tokens of the decode step still in flight
        (`in_flight`, its requests), before the host reads them; None unless it is safe: the same
        requests as `running`, none of which can reach max_new_tokens with the in-flight step's
        tokens (1, or a round's up to k + 1), nothing waiting that a free slot could admit, and
        pages for the next step's reach without preempting (they are taken here).  Requests
        waiting while every slot is taken do not stop the chain: `_admit` needs a free slot, and
        one frees only when a running request ends, which breaks the chain (done, or at its
        max_new_tokens) before its next step."""
        if in_flight is None or (self.waiting and self.free_slots):
            return None
        if len(in_flight) != len(self.running) or set(map(id, in_flight)) != set(map(id, self.running)):
            return None
        flight = 1 + self.config.lookahead_tokens  # tokens the in-flight step may add to a request
        if any(r.done or len(r.output) + flight >= r.max_new_tokens for r in in_flight):
            return None
        # a plain step's token is already counted in kv_len; a round's accepted count is not known yet
        extra = flight if self.config.lookahead_tokens else 0
        if not self.fits(in_flight, extra):
            return None
        for r in in_flight:
            self.manager_of(r).extend(r.request_id, self.decode_reach(r, extra))
        return StepPlan(decode=list(in_flight), decode_row_tokens=flight, chained=True)

    def _admit(self, plan: StepPlan) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if req.offload_keys is not None:
                self._fetch_offloaded(req)
            req.context = req.context or list(req.prompt)
            blocks = self.begin(req, req.context)
            if blocks is None:
                return  # admission by capacity: it waits until running requests free pages
            self.waiting.pop(0)
            if req.admitted_s is None:  # a resumed request keeps its first admission's numbers
                req.admitted_s = time.monotonic()
                req.cached_tokens = blocks.hit.tokens
                req.cached_tokens_host = blocks.hit.pages_host * self.config.page_tokens
                req.tail_dropped_tokens = blocks.hit.dropped_tokens
            # The hit's snapshot block stays held until the engine has restored it into the slot
            # (`Admission.restored`): a later admission's `begin` may otherwise load another
            # prefix's snapshot from the host tier into it first.
            resume, req.resume_kv = req.resume_kv, None
            if resume is not None:  # back from an offload: its KV is installed, no recompute
                req.planned_len = req.kv_len = len(req.context)
                self.offloaded_resumes += 1
            else:
                req.planned_len = blocks.hit.tokens
                if req.output:
                    self.recomputed_tokens += len(req.context) - req.planned_len
            req.snapshots_due = [
                b for b in self.manager_of(req).snapshot_boundaries(req.request_id) if b > req.planned_len
            ]
            self.running.append(req)
            plan.admitted.append(Admission(req, blocks, resume))

    def _fetch_offloaded(self, req: Request) -> None:
        """Bring a preempted request's offloaded KV back from the host tier (once); on any
        missing or corrupt entry it resumes by recompute instead."""
        keys, req.offload_keys = req.offload_keys, None
        cached = len(req.prompt) + len(req.output) - 1  # the last output token is not in the cache yet
        pages = [np.empty(self.manager.pages.block_shape, self.manager.pages.dtype) for _ in range(len(keys) - 1)]
        state = np.empty(self.manager.snapshots.block_shape, np.float32)
        found = self.manager.host.batch_get_into(keys, pages + [state])
        self.manager.host.remove(keys)
        if all(found):
            req.resume_kv = (pages, state)
            req.context = req.context[:cached]
        else:
            log.info("request %s: offloaded KV incomplete in the host tier; resuming by recompute", req.request_id)

    def _make_room(self, reqs: list[Request], plan: StepPlan) -> list[Request]:
        """Pages for the token each request is about to write, preempting the most recently
        admitted requests of a rank when its pool is short.  Returns the requests that decode this
        step (grouped by rank)."""
        out = []
        for rank in range(self.ranks):
            out += self._make_room_on(self.managers[rank], [r for r in reqs if r.rank == rank], plan)
        return out

    def _make_room_on(self, manager: PagedKVManager, reqs: list[Request], plan: StepPlan) -> list[Request]:
        reqs = list(reqs)
        need = self.pages_short
        # A request admitted in this plan has no KV in the pools until the plan runs (a resumed
        # one's is installed then): it is never a victim now; short of pages, it decodes next step.
        fresh = {id(a.request) for a in plan.admitted}
        newest = lambda rs: max(rs, key=lambda r: r.admitted_s or 0.0)
        while reqs and need(reqs) > manager.page_pool.num_free:
            movable = [r for r in reqs if id(r) not in fresh]
            if not movable:
                reqs.remove(newest(reqs))
                continue
            victim = newest(movable)
            reqs.remove(victim)
            if not reqs and need([victim]) > manager.page_pool.num_free + len(
                manager.requests[victim.request_id].page_table
            ):
                self.running.remove(victim)
                self.release(victim, error="out of KV capacity")
                plan.failed.append((victim, "out of KV capacity"))
                return []
            plan.preempted.append(self._preempt(victim))
        for r in reqs:
            manager.extend(r.request_id, self.decode_reach(r))
        return reqs

    def decode_reach(self, req: Request, extra: int = 0) -> int:
        """Tokens `req`'s pages must hold for its next decode step: its cached tokens, the token it
        writes, and the drafts a verify pass writes after it (plus `extra`: the tokens a step
        still in flight may add before it)."""
        return req.kv_len + 1 + self.config.lookahead_tokens + extra

    def pages_short(self, reqs: list[Request], extra: int = 0) -> int:
        """New pages `reqs` need for their next decode step (`decode_reach`)."""
        return sum(
            max(
                0,
                self.manager_of(r).pages_needed(self.decode_reach(r, extra))
                - len(self.manager_of(r).requests[r.request_id].page_table),
            )
            for r in reqs
        )

    def _preempt(self, req: Request) -> Preemption:
        """Free a running request's pages and slot and queue it first to resume.  With a host
        tier its KV is to be offloaded (the engine writes it before the step runs, while the
        freed pages still hold it); recomputing prompt + output is the last resort."""
        self.preemptions += 1
        self.running.remove(req)
        req.context = list(req.prompt) + list(req.output)
        keys, manager = None, self.manager_of(req)
        if manager.host is not None and self.config.offload_preempted and req.kv_len == len(req.context) - 1:
            tag = f"{req.request_id}/{self.preemptions}"
            n_pages = -(-req.kv_len // self.config.page_tokens)
            keys = tuple(
                make_key(
                    manager.spec.namespace, "preempt", hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest()
                )
                for i in range(n_pages + 1)
            )
        table = tuple(manager.requests[req.request_id].page_table)
        out = Preemption(req, table, req.slot, req.kv_len, keys, req.rank)
        manager.finish(req.request_id)
        if req.extra_pages:
            manager.page_pool.free(req.extra_pages)
        req.extra_pages, req.draft_table, req.draft_pending = [], None, 0
        self._free_slot(req)
        req.planned_len, req.kv_len = 0, 0
        self.waiting.insert(0, req)
        return out

    def _plan_prefill(self, req: Request, budget_tokens: int) -> PrefillChunk | None:
        """The next chunk of `req` (at most `budget_tokens`), or None when the budget left is below
        one sharded span.  Advances the request's bookkeeping."""
        cfg = self.config
        start, ctx = req.planned_len, req.context
        end = min(len(ctx), start + cfg.prefill_chunk_tokens, start + budget_tokens)
        if req.images is not None and start < len(req.prompt) < end:
            # Placeholders take image rows only inside the prompt (a recompute after preemption
            # may include generated <|image|> ids, which decode embedded as plain tokens).
            end = len(req.prompt)
        tp = cfg.sharded_prefill
        export: list[int] = []
        if tp is not None and len(ctx) - start >= tp:
            if req.snapshots_due and req.snapshots_due[0] < end:
                end = req.snapshots_due[0]  # end the chunk where a KDA snapshot is due
            # Sharded: tp * 2^k tokens.  `start` is a multiple of tp here (hits and boundaries are
            # page multiples, tp divides the page, every earlier chunk was a tp multiple).
            spans = (end - start) // tp
            if spans == 0:
                return None
            end = start + tp * (1 << (spans.bit_length() - 1))
            sharded = True
        else:
            # With a prefill mesh this is only the prompt's last < tp tokens, unsharded.
            end, export = self.plan_chunk(start, end, req.snapshots_due)
            sharded = False
        for boundary in export:
            req.snapshots_due.remove(boundary)
        at_end = bool(req.snapshots_due) and req.snapshots_due[0] == end
        if at_end:
            req.snapshots_due.pop(0)
        req.planned_len = end
        return PrefillChunk(req, start, end, tuple(export), at_end, sharded)

    def plan_chunk(self, start: int, end: int, boundaries: list[int]) -> tuple[int, list[int]]:
        """The end of an unsharded prefill chunk from `start` (at most `end`), and the snapshot
        boundaries strictly inside it, which its pass exports (`export_at`).

        A chunk runs padded to one of a few compiled lengths (`serving.model_runner.prefill_buckets`),
        so any length does.  A boundary inside the chunk is exported where the KDA pass produces
        its state, at a multiple of the KDA chunk from `start`, and only up to `export_slots` of
        them; any other boundary ends the chunk there instead (its state is then the slot row
        after the pass), as every boundary does with `snapshots="align"`."""
        unit = self.config.kda_chunk_tokens
        slots = self.config.export_slots if self.config.snapshots == "in_pass" else 0
        while True:
            inside = [b for b in boundaries if start < b < end]
            not_exportable = [b for b in inside if (b - start) % unit]
            if not_exportable:
                end = not_exportable[0]
            elif len(inside) > slots:
                end = inside[slots]
            else:
                return end, inside

    # ---- updates from the engine -------------------------------------------------------------------
    def update_from_output(self, out) -> None:
        """Apply an executed step's output (`serving.executor.StepOutput`) in order: each token to
        its request while it still runs (a request that ended, by EOS, max_new_tokens or
        cancellation, drops the rest), then the requests a prefill engine handed over released."""
        for req, token, mixed, logprobs in out.tokens:
            if not req.done and req in self.running:
                self.emit(req, token, mixed, logprobs=logprobs)
        for req in out.handed_over:
            if req in self.running:
                self.running.remove(req)
                self.release(req)

    def emit(self, req: Request, token: int, mixed: bool = False, logprobs=None) -> None:
        """A new token of a running request (mixed: its step also ran prefill chunks; logprobs: its
        `serving.sampling.TokenLogprobs` when the request asked for them, None where they are not
        known here, e.g. a handed-over first token); finishes it at max_new_tokens or EOS."""
        req.output.append(token)
        if req.sampling.logprobs is not None:
            req.logprobs.append(logprobs)
        req.token_times_s.append(time.monotonic())
        req.token_mixed.append(mixed)
        if len(req.output) >= req.max_new_tokens or (req.stop_at_eos and token == self.config.eos_id):
            self.running.remove(req)
            self.release(req)

    def release(self, req: Request, error: str | None = None) -> None:
        """Free a request's blocks and slot (publishing its KV to the host tier if asked) and
        move it to `finished`."""
        if req.offload_keys is not None:  # cancelled while preempted: drop its offloaded KV
            self.manager.host.remove(req.offload_keys)
            req.offload_keys = None
        manager = self.manager_of(req)
        if req.request_id in manager.requests:
            if self.publish_to_host and error is None:
                manager.publish_to_host(req.request_id)
            manager.finish(req.request_id)
        if req.extra_pages:
            manager.page_pool.free(req.extra_pages)
            req.extra_pages = []
        self._free_slot(req)
        req.done, req.error = True, error
        self.finished.append(req)

    def cancel(self, request_id: str) -> bool:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self.release(req, error="cancelled")
                    return True
        return False
