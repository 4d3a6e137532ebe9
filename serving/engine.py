"""The serving engine: submit / adopt / cancel / stream, and a `step()` that is plan -> execute -> update.

The pieces, as in vLLM V1:

* `serving.scheduler.Scheduler` plans each step (`schedule() -> StepPlan`): admissions with
  prefix hits, decode rows, prefill chunks with the KDA snapshot boundaries their pass exports,
  preemptions.  Pure Python over the `PagedKVManager`, no JAX.  It applies what a step
  produced (`update_from_output`): tokens, finished requests, handovers.
* `serving.executor.StepExecutor` executes a plan on the device (offload the preempted,
  install the admitted, dispatch the decode rows, run the prefill chunks) and returns a
  `StepOutput` record.
* `serving.model_runner.ModelRunner` owns every jitted program: prefill chunks (padded to a
  few lengths), the decode program (persistent buffers per power-of-two bucket, sampling on the
  device, async dispatch), the sharded steps on meshes, and the warm-up that compiles them.
* `serving.kv_pools.KVPools` owns the device pools (MLA pages, KDA slots, KDA snapshots) and
  moves state between them.

In a decode-only phase (the same running requests, nothing waiting that could be admitted,
pages in hand) the scheduler plans the next decode step on the device's own sampled tokens
(`Scheduler.chain_plan`) and the executor dispatches it before the host reads the previous
step's, so the GPU never waits on the host between steps.

Configuration is one frozen `EngineConfig` (`serving.engine_config`); the host tier, the meshes and the P/D hook
(`on_prefilled`) are constructor arguments.

A request's failure is that request's: `submit` and `adopt` check everything a request brings
(ValueError) before it reaches a step, and inside a step each request's own host-side work
(choosing its token from logits on the host, its logprobs, its sampling row of a decode batch,
its images' encoder pass, the P/D hook, a draft's per-request bookkeeping) runs isolated: if it
raises, that request alone ends with `error` set and `fault` naming it as its own
(`fail_request`), and the step goes on for the others.  Only what a step runs for all its
requests together (the device programs, the pools' moves) raises out of `step()`: an engine fault.

On device meshes: `serving.engine_build` (how the pools, managers and ranks are laid out).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Callable, Sequence

import numpy as np

from cache.block_pool import NULL_BLOCK
from cache.host_tier import HostKVTier
from cache.media.l3 import EncoderCache
from cache.manager import PagedKVManager
from kimik3 import ops
from kimik3.config import ModelConfig
from serving import engine_build as build
from serving import kv_pools
from serving import request_checks as checks
from serving.engine_handoff import Handoff
from serving.engine_config import EngineConfig, check_cache_salt, check_handoff
from serving.image_rows import ImageRows
from serving.kv_pools import KVPools
from serving.metrics import StepProfile, record_of
from serving.executor import StepExecutor
from serving.sampling import GREEDY, SamplingParams
from serving.request import Request
from serving.scheduler import Scheduler

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "Request", "check_cache_salt", "check_handoff"]

# exceptions that mean a value the request carries could not be used (its fault "invalid")
_VALUE_ERRORS = (ValueError, TypeError, OverflowError, ArithmeticError)


class Engine(Handoff):
    def __init__(
        self,
        params,
        cfg: ModelConfig,
        config: EngineConfig | None = None,
        *,
        host: HostKVTier | None = None,
        mesh=None,
        on_prefilled: Callable[["Engine", Request], None] | None = None,
        draft=None,
        **overrides,
    ):
        """config: an `EngineConfig` (keyword `overrides` replace its fields; without one they build it).
        host: the host KV tier (embedded or Mooncake) behind the pools, or None.
        mesh: None (one device), or the mesh(es) the model steps run on: a `prefill_mesh` for role
        "prefill", a `decode_mesh` for role "decode", a pair (prefill_mesh, decode_mesh) for role
        "both" (either may be None).  on_prefilled: callable(engine, request) for role "prefill".
        draft: (draft params, `kimik3.eagle.EagleConfig`) of an EAGLE-3 head trained for these
        params (`kimik3.eagle_train.load_draft`), with config.draft_tokens = k > 0."""
        config = build.check_config(
            EngineConfig(**overrides) if config is None else config.replace(**overrides), draft, mesh
        )
        self.config, self.cfg, self.role, self.on_prefilled = config, cfg, config.role, on_prefilled
        self.dtype = params["embed_vd"].dtype
        self.page_tokens = config.page_tokens
        self.kernels = ops.resolve(config.kernels)
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self.max_step_tokens = config.step_tokens
        self.max_pages = config.max_pages_per_request or -(-cfg.max_seq_len // config.page_tokens)
        self.spec = build.spec_decoder(draft, cfg, config, self.kernels)
        self.runner = build.model_runner(params, cfg, config, mesh, self.kernels, self.spec)
        self.kvs, self.group = build.rank_pools(cfg, config, self.runner, self.dtype)
        self.kv = self.kvs[0]
        self.managers = build.managers(cfg, config, self.kvs, host, build.namespace(cfg, config, params, self.spec))
        self.manager = self.managers[0]
        self.scheduler = Scheduler(
            build.scheduler_config(cfg, config, self.runner, self.spec),
            self.managers,
            publish_to_host=config.publish_to_host,
        )
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes) if config.encoder_cache_bytes > 0 else None
        self.image_rows = ImageRows(self)
        self.compiles = 0
        # tokens each recent step ran (decode rows + prefill tokens); bounded for long-running servers
        self.step_tokens: collections.deque[int] = collections.deque(maxlen=4096)
        # sharded prefill calls by the requests they ran (`prefill_batch`)
        self.prefill_batches: collections.Counter[int] = collections.Counter()
        self.executor = StepExecutor(self, self.fail_request)
        self._ids = itertools.count()
        # where the steps' wall time goes, by kind (host work against waiting on the device)
        self.profile = StepProfile()

    # ---- views of the pieces (what callers and tests read) ------------------------------------------
    # `kv` and `manager` are rank 0's: the only rank without a decode mesh.  A request's own are
    # `kv_of(req)` / `manager_of(req)`.
    pools = property(lambda self: self.kv.pools, lambda self, v: setattr(self.kv, "pools", v))
    # What this engine runs: the runner's layout (`kimik3.stacked.serving_layout(scan=False)` unless
    # sharded).  Pass params already in that layout to share one copy between engines.
    params = property(lambda self: self.runner.params)
    pages = property(lambda self: self.kv.pages)
    snapshots = property(lambda self: self.kv.snapshots)
    snapshot_size = property(lambda self: self.kv.snapshot_size)
    scratch_slot = property(lambda self: self.kv.scratch_slot)
    mla_layers = property(lambda self: self.kv.mla_layers)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    finished = property(lambda self: self.scheduler.finished)
    preemptions = property(lambda self: self.scheduler.preemptions)
    offloaded_resumes = property(lambda self: self.scheduler.offloaded_resumes)
    recomputed_tokens = property(lambda self: self.scheduler.recomputed_tokens)
    _prefill_step = property(lambda self: self.runner.prefill_step)
    _decode_step = property(lambda self: self.runner.decode_step)

    def kv_of(self, req: Request) -> KVPools:
        return self.kvs[req.rank]

    def manager_of(self, req: Request) -> PagedKVManager:
        return self.managers[req.rank]

    def _prefill_lengths(self):
        return self.runner.prefill_lengths()

    def _decode_bucket(self, n: int) -> int:
        return self.runner.decode_bucket(n)

    def table_of(self, req: Request) -> list[int]:
        """`req`'s page table, padded with the null page to `max_pages`."""
        return self.executor.table_of(req)

    # ---- sizing --------------------------------------------------------------------------------------
    bytes_per_page = staticmethod(kv_pools.bytes_per_page)
    bytes_per_state = staticmethod(kv_pools.bytes_per_state)

    @classmethod
    def from_memory_budget(
        cls,
        params,
        cfg: ModelConfig,
        budget_bytes: int | None = None,
        *,
        fraction: float = 0.5,
        page_tokens: int = 128,
        num_slots: int = 8,
        snapshots_per_slot: int = 4,
        **kw,
    ) -> "Engine":
        """Size the pools from a byte budget (default: `fraction` of the device's free memory on
        GPU; required on CPU).  Slots and snapshots are carved out first, pages get the rest."""
        sizes = build.pools_for_budget(
            cfg, params["embed_vd"].dtype, budget_bytes, fraction, page_tokens, num_slots, snapshots_per_slot, kw
        )
        return cls(params, cfg, page_tokens=page_tokens, **sizes, **kw)

    def capacity(self) -> dict:
        """What the pools hold: tokens of KV, concurrent sessions, and the per-request
        checkpoint block's cost."""
        return build.capacity(self)

    # ---- requests ----------------------------------------------------------------------------------
    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        request_id: str | None = None,
        stop_at_eos: bool = False,
        sampling: SamplingParams = GREEDY,
        images=None,
        cache_salt: str | None = None,
        prior_output: int = 0,
    ) -> Request:
        """Queue a request.  Raises ValueError for a prompt the engine can never serve.
        `sampling`: greedy by default; temperature / top-p draws are seeded per position
        (serving.sampling), so preemption and handoffs do not change them.
        `images`: [N, S, S, C] (float in [0, 1] or uint8) for the prompt's N * tokens_per_image
        <|image|> placeholders; their content hashes enter the prefix-cache block hashes, so a
        prefix hit never crosses a different image.
        `cache_salt`: the tenant's salt (`check_cache_salt`): prefix hits only among requests that
        carry the same salt.
        `prior_output`: the prompt's last tokens are this many of the request's own earlier output
        (a continuation after a failover): the penalties count them."""
        prompt = checks.check_prompt(
            prompt, vocab_size=self.cfg.vocab_size, prior_output=prior_output, cache_salt=cache_salt
        )
        checks.check_max_new_tokens(max_new_tokens)
        # an <|image|> in the request's own output tail is one the model generated: a text token
        # (`model.splice_image_embeddings`), not a slot missing its image
        images, mm_items = self._check_images(prompt[: len(prompt) - prior_output], images)
        checks.check_sampling(sampling, speculative=self.spec is not None)
        total = len(prompt) + max_new_tokens + self.config.draft_tokens  # a verify pass writes k past the last
        # Beyond a rank's usable pages a request could never be admitted: refuse it now.
        usable_pages = self.manager.page_pool.num_blocks - 1
        limit = min(self.cfg.max_seq_len, min(self.max_pages, usable_pages) * self.page_tokens)
        if total > limit:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"context limit of {limit} tokens"
            )
        req = Request(
            request_id or f"req-{next(self._ids)}",
            prompt,
            max_new_tokens,
            stop_at_eos,
            sampling=sampling,
            images=images,
            mm_items=mm_items,
            cache_salt=cache_salt,
            prior_output=prior_output,
        )
        self.waiting.append(req)
        return req

    def _check_images(self, prompt: list[int], images) -> tuple[np.ndarray | None, tuple]:
        """(images as an array, one MMItem per image) for a prompt, or ValueError."""
        return checks.check_images(prompt, images, self.cfg, prefill_mesh=self.runner.prefill_step is not None)

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
        return self.scheduler.cancel(request_id)

    def fail_request(self, req: Request, err: BaseException) -> None:
        """End `req` alone because its own work raised `err`: out of the queues, its KV and slot
        freed, `error` set and `fault` "invalid" (a value it carries could not be used) or
        "request" (anything else of its own).  The engine and every other request go on."""
        if req.done:
            return
        req.fault = "invalid" if isinstance(err, _VALUE_ERRORS) else "request"
        log.warning("request %s failed alone (the engine goes on): %r", req.request_id, err, exc_info=err)
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        self.scheduler.release(req, error=f"the request failed: {type(err).__name__}: {err}")

    def load(self) -> dict:
        """What a router balances on: queue depth, running requests, free slots and pages, KV use."""
        total = sum(m.page_pool.num_blocks - 1 for m in self.managers)
        free = sum(m.page_pool.num_free for m in self.managers)
        free_slots = len(self.scheduler.free_slots)
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "free_slots": free_slots,
            "sessions": free_slots + len(self.running),
            "free_pages": free,
            "total_pages": total,
            "kv_use": (total - free) / total if total else 0.0,
            "preemptions": self.preemptions,
        }

    def pop_finished(self) -> list[Request]:
        """The requests finished since the last call (and forget them: a long-running server
        reads results here so `finished` does not grow without bound)."""
        done, self.scheduler.finished = self.scheduler.finished, []
        return done

    def records(self):
        """Metrics records of the finished requests (serving.metrics)."""
        return [record_of(r) for r in self.finished if r.error is None]

    # ---- the loop: plan -> run -> update ------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def group_has_work(self) -> bool:
        """`has_work` of any engine of the process group (a collective there: every engine of the
        group calls it together); this engine's own without a group."""
        if not self.group:
            return self.has_work()
        from sharding.distributed import agree_max  # loads only in a process group

        return bool(agree_max([int(self.has_work())])[0])

    def run(self, max_steps: int = 1_000_000) -> list[Request]:
        """Step until no request is left (in a process group: until no engine of the group has
        one, every engine stepping with the others)."""
        for _ in range(max_steps):
            if not self.group_has_work():
                break
            self.step()
        self.settle()  # the last step's tokens, if it left them in flight
        return self.finished

    def _programs(self) -> int:
        return self.runner.programs() + (self.spec.programs() if self.spec is not None else 0)

    def warmup(self, threads: int | None = None, sampled: bool = False) -> int:
        """Compile every step shape this engine can use and run each once on scratch rows
        (`ModelRunner.warmup`; `sampled`: the decode steps' sampling variant too), and the page and
        snapshot moves (`KVPools.warm_moves`).  Returns the number of new step programs."""
        self.settle()
        before = self._programs()  # the speculative warm-up's row writes count in the runner's programs
        self.runner.warmup(self.kvs, max_pages=self.max_pages, null_page=NULL_BLOCK, threads=threads, sampled=sampled)
        for kv in self.kvs:  # the page and snapshot moves (offloads, host-tier loads, P/D handoffs)
            kv.warm_moves(self.max_pages)
        if self.spec is not None:
            self.spec.warmup(self)
        return self._programs() - before

    def step(self) -> None:
        """One step: plan -> execute -> update.  In a decode-only phase the scheduler's plan is
        chained on the decode step still on the device (its tokens read after the next step is
        dispatched, so the device never waits on the host between steps); otherwise that step's
        tokens are applied first and the scheduler plans from them."""
        t0, self.executor.wait_s = time.perf_counter(), 0.0
        before = self._programs()
        plan = self.scheduler.chain_plan(self.executor.in_flight)
        if plan is None:
            self.scheduler.update_from_output(self.executor.settle())
            plan = self.scheduler.schedule()
        self.scheduler.update_from_output(self.executor.execute(plan))
        self.compiles += self._programs() - before  # new XLA programs this step needed
        if plan.tokens:
            self.step_tokens.append(plan.tokens)
        kind = (
            "chained"
            if plan.chained
            else ("mixed" if plan.prefill else "decode")
            if plan.decode
            else "prefill"
            if plan.prefill
            else "idle"
        )
        wait_s = self.executor.wait_s
        self.profile.add(kind, time.perf_counter() - t0 - wait_s, wait_s)

    def settle(self) -> None:
        """Read and apply the tokens of the decode step still on the device, if any."""
        self.scheduler.update_from_output(self.executor.settle())
