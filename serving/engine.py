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

On device meshes
----------------
``Engine(..., mesh=...)``:

* role "prefill": ``mesh=sharding.mesh.prefill_mesh(tp, ep, devices)``; prefill chunks run
  through `ShardedPrefill` (TP/SP attention, EP MoE; `sharding.paged.PagedStep`);
* role "decode": ``mesh=sharding.mesh.decode_mesh(dp, ep, devices)``; decode batches run
  through `sharding.decode.PagedDecode` (DP attention, EP MoE) over pools owned per rank;
* role "both": ``mesh=(prefill_mesh, decode_mesh)``; either may be None.

With a decode mesh each of its dp ranks owns a 1/dp share of ``num_pages``, ``num_slots``
and ``num_snapshots`` as pools of its own on its own device (`KVPools`, each with its null
page and scratch slot), and a `PagedKVManager` over them; the host tier is shared.  The
scheduler places a request on the rank already holding the longest run of its prefix (then
the one with the most free pages) and it stays there: its prefix hits, host-tier loads,
offloads, handoffs and prefill chunks touch only its rank's pools.  A decode step gives each
rank ``rank_rows`` rows (its requests, then padding rows of its scratch slot and null pages)
and runs every rank on its own pool in place; no step moves pool rows between devices.
A TP prefill chunk moves its request's rows from its rank's pools to the prefill mesh and
the new rows back (device to device); sharded chunks are ``tp * 2**k`` tokens (``tp`` must
divide ``page_tokens``), and the rest of a prompt, or every chunk without a prefill mesh,
runs unsharded on the rank's device, on a copy of the params placed there once.  A mesh that
does not fit the config or these sizes raises ValueError at construction.

Not yet production-like: a rank's unsharded chunks need the whole params on its device;
a prefill chunk is one request (B = 1); one process drives every device.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_hash import image_items
from cache.block_pool import NULL_BLOCK
from cache.host_tier import HostKVTier
from cache.media.l3 import EncoderCache
from cache.manager import CacheSpec, PagedKVManager
from kimik3 import model, ops, tokenizer
from kimik3.config import ModelConfig
from kimik3.quant import formats as qformats
from serving import kv_pools
from serving.engine_config import EngineConfig, check_cache_salt, check_handoff
from serving.image_rows import ImageRows
from serving.kv_pools import KVPools
from serving.metrics import StepProfile
from serving.executor import StepExecutor
from serving.model_runner import DecodeRows, ModelRunner
from serving.sampling import GREEDY, SamplingParams, TokenLogprobs
from serving.request import Request
from serving.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "Request", "check_cache_salt", "check_handoff"]

# exceptions that mean a value the request carries could not be used (its fault "invalid")
_VALUE_ERRORS = (ValueError, TypeError, OverflowError, ArithmeticError)


