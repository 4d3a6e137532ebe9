"""How an `Engine`'s pieces are built from its `EngineConfig`: the draft, the model runner, the
pools of each rank, their cache managers and the scheduler's config.  Every check a config or a
mesh can fail raises ValueError here, before anything is placed on a device.

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

import jax
import jax.numpy as jnp

from cache.manager import CacheSpec, PagedKVManager
from kimik3.config import ModelConfig
from kimik3.quant import formats as qformats
from serving import kv_pools
from serving.engine_config import EngineConfig
from serving.kv_pools import KVPools
from serving.model_runner import ModelRunner
from serving.scheduler import SchedulerConfig

__all__ = ["check_config", "export_slots", "managers", "model_runner", "namespace", "rank_pools", "scheduler_config"]


def check_config(config: EngineConfig, draft, mesh) -> EngineConfig:
    """`config` as a speculative engine runs it (unrolled layers), or ValueError where the draft
    and `draft_tokens` disagree or a draft meets a mesh."""
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
    return config


def export_slots(config: EngineConfig) -> int:
    """KDA states one unsharded prefill chunk can export in its own pass (`Scheduler.plan_chunk`):
    every KDA-block boundary inside it plus the prompt's last full page.  A fixed count, so the
    chunk programs keep one shape (`ModelRunner.export_at`)."""
    return config.prefill_chunk_tokens // config.kda_block_tokens + 2


def spec_decoder(draft, cfg: ModelConfig, config: EngineConfig, kernels: str):
    """The `SpecDecoder` of `draft` = (params, EagleConfig), or None without one."""
    if draft is None:
        return None
    from serving.spec_decode import SpecDecoder  # the drafter's programs load only where one runs

    return SpecDecoder(
        draft[0],
        draft[1],
        cfg,
        k=config.draft_tokens,
        tail=config.eagle_tail,
        kernels=kernels,
        page_tokens=config.page_tokens,
    )


def model_runner(params, cfg: ModelConfig, config: EngineConfig, mesh, kernels: str, spec) -> ModelRunner:
    runner = ModelRunner(
        params,
        cfg,
        kernels=kernels,
        role=config.role,
        mesh=mesh,
        dispatch=config.dispatch,
        num_slots=config.num_slots,
        page_tokens=config.page_tokens,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        max_step_tokens=config.step_tokens,
        export_slots=export_slots(config),
        scan_layers=config.scan_layers,
        taps=spec.taps if spec else (),
        prefill_batch=config.prefill_batch,
    )
    pre, cap = runner.prefill_step, config.prefill_tokens_while_decoding
    if pre is not None and cap is not None and cap < pre.size:
        raise ValueError(
            f"prefill_tokens_while_decoding ({cap}) is below tp={pre.size}: sharded "
            f"prefill chunks could never run beside decode rows"
        )
    return runner


def rank_pools(cfg: ModelConfig, config: EngineConfig, runner: ModelRunner, dtype) -> tuple[list[KVPools], bool]:
    """(the pools of each rank this process owns, whether it is one engine of a process group).

    Under DP decode each rank owns a share of the pools on its own device, and a manager over
    them (`sharding.rank_pools`); without a decode mesh there is one rank.  In a process group
    whose decode mesh spans every process (`sharding.distributed`), this engine owns its own
    devices' ranks and serves its own requests; the group's engines step together (each decode
    step is one program over the whole mesh)."""
    dec, devices, group = runner.decode_step, [None], False
    if dec is not None:
        from sharding import rank_pools as ranks  # sharding loads only where a mesh is given

        every = ranks.rank_devices(dec.mesh)
        devices = [every[r] for r in ranks.local_ranks(dec.mesh)]
        group = len(devices) < len(every)
        if not devices:
            raise ValueError("the decode mesh holds none of this process's devices")
    dp = len(devices)
    for name in ("num_pages", "num_snapshots"):
        if getattr(config, name) // dp < 2:
            raise ValueError(f"{name} ({getattr(config, name)}) leaves fewer than 2 per rank over dp={dp}")
    pools = [
        KVPools(
            cfg,
            num_pages=config.num_pages // dp,
            num_slots=config.num_slots // dp,
            num_snapshots=config.num_snapshots // dp,
            page_tokens=config.page_tokens,
            dtype=dtype,
            commit=bool(runner.prefill_step or dec),
            draft_tokens=config.draft_tokens,
            device=device,
        )
        for device in devices
    ]
    return pools, group


def namespace(cfg: ModelConfig, config: EngineConfig, params, spec) -> str:
    """The cache namespace of the blocks this engine stores: the model, its dtype and KV layout
    version (a store's blocks of an older packing are never read), its weights' quantization
    formats, and its draft (page blocks hold the draft's rows too)."""
    dtype = params["embed_vd"].dtype
    ns = config.namespace or f"{cfg.name}/{jnp.dtype(dtype).name}/kv{kv_pools.LAYOUT_VERSION}"
    if qformats.tree_formats(params):  # KV of quantized weights is not the unquantized model's
        ns += "/q-" + "+".join(qformats.tree_formats(params))
    if spec is not None:
        ns += f"/eagle-{spec.fingerprint}"
    return ns


def managers(cfg: ModelConfig, config: EngineConfig, pools: list[KVPools], host, ns: str) -> list[PagedKVManager]:
    """One cache manager per rank's pools, over one host tier (its entries are content-addressed:
    any rank may load them)."""
    spec, dp = CacheSpec(ns, config.page_tokens, config.kda_block_tokens), len(pools)
    return [
        PagedKVManager(spec, kv.pages, config.num_pages // dp, kv.snapshots, config.num_snapshots // dp, host)
        for kv in pools
    ]


def scheduler_config(cfg: ModelConfig, config: EngineConfig, runner: ModelRunner, spec) -> SchedulerConfig:
    pre = runner.prefill_step
    return SchedulerConfig(
        num_slots=config.num_slots,
        page_tokens=config.page_tokens,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        max_step_tokens=config.step_tokens,
        export_slots=export_slots(config),
        kda_chunk_tokens=cfg.kda_chunk_size,
        sharded_prefill=None if pre is None else pre.size,
        prefill_tokens_while_decoding=config.prefill_tokens_while_decoding,
        prefix_caching=config.prefix_caching,
        snapshots=config.kda_snapshots,
        lookahead_tokens=config.draft_tokens,
        drop_tail=spec is not None and config.eagle_tail == "drop",
        offload_preempted=spec is None,
        eos_id=config.eos_id,
    )


def pools_for_budget(
    cfg: ModelConfig, dtype, budget_bytes, fraction, page_tokens, num_slots, snapshots_per_slot, kw
) -> dict:
    """num_pages, num_slots and num_snapshots of pools in `budget_bytes` (None: `fraction` of the
    device's free memory, which a CPU does not report): slots and snapshots first, pages the
    rest (`Engine.from_memory_budget`; kw: its engine arguments, for the draft's rows)."""
    if budget_bytes is None:
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError("no device memory statistics here: pass budget_bytes")
        budget_bytes = int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    num_snapshots = num_slots * snapshots_per_slot
    k = kw["draft_tokens"] if "draft_tokens" in kw else getattr(kw.get("config"), "draft_tokens", 0)
    num_pages = kv_pools.pages_in_budget(
        cfg,
        dtype,
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
    return {"num_pages": int(num_pages), "num_slots": num_slots, "num_snapshots": num_snapshots}


def capacity(engine) -> dict:
    """What an engine's pools hold: tokens of KV, concurrent sessions, and the per-request
    checkpoint block's cost (`Engine.capacity`)."""
    page = kv_pools.bytes_per_page(engine.cfg, engine.page_tokens, engine.dtype, draft=engine.spec is not None)
    state = kv_pools.bytes_per_state(engine.cfg, engine.dtype)
    slot_extra = kv_pools.bytes_per_draft_slot(engine.cfg, engine.config.draft_tokens)
    ms = engine.managers
    n_pages = sum(m.page_pool.num_blocks - 1 for m in ms)  # each rank keeps a null page
    snaps = sum(m.snap_pool.num_blocks for m in ms)
    return {
        "kv_tokens": n_pages * engine.page_tokens,
        "pages": n_pages,
        "sessions": len(engine.scheduler.free_slots) + len(engine.running),
        "snapshots": snaps - len(ms),
        "ranks": len(ms),
        "page_bytes": page,
        "state_bytes": state,
        "checkpoint_block_bytes_per_request": state,
        "pool_bytes": (n_pages + len(ms)) * page
        + len(engine.kvs) * (engine.scratch_slot + 1) * (state + slot_extra)
        + snaps * state,
    }
