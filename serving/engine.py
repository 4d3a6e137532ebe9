"""The serving engine (thin): submit / adopt / cancel / stream, and a `step()` that is plan -> run -> update.

The pieces, as in vLLM V1:

* `serving.scheduler.Scheduler` plans each step (`schedule() -> StepPlan`): admissions with
  prefix hits, decode rows, prefill chunks with the KDA snapshot boundaries their pass exports,
  preemptions.  Pure Python over the `PagedKVManager`.
* `serving.model_runner.ModelRunner` owns every jitted program: prefill chunks (padded to a
  few lengths), the decode program (persistent buffers per power-of-two bucket, sampling on the
  device, async dispatch), the sharded steps on meshes, and the warm-up that compiles them.
* `serving.kv_pools.KVPools` owns the device pools (MLA pages, KDA slots, KDA snapshots) and
  moves state between them.
* `Engine.step()` asks the scheduler for a plan, executes it in order (offload the preempted,
  install the admitted, dispatch the decode rows, run the prefill chunks), and reports tokens
  back (`Scheduler.emit`).  In a decode-only phase (the same running requests, nothing
  waiting or prefilling, pages in hand) the next decode step is dispatched on the device's
  own sampled tokens before the host reads the previous step's (`_chain_decode`), so the
  GPU never waits on the host between steps.

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
from serving.model_runner import DecodeRows, ModelRunner, decode_logprobs
from serving.sampling import GREEDY, SamplingParams, TokenLogprobs, choose_token, logprobs_of
from serving.scheduler import PrefillChunk, Request, Scheduler, SchedulerConfig, StepPlan

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "Request", "check_cache_salt", "check_handoff"]

_FAILED = object()  # what `Engine._isolated` returns for work that failed its request

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
        # (requests, DecodeRows or a speculative round's record (`SpecDecoder.dispatch`), device
        # tokens, dispatch id, mixed) of a decode step not yet read
        self._inflight = None
        self._ids = itertools.count()
        # where the steps' wall time goes, by kind (host work against waiting on the device)
        self.profile = StepProfile()
        self._wait_s = 0.0  # this step's wait on the device so far (`_wait_for`)

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
        return self.kvs[req._rank]

    def manager_of(self, req: Request) -> PagedKVManager:
        return self.managers[req._rank]

    def _prefill_lengths(self):
        return self.runner.prefill_lengths()

    def _decode_bucket(self, n: int) -> int:
        return self.runner.decode_bucket(n)

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

    def _isolated(self, req: Request, fn, *args, **kw):
        """fn(*args, **kw), a piece of `req`'s own host-side work inside a step: its result, or
        `_FAILED` when it raised (then `req` has failed alone: `fail_request`)."""
        try:
            return fn(*args, **kw)
        except Exception as err:  # noqa: BLE001 - the request's failure is the request's
            self.fail_request(req, err)
            return _FAILED

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
        self._settle_decode()  # the last step's tokens, if it left them in flight
        return self.finished

    def _programs(self) -> int:
        return self.runner.programs() + (self.spec.programs() if self.spec is not None else 0)

    def warmup(self, threads: int | None = None, sampled: bool = False) -> int:
        """Compile every step shape this engine can use and run each once on scratch rows
        (`ModelRunner.warmup`; `sampled`: the decode steps' sampling variant too), and the page and
        snapshot moves (`KVPools.warm_moves`).  Returns the number of new step programs."""
        self._settle_decode()
        before = self._programs()  # the speculative warm-up's row writes count in the runner's programs
        self.runner.warmup(self.kvs, max_pages=self.max_pages, null_page=NULL_BLOCK, threads=threads, sampled=sampled)
        for kv in self.kvs:  # the page and snapshot moves (offloads, host-tier loads, P/D handoffs)
            kv.warm_moves(self.max_pages)
        if self.spec is not None:
            self.spec.warmup(self)
        return self._programs() - before

    def step(self) -> None:
        t0, self._wait_s = time.perf_counter(), 0.0
        if self._chainable():  # a decode-only phase: step n+1 goes out before step n's tokens are read
            self._chain_decode()
            kind = "chained"
        else:
            self._settle_decode()
            plan = self.scheduler.schedule()
            before = self._programs()
            self._execute(plan)
            self.compiles += self._programs() - before  # new XLA programs this step needed
            if plan.tokens:
                self.step_tokens.append(plan.tokens)
            kind = ("mixed" if plan.prefill else "decode") if plan.decode else "prefill" if plan.prefill else "idle"
        self.profile.add(kind, time.perf_counter() - t0 - self._wait_s, self._wait_s)

    def _execute(self, plan: StepPlan) -> None:
        for p in plan.preempted:  # their freed pages still hold their KV until this step runs
            if p.offload_keys is not None:
                pages, state = self.kvs[p.rank].read_kv(list(p.page_table), p.cached_len, p.slot)
                if all(self.manager.host.batch_put(list(p.offload_keys), pages + [state])):
                    p.request._offload_keys = list(p.offload_keys)
                else:
                    self.manager.host.remove(list(p.offload_keys))
        for a in plan.admitted:
            if a.resume_kv is not None:
                self._install_kv(a.request, a.blocks, *a.resume_kv)
            else:
                self.kv_of(a.request).restore_state(a.request._slot, a.blocks.snapshot_block)
            a.restored(self.manager_of(a.request))
            if self.spec is not None:
                self._isolated(a.request, self.spec.on_admit, self, a.request, a.blocks)
        decode = [r for r in plan.decode if not r.done]  # less any that failed alone above
        if decode or self.group:  # a group's engines decode together, with padding rows if idle
            self._decode(decode, mixed=bool(plan.prefill))
        batches: dict[tuple[int, int], list[PrefillChunk]] = {}
        for chunk in plan.prefill:
            if chunk.request.done:  # failed alone earlier in this step
                continue
            if chunk.sharded and self.config.prefill_batch > 1:  # run below, with the rank's others of its length
                batches.setdefault((chunk.request._rank, chunk.tokens), []).append(chunk)
            else:
                self._run_chunk(chunk)
        for chunks in batches.values():
            for i in range(0, len(chunks), self.config.prefill_batch):
                self._run_sharded_batch(chunks[i : i + self.config.prefill_batch])
        if not plan.decode_only:  # read this step's decode tokens now (no step is chained on them)
            self._settle_decode()

    # ---- prefill ---------------------------------------------------------------------------------
    def _run_chunk(self, chunk: PrefillChunk) -> None:
        req, start, end = chunk.request, chunk.start, chunk.end
        ctx = req._context
        tokens = np.asarray([ctx[start:end]], np.int32)
        images = None
        if req.images is not None and start < len(req.prompt) and tokenizer.IMAGE_ID in ctx[start:end]:
            if req._image_rows is None:  # the ViT runs once per request, at its first image chunk
                rows = self._isolated(req, self.image_rows, req)
                if rows is _FAILED:
                    return
                req._image_rows = rows
            # this chunk's placeholders take the rows after those of earlier chunks
            images = {"rows": req._image_rows, "first": jnp.int32(ctx[:start].count(tokenizer.IMAGE_ID))}
        step = self.runner.prefill_step if chunk.sharded else None
        logits, exports, *tapped = self.runner.forward(
            self.kv_of(req),
            tokens,
            [self._table(req)],
            [req._slot],
            [start],
            step=step,
            images=images,
            export_offsets=[b - start for b in chunk.export],
        )
        if (
            self.spec is not None
            and self._isolated(req, self.spec.after_chunk, self, req, start, end, tapped[0]) is _FAILED
        ):
            return
        self._chunk_done(chunk, self._last_logits(chunk.last, logits)[0], exports)

    def _run_sharded_batch(self, chunks: list[PrefillChunk]) -> None:
        """Sharded chunks of one rank and one length as one call on the prefill mesh, padded to a
        power of two with rows of the scratch slot and null pages (which write only those)."""
        pad = (1 << (len(chunks) - 1).bit_length()) - len(chunks)
        reqs = [c.request for c in chunks]
        tokens = np.asarray(
            [r._context[c.start : c.end] for r, c in zip(reqs, chunks)] + [[0] * chunks[0].tokens] * pad, np.int32
        )
        tables = [self._table(r) for r in reqs] + [[NULL_BLOCK] * self.max_pages] * pad
        slots = [r._slot for r in reqs] + [self.scratch_slot] * pad
        starts = [c.start for c in chunks] + [0] * pad
        logits, _ = self.runner.forward(
            self.kv_of(reqs[0]), tokens, tables, slots, starts, step=self.runner.prefill_step
        )
        self.prefill_batches[len(chunks)] += 1
        for chunk, row in zip(chunks, self._last_logits(any(c.last for c in chunks), logits)):
            self._chunk_done(chunk, row, None)

    def _last_logits(self, needed: bool, logits):
        """A prefill call's last-position logits ([B, 1, V] on the device) as numpy f32 [B, V] where
        a chunk ends its prompt (its first token is chosen from them: the wait counts as the
        device's), else [None] * B: an intermediate chunk's logits are never read, so the host goes
        on while the device computes it."""
        if not needed:
            return [None] * logits.shape[0]
        self._wait_for(logits)
        return np.asarray(logits, np.float32)[:, -1]

    def _chunk_done(self, chunk: PrefillChunk, logits_v, exports) -> None:
        """A chunk's KV is in the pools: publish its pages and snapshots, and with the last chunk
        choose the request's first token (logits_v f32 [V]: its last position's; None unless last)."""
        req, end = chunk.request, chunk.end
        kv, manager = self.kv_of(req), self.manager_of(req)
        manager.commit_pages(req.request_id, end)
        blocks = manager.requests[req.request_id]  # each commit publishes the checkpoint block
        for i, boundary in enumerate(chunk.export):  # and gives the request a fresh one: re-read it
            kv.save_export(exports, i, blocks.checkpoint_block)
            manager.commit_snapshot(req.request_id, boundary)
        if chunk.snapshot_at_end:
            kv.save_state(req._slot, blocks.checkpoint_block)
            manager.commit_snapshot(req.request_id, end)
        if chunk.last:
            req._cached_len = end
            self._isolated(req, self._first_token, req, logits_v)

    def _first_token(self, req: Request, logits_v) -> None:
        """Choose a prefilled request's first token from its last position's logits (f32 [V]) and
        emit it, or (a prefill engine with `on_prefilled`) hand the request over with it."""
        token, lp = self._choose(req, logits_v)
        if self.role == "prefill" and self.on_prefilled is not None:
            req.output.append(token)
            req.token_times_s.append(time.monotonic())
            req.token_mixed.append(True)
            if req.sampling.logprobs is not None:
                req.logprobs.append(lp)
            if self.spec is not None:
                self.spec.write_last_slot(self, req, token)
            self.on_prefilled(self, req)  # hands the KV over while this engine still holds it
            self.running.remove(req)
            self.scheduler.release(req)
        else:
            self.scheduler.emit(req, token, mixed=True, logprobs=lp)

    # ---- decode ----------------------------------------------------------------------------------
    def _decode(self, reqs: list[Request], mixed: bool = False) -> None:
        """Dispatch one token for each of `reqs` (pages already extended by the scheduler); mixed:
        the step also runs prefill chunks (metrics split TPOT by it)."""
        if self.spec is not None:  # a verify round, read by the next step (or at this one's end)
            rnd = self.spec.dispatch(self, reqs)
            self._inflight = (reqs, rnd, rnd["out"], rnd["id"], mixed)
            return
        if self.runner.decode_step is not None:  # a decode mesh: every rank on its own pools, synchronous
            self._decode_ranks(reqs, mixed)
            return
        try:
            rows = self._decode_rows(reqs, [r.output[-1] for r in reqs])
        except Exception:  # noqa: BLE001 - a row that cannot be built fails its request alone
            reqs = [r for r in reqs if self._isolated(r, self._decode_rows, [r], [r.output[-1]]) is not _FAILED]
            if not reqs:
                return
            rows = self._decode_rows(reqs, [r.output[-1] for r in reqs])
        # the penalties count the output before the step's input token (output[-1]: the step counts it)
        self.pools, tokens, did, lp = self.runner.decode.dispatch(
            self.params, self.pools, rows, histories=self._histories(reqs, chained=False)
        )
        for r in reqs:
            r._cached_len += 1
        self._inflight = (reqs, rows, (tokens, lp), did, mixed)  # read by the next step (or at this one's end)

    def _decode_ranks(self, reqs: list[Request], mixed: bool) -> None:
        """One decode-mesh step: each rank's requests in its block of `rank_rows` rows, padded with
        rows of its scratch slot and null pages (ids in its own pools)."""
        per_rank = [[r for r in reqs if r._rank == k] for k in range(len(self.kvs))]
        n = max(map(len, per_rank))
        if self.group:  # every rank of the group runs the fullest rank's rows
            from sharding.distributed import agree_max

            (n,) = agree_max([n])
        if n == 0:
            return
        b = self.runner.rank_rows(n)
        tokens, tables, slots, lengths, where = [], [], [], [], []
        for k, rs in enumerate(per_rank):
            pad = b - len(rs)
            tokens += [[r.output[-1]] for r in rs] + [[0]] * pad
            tables += [self._table(r) for r in rs] + [[NULL_BLOCK] * self.max_pages] * pad
            slots += [r._slot for r in rs] + [self.scratch_slot] * pad  # padding rows share the scratch slot
            lengths += [r._cached_len for r in rs] + [0] * pad
            where += [(r, k * b + i) for i, r in enumerate(rs)]
        # greedy rows without penalties or logprobs need only the argmax the devices took
        plain = lambda r: r.sampling.greedy and not r.sampling.penalized and r.sampling.logprobs is None
        greedy, logits = self.runner.decode_ranks(
            self.kvs,
            np.asarray(tokens, np.int32),
            np.asarray(tables, np.int32),
            np.asarray(slots, np.int32),
            np.asarray(lengths, np.int32),
            logits=not all(plain(r) for r, _ in where),
        )
        for r, row in where:
            r._cached_len += 1
            if plain(r):
                self.scheduler.emit(r, int(greedy[row]), mixed)
            else:
                self._isolated(r, self._emit_chosen, r, logits[row], mixed)

    def _emit_chosen(self, req: Request, logits_v, mixed: bool) -> None:
        token, lp = self._choose(req, logits_v)
        self.scheduler.emit(req, token, mixed, logprobs=lp)

    def _chainable(self) -> bool:
        """Whether the next step may be dispatched on the in-flight step's device tokens: the same
        requests, none of which can reach max_new_tokens with the in-flight step's tokens (1, or a
        round's up to k + 1), nothing waiting that a free slot could admit, and pages for the next
        step's reach without preempting.  Requests waiting while every slot is taken do not stop
        the chain: `Scheduler._admit` needs a free slot, and one frees only when a running request
        ends, which breaks the chain (done, or at its max_new_tokens) before its next step."""
        if self._inflight is None or (self.waiting and self.scheduler.free_slots):
            return False
        reqs = self._inflight[0]
        if len(reqs) != len(self.running) or set(map(id, reqs)) != set(map(id, self.running)):
            return False
        if any(r.done or len(r.output) + self._flight_tokens >= r.max_new_tokens for r in reqs):
            return False
        extra = self._flight_tokens if self.spec is not None else 0  # plain: _cached_len counts it
        return self.scheduler.fits(reqs, extra)

    @property
    def _flight_tokens(self) -> int:
        """The most tokens a request may gain from the decode step in flight."""
        return 1 + (self.spec.k if self.spec is not None else 0)

    def _chain_decode(self) -> None:
        reqs = self._inflight[0]
        if self.spec is not None:  # the round in flight may add k + 1 tokens before this one's
            for r in reqs:
                self.manager_of(r).extend(r.request_id, self.scheduler.decode_reach(r, self._flight_tokens))
            before = self._programs()
            rnd = self.spec.dispatch(self, reqs, chained=True)
            self.compiles += self._programs() - before
            previous, self._inflight = self._inflight, (reqs, rnd, rnd["out"], rnd["id"], False)
            self._resolve_decode(previous, successor=rnd)
            self.step_tokens.append(len(reqs) * self._flight_tokens)  # each row verifies 1 + k tokens
            return
        for r in reqs:
            self.manager_of(r).extend(r.request_id, r._cached_len + 1)
        rows = self._decode_rows(reqs, tokens=[0] * len(reqs))  # tokens: the device's, from the step in flight
        before = self.runner.programs()
        # the input token is the in-flight step's: the whole output so far comes before it
        self.pools, tokens, did, lp = self.runner.decode.dispatch(
            self.params, self.pools, rows, tokens_on_device=True, histories=self._histories(reqs, chained=True)
        )
        self.compiles += self.runner.programs() - before
        for r in reqs:
            r._cached_len += 1
        previous, self._inflight = self._inflight, (reqs, rows, (tokens, lp), did, False)
        self._resolve_decode(previous)
        self.step_tokens.append(len(reqs))

    def _settle_decode(self) -> None:
        """Read the in-flight decode step's tokens, if any."""
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._resolve_decode(previous)

    def _resolve_decode(self, inflight, successor=None) -> None:
        """Emit a dispatched decode step's tokens (waits for them).  Requests that ended since it
        was dispatched (EOS the step before, cancellation) drop theirs."""
        reqs, rows, tokens, did, mixed = inflight
        self._wait_for(tokens)
        if self.spec is not None:  # rows: the round's record
            self.spec.resolve(self, rows, successor, mixed)
            return
        tokens, lp = tokens
        tokens = np.asarray(tokens)
        self.runner.decode.settle(rows, tokens, did)
        lps = decode_logprobs(rows, lp) if lp is not None else [None] * len(reqs)
        for r, token, entry in zip(reqs, tokens, lps):
            if not r.done and r in self.running:
                self._isolated(r, self.scheduler.emit, r, int(token), mixed, logprobs=entry)

    def _wait_for(self, arrays) -> None:
        """Block until `arrays` (a pytree) are computed, the time counted as this step's wait on
        the device (`metrics.StepProfile`), not its host work."""
        t0 = time.perf_counter()
        jax.block_until_ready(arrays)
        self._wait_s += time.perf_counter() - t0

    @staticmethod
    def _histories(reqs: list[Request], *, chained: bool):
        """Per request with penalties, (its record, how many tokens it generated before the step's
        input token, a function giving them) (`DecodeRunner.dispatch`; the list is built only when
        the slot's counts must be rewritten): all of them when the input is the in-flight step's
        token, all but the last otherwise."""

        def entry(r):
            n = r.prior_output + len(r.output) - (0 if chained else 1)
            return r, n, lambda: r.generated()[:n]

        return [entry(r) if r.sampling.penalized else None for r in reqs]

    def _decode_rows(self, reqs: list[Request], tokens: list[int]) -> DecodeRows:
        return DecodeRows.build(
            self._decode_bucket(len(reqs)),
            tokens,
            [self._table(r) for r in reqs],
            [r._slot for r in reqs],
            [r._cached_len for r in reqs],
            [r.sampling for r in reqs],
            max_pages=self.max_pages,
            null_page=NULL_BLOCK,
            scratch_slot=self.scratch_slot,
        )

    # ---- KV in and out (P/D handoff, offload) -------------------------------------------------------
    def _install_kv(self, req: Request, blocks, pages: list[np.ndarray], state: np.ndarray) -> None:
        """Write a request's page contents (those not already shared through its prefix hit) and
        its KDA state after `len(req._context)` tokens into the pools and its slot."""
        first_new = blocks.hit.tokens // self.page_tokens  # hit pages are shared: never written
        new_pages = blocks.page_table[first_new : len(pages)]
        kv = self.kv_of(req)
        if new_pages:
            kv.pages.write(new_pages, pages[first_new : first_new + len(new_pages)])
        self.manager_of(req).commit_pages(req.request_id, len(req._context))
        kv.write_snapshot(blocks.checkpoint_block, state)
        kv.restore_state(req._slot, blocks.checkpoint_block)

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
            req._context = list(prompt)
            self._install_kv(req, blocks, pages, state)
            req._computed = req._cached_len = len(prompt)
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
        return self.kv_of(req).read_kv(table, len(req.prompt), req._slot)

    def export_draft_feature(self, req: Request) -> np.ndarray:
        """f32 [D]: the fused target feature of a prefilled request's last prompt slot, the draft
        row a speculative decode engine writes first (with the token after it)."""
        if self.spec is None:
            raise ValueError("this engine has no draft")
        return np.asarray(self.kv.dpools["pending"][req._slot, 0])

    def _table(self, req: Request) -> list[int]:
        table = self.manager_of(req).requests[req.request_id].page_table
        return table + [NULL_BLOCK] * (self.max_pages - len(table))

    @staticmethod
    def _choose(req: Request, logits_v: np.ndarray) -> tuple[int, TokenLogprobs | None]:
        """The next token of `req` (its absolute position seeds a sampled draw; its output so far
        counts for the penalties), and its logprobs if the request asked for them."""
        token = choose_token(
            logits_v, req.sampling, len(req.prompt) + len(req.output), req.generated() if req.sampling.penalized else ()
        )
        k = req.sampling.logprobs
        return token, None if k is None else logprobs_of(logits_v, token, k)