class Engine:
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
        config = EngineConfig(**overrides) if config is None else config.replace(**overrides)
        if (draft is None) != (config.draft_tokens == 0):
            raise ValueError(
                "speculative decoding needs both a draft (draft=(params, EagleConfig)) and "
                f"draft_tokens > 0; got draft={'given' if draft is not None else None}, "
                f"draft_tokens={config.draft_tokens}"
            )
        if draft is not None and mesh is not None:
            raise ValueError("speculative decoding runs on engines without a mesh for now")
        if draft is not None and config.scan_layers != "none":
            # the draft taps target layers, which must be unrolled (`kimik3.model.KimiK3.taps`)
            config = config.replace(scan_layers="none")
        self.config = config
        self.cfg = cfg
        self.role = config.role
        self.on_prefilled = on_prefilled
        self.dtype = params["embed_vd"].dtype
        self.page_tokens = config.page_tokens
        self.kernels = ops.resolve(config.kernels)
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self.max_step_tokens = config.step_tokens
        self.max_pages = config.max_pages_per_request or -(-cfg.max_seq_len // config.page_tokens)
        # KDA states one unsharded prefill chunk can export in its own pass (`Scheduler.plan_chunk`):
        # every KDA-block boundary inside it plus the prompt's last full page.  A fixed count, so the
        # chunk programs keep one shape (`ModelRunner.export_at`).
        export_slots = config.prefill_chunk_tokens // config.kda_block_tokens + 2
        self.spec = None
        if draft is not None:
            from serving.spec_decode import SpecDecoder

            self.spec = SpecDecoder(
                draft[0],
                draft[1],
                cfg,
                k=config.draft_tokens,
                tail=config.eagle_tail,
                kernels=self.kernels,
                page_tokens=config.page_tokens,
            )
        self.runner = ModelRunner(
            params,
            cfg,
            kernels=self.kernels,
            role=config.role,
            mesh=mesh,
            dispatch=config.dispatch,
            num_slots=config.num_slots,
            page_tokens=config.page_tokens,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            max_step_tokens=self.max_step_tokens,
            export_slots=export_slots,
            scan_layers=config.scan_layers,
            taps=self.spec.taps if self.spec else (),
            prefill_batch=config.prefill_batch,
        )
        pre = self.runner.prefill_step
        cap = config.prefill_tokens_while_decoding
        if pre is not None and cap is not None and cap < pre.size:
            raise ValueError(
                f"prefill_tokens_while_decoding ({cap}) is below tp={pre.size}: sharded "
                f"prefill chunks could never run beside decode rows"
            )
        # Under DP decode each rank owns a share of the pools on its own device, and a manager over
        # them (`sharding.rank_pools`); without a decode mesh there is one rank.
        # In a process group whose decode mesh spans every process (`sharding.distributed`), this
        # engine owns its own devices' ranks and serves its own requests; the group's engines step
        # together (`group`: each decode step is one program over the whole mesh).
        dec = self.runner.decode_step
        devices = [None]
        self.group = False
        if dec is not None:
            from sharding import rank_pools

            every = rank_pools.rank_devices(dec.mesh)
            devices = [every[r] for r in rank_pools.local_ranks(dec.mesh)]
            self.group = len(devices) < len(every)
            if not devices:
                raise ValueError("the decode mesh holds none of this process's devices")
        dp = len(devices)
        for name in ("num_pages", "num_snapshots"):
            if getattr(config, name) // dp < 2:
                raise ValueError(f"{name} ({getattr(config, name)}) leaves fewer than 2 per rank over dp={dp}")
        self.kvs = [
            KVPools(
                cfg,
                num_pages=config.num_pages // dp,
                num_slots=config.num_slots // dp,
                num_snapshots=config.num_snapshots // dp,
                page_tokens=config.page_tokens,
                dtype=self.dtype,
                commit=bool(pre or dec),
                draft_tokens=config.draft_tokens,
                device=device,
            )
            for device in devices
        ]
        self.kv = self.kvs[0]
        # the layout version keeps blocks a store kept for an older packing from ever being read
        ns = config.namespace or f"{cfg.name}/{jnp.dtype(self.dtype).name}/kv{kv_pools.LAYOUT_VERSION}"
        if qformats.tree_formats(params):  # KV of quantized weights is not the unquantized model's
            ns += "/q-" + "+".join(qformats.tree_formats(params))
        if self.spec is not None:  # its page blocks hold this draft's rows too
            ns += f"/eagle-{self.spec.fingerprint}"
        spec = CacheSpec(ns, config.page_tokens, config.kda_block_tokens)
        # one host tier for every rank: its entries are content-addressed, any rank may load them
        self.managers = [
            PagedKVManager(spec, kv.pages, config.num_pages // dp, kv.snapshots, config.num_snapshots // dp, host)
            for kv in self.kvs
        ]
        self.manager = self.managers[0]
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_slots=config.num_slots,
                page_tokens=config.page_tokens,
                prefill_chunk_tokens=config.prefill_chunk_tokens,
                max_step_tokens=self.max_step_tokens,
                export_slots=export_slots,
                kda_chunk_tokens=cfg.kda_chunk_size,
                sharded_prefill=None if pre is None else pre.size,
                prefill_tokens_while_decoding=config.prefill_tokens_while_decoding,
                prefix_caching=config.prefix_caching,
                snapshots=config.kda_snapshots,
                lookahead_tokens=config.draft_tokens,
                drop_tail=self.spec is not None and config.eagle_tail == "drop",
                offload_preempted=self.spec is None,
                eos_id=config.eos_id,
            ),
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
        if budget_bytes is None:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" not in stats:
                raise ValueError("no device memory statistics here: pass budget_bytes")
            budget_bytes = int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
        num_snapshots = num_slots * snapshots_per_slot
        k = kw["draft_tokens"] if "draft_tokens" in kw else getattr(kw.get("config"), "draft_tokens", 0)
        num_pages = kv_pools.pages_in_budget(
            cfg,
            params["embed_vd"].dtype,
            budget_bytes,
            num_slots=num_slots,
            num_snapshots=num_snapshots,
            page_tokens=page_tokens,
            draft_tokens=k,
        )
        if num_pages < 2:
            raise ValueError(
                f"a budget of {budget_bytes} bytes does not hold {num_slots} state slots, "
                f"{num_snapshots} snapshots and two pages"
            )
        return cls(
            params,
            cfg,
            num_pages=int(num_pages),
            num_slots=num_slots,
            num_snapshots=num_snapshots,
            page_tokens=page_tokens,
            **kw,
        )

    def capacity(self) -> dict:
        """What the pools hold: tokens of KV, concurrent sessions, and the per-request
        checkpoint block's cost."""
        page = self.bytes_per_page(self.cfg, self.page_tokens, self.dtype, draft=self.spec is not None)
        state = self.bytes_per_state(self.cfg, self.dtype)
        slot_extra = kv_pools.bytes_per_draft_slot(self.cfg, self.config.draft_tokens)
        n_pages = sum(m.page_pool.num_blocks - 1 for m in self.managers)  # each rank keeps a null page
        snaps = sum(m.snap_pool.num_blocks for m in self.managers)
        return {
            "kv_tokens": n_pages * self.page_tokens,
            "pages": n_pages,
            "sessions": len(self.scheduler.free_slots) + len(self.running),
            "snapshots": snaps - len(self.managers),
            "ranks": len(self.managers),
            "page_bytes": page,
            "state_bytes": state,
            "checkpoint_block_bytes_per_request": state,
            "pool_bytes": (n_pages + len(self.managers)) * page
            + len(self.kvs) * (self.scratch_slot + 1) * (state + slot_extra)
            + snaps * state,
        }

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
        check_cache_salt(cache_salt)
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a serving.sampling.SamplingParams; got {type(sampling).__name__}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
            raise ValueError(f"max_new_tokens must be an integer; got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
        if any(t < 0 or t >= self.cfg.vocab_size for t in prompt):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        if not (isinstance(prior_output, int) and 0 <= prior_output < len(prompt)):
            raise ValueError(
                f"prior_output must lie in [0, {len(prompt)}) (the prompt's own output tail); got {prior_output!r}"
            )
        # an <|image|> in the request's own output tail is one the model generated: a text token
        # (`model.splice_image_embeddings`), not a slot missing its image
        images, mm_items = self._check_images(prompt[: len(prompt) - prior_output], images)
        self._check_sampling(sampling)
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

    def _check_sampling(self, sampling: SamplingParams) -> None:
        """ValueError unless `sampling` becomes a decode row (the device's dtypes) and this engine
        serves it (a speculative engine: no filters, penalties or logprobs)."""
        try:
            DecodeRows.build(1, [0], [[]], [0], [0], [sampling], max_pages=1, null_page=0, scratch_slot=0)
        except (TypeError, OverflowError, ValueError) as err:
            raise ValueError(f"sampling parameters out of range: {err}") from None
        if self.spec is None:
            return
        if not sampling.greedy and (sampling.top_p < 1.0 or sampling.filtered):
            raise ValueError(
                "top_p < 1, top_k and min_p are not supported with speculative decoding (its acceptance "
                "rule keeps the full distribution at the temperature)"
            )
        if sampling.penalized or sampling.logprobs is not None:
            raise ValueError(
                "presence / frequency penalties and logprobs are not supported with speculative "
                "decoding (its verify pass scores drafts without them)"
            )

    def _check_images(self, prompt: list[int], images) -> tuple[np.ndarray | None, tuple]:
        """(images as an array, one MMItem per image) for a prompt, or ValueError."""
        if images is None and self.cfg.vit is None:  # no vision encoder: the placeholder's id is text
            return None, ()
        n_slots = prompt.count(tokenizer.IMAGE_ID)
        if images is None:
            if n_slots:
                raise ValueError(f"the prompt holds {n_slots} <|image|> placeholders but no images were given")
            return None, ()
        if self.runner.prefill_step is not None:
            raise ValueError("images on an engine with a prefill mesh are not supported yet")
        arr = np.asarray(model.check_images(images, np.asarray([prompt]), self.cfg))  # checks shape, count, values
        # hashed as given (the router hashes the uint8 pixels it sends the same way)
        return arr, image_items(prompt, np.asarray(images), self.cfg.vit.tokens_per_image, tokenizer.IMAGE_ID)

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
        from serving.metrics import RequestRecord

        return [
            RequestRecord(
                r.arrival_s,
                r.token_times_s,
                len(r.prompt),
                r.cached_tokens - r.cached_tokens_host,
                r.cached_tokens_host,
                r.admitted_s,
                r.token_mixed,
            )
            for r in self.finished
            if r.error is None
        ]

    # ---- the loop: plan -> run -> update ------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def group_has_work(self) -> bool:
        """`has_work` of any engine of the process group (a collective there: every engine of the
        group calls it together); this engine's own without a group."""
        if not self.group:
            return self.has_work()
        from sharding.distributed import agree_max

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

    def adopt(
        self,
        prompt: Sequence[int],
        first_token: int,
        max_new_tokens: int,
        pages: list[np.ndarray],
        state: np.ndarray,
        *,
        request_id: str,
        arrival_s: float,
        stop_at_eos: bool = False,
        sampling: SamplingParams = GREEDY,
        images=None,
        cache_salt: str | None = None,
        draft_feature: np.ndarray | None = None,
        first_logprobs: TokenLogprobs | None = None,
    ) -> Request | None:
        """Take over a request another engine prefilled (direct P/D handoff): its prompt's
        page contents and its KDA state after the whole prompt (and, for a speculative engine,
        its draft's rows in the pages and `draft_feature`, the fused target feature of the last
        prompt slot: `export_draft_feature`; with `sampling.logprobs`, the first token's
        `first_logprobs` when the caller has them).  None if it does not fit now."""
        check_cache_salt(cache_salt)
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a serving.sampling.SamplingParams; got {type(sampling).__name__}")
        self._check_sampling(sampling)
        if self.spec is None and draft_feature is not None:
            raise ValueError("a speculative handoff (with a draft feature) needs a decode engine with the same draft")
        if self.spec is not None:
            if draft_feature is None or np.shape(draft_feature) != (self.cfg.d_model,):
                raise ValueError(
                    f"a speculative engine adopts a handoff with its draft feature [{self.cfg.d_model}] "
                    "(from an engine with the same draft)"
                )
            if not np.isfinite(draft_feature).all():
                raise ValueError("the draft feature holds values that are not finite")
        check_handoff(
            list(prompt), first_token, pages, state, vocab_size=self.cfg.vocab_size, page_tokens=self.page_tokens
        )
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
        if not self.scheduler.free_slots:
            return None
        images, mm_items = self._check_images(list(prompt), images)
        req = Request(
            request_id,
            list(prompt),
            max_new_tokens,
            stop_at_eos,
            arrival_s=arrival_s,
            sampling=sampling,
            images=images,
            mm_items=mm_items,
            cache_salt=cache_salt,
        )
        # placed on a rank and given its blocks and slot there; the tail rule's drop applies to
        # handoffs too (exact: kept as written, as no_drop)
        blocks = self.scheduler.begin(req, list(prompt))
        if blocks is None:
            return None
        try:
            req.admitted_s = time.monotonic()
            req.cached_tokens = blocks.hit.tokens
            req.cached_tokens_host = blocks.hit.pages_host * self.page_tokens
            req.context = list(prompt)
            self.executor.install_kv(req, blocks, pages, state)
            req.planned_len = req.kv_len = len(prompt)
            if self.spec is not None:
                self.spec.adopted(self, req, draft_feature)
            self.running.append(req)
            self.scheduler.emit(req, first_token, logprobs=first_logprobs)
        except BaseException as err:  # its blocks and slot go back before the caller hears of it
            self.fail_request(req, err)
            raise
        return req

    def export_kv(self, req: Request) -> tuple[list[np.ndarray], np.ndarray]:
        """(prompt page contents, packed KDA state) of a request this engine holds."""
        table = self.manager_of(req).requests[req.request_id].page_table
        return self.kv_of(req).read_kv(table, len(req.prompt), req.slot)

    def export_draft_feature(self, req: Request) -> np.ndarray:
        """f32 [D]: the fused target feature of a prefilled request's last prompt slot, the draft
        row a speculative decode engine writes first (with the token after it)."""
        if self.spec is None:
            raise ValueError("this engine has no draft")
        return np.asarray(self.kv.dpools["pending"][req.slot, 0])
