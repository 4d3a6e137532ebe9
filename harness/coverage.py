"""Cache coverage harness: how much reusable history each cache tier serves.

Replays the seeded multi-turn agent workload across several engine instances
behind a load-balancing router (least outstanding work, no session affinity:
a session's turns land on whichever engine is free) through the real
`PagedKVManager`, pools and host tiers, in three configurations:

1. ``gpu``: each engine's GPU page pool only;
2. ``host``: plus each engine's own host-memory offload tier (embedded);
3. ``shared``: plus one Mooncake Store shared by every engine.

KV contents are random bytes of the right size (this measures the cache, not
the model).  Sizes: each engine's GPU pool holds about half of its share of
the working set (the distinct pages of all sessions' final histories divided
by the number of engines), never less than the largest single request; the
local host tier holds about that share again; the shared store holds it all.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from cache.block_pool import NoFreeBlocks
from cache.host_tier import EmbeddedHostKVTier, HostKVTier, entry_size
from cache.manager import ArrayBlockStore, CacheSpec, PagedKVManager
from kimik3.config import ModelConfig
from serving.workload import WorkloadSpec, generate_sessions, interleave

log = logging.getLogger(__name__)
CONFIGS = ("gpu", "host", "shared")


@dataclasses.dataclass(frozen=True)
class CoverageSpec:
    engines: int = 3
    page_tokens: int = 128
    kda_block_tokens: int = 1536
    gpu_fraction: float = 0.5  # of an engine's share of the working set
    host_fraction: float = 1.0
    seed: int = 0


@dataclasses.dataclass
class CoverageRow:
    config: str
    prompt_tokens: int
    hit_tokens_gpu: int
    hit_tokens_host: int
    bytes_offloaded: int
    bytes_loaded: int
    gpu_pages_per_engine: int
    turns: int

    @property
    def cache_rate(self) -> float:
        return (self.hit_tokens_gpu + self.hit_tokens_host) / max(1, self.prompt_tokens)


def _shapes(cfg: ModelConfig, page_tokens: int):
    n_mla = cfg.mixer_kinds.count("mla")
    n_kda = cfg.mixer_kinds.count("kda")
    page = (max(1, n_mla), page_tokens, cfg.mla_latent_dim)
    snap = (max(1, n_kda), cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim)
    return page, snap


def replay(
    cfg: ModelConfig,
    workload: WorkloadSpec,
    spec: CoverageSpec,
    config: str,
    shared_tier: HostKVTier | None = None,
    progress=None,
) -> CoverageRow:
    """Run the workload once in one configuration; returns its row."""
    turns = interleave(generate_sessions(workload))
    page_shape, snap_shape = _shapes(cfg, spec.page_tokens)
    dtype = np.dtype(cfg.dtype if cfg.dtype != "bfloat16" else "float16")  # bf16-sized bytes
    pages_of = lambda n: -(-n // spec.page_tokens)
    working_set = pages_of(sum(len(s[-1].prompt) + len(s[-1].output) for s in generate_sessions(workload)))
    largest = max(pages_of(len(t.prompt) + len(t.output)) for t in turns)
    gpu_pages = max(int(spec.gpu_fraction * working_set / spec.engines), largest + 2)
    snaps = max(8, gpu_pages // 4)
    page_bytes = entry_size(page_shape, dtype)
    snap_bytes = entry_size(snap_shape, np.float32)
    host_bytes = int(spec.host_fraction * working_set / spec.engines * (page_bytes + snap_bytes / 4)) + page_bytes
    rng = np.random.default_rng(spec.seed)
    junk_page = rng.integers(0, 255, page_shape).astype(dtype)
    junk_snap = rng.standard_normal(snap_shape).astype(np.float32)

    engines = []
    for _ in range(spec.engines):
        host = {"gpu": None, "host": EmbeddedHostKVTier(host_bytes), "shared": shared_tier}[config]
        engines.append(
            PagedKVManager(
                CacheSpec(f"{cfg.name}/{dtype.name}", spec.page_tokens, spec.kda_block_tokens),
                ArrayBlockStore(gpu_pages, page_shape, dtype),
                gpu_pages,
                ArrayBlockStore(snaps, snap_shape, np.float32),
                snaps,
                host,
            )
        )
    busy_until = [0.0] * spec.engines
    for i, turn in enumerate(turns):
        # Router: the engine that frees up first (least outstanding work); no session affinity.
        e = int(np.argmin([max(b, turn.arrival_s) for b in busy_until]))
        mgr = engines[e]
        rid = f"s{turn.session}t{turn.turn}"
        try:
            req = mgr.begin(rid, turn.prompt)
        except NoFreeBlocks:
            log.warning("turn %s does not fit engine %d; skipped", rid, e)
            continue
        new_pages = req.page_table[req.hit.tokens // spec.page_tokens :]
        mgr.pages.write(new_pages, [junk_page] * len(new_pages))
        mgr.commit_pages(rid, len(turn.prompt))
        for boundary in mgr.snapshot_boundaries(rid):
            mgr.commit_snapshot(rid, boundary, junk_snap)
        mgr.extend(rid, len(turn.prompt) + len(turn.output))
        mgr.finish(rid)
        # Prefill of the missed tokens plus decode dominates the turn's duration.
        busy_until[e] = (
            max(busy_until[e], turn.arrival_s) + 1e-4 * (len(turn.prompt) - req.hit.tokens) + 0.02 * len(turn.output)
        )
        if progress is not None:
            progress(i + 1, len(turns))
    total = lambda f: sum(f(m.stats) for m in engines)
    return CoverageRow(
        config=config,
        prompt_tokens=total(lambda s: s.prompt_tokens),
        hit_tokens_gpu=total(lambda s: s.hit_tokens_gpu),
        hit_tokens_host=total(lambda s: s.hit_tokens_host),
        bytes_offloaded=total(lambda s: s.offloaded_pages) * page_bytes
        + total(lambda s: s.offloaded_snapshots) * snap_bytes,
        bytes_loaded=total(lambda s: s.loaded_pages) * page_bytes + total(lambda s: s.loaded_snapshots) * snap_bytes,
        gpu_pages_per_engine=gpu_pages,
        turns=len(turns),
    )


def format_table(rows: list[CoverageRow]) -> str:
    lines = [
        "| configuration | token cache rate | GPU-pool hit tokens | host-tier hit tokens | bytes offloaded | "
        "bytes loaded | GPU pages / engine |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.config} | {r.cache_rate:.1%} | {r.hit_tokens_gpu:,} | {r.hit_tokens_host:,} | "
            f"{r.bytes_offloaded:,} | {r.bytes_loaded:,} | {r.gpu_pages_per_engine} |"
        )
    return "\n".join(lines)


def plot(rows: list[CoverageRow], path: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays

    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    names = [r.config for r in rows]
    gpu = [r.hit_tokens_gpu / max(1, r.prompt_tokens) for r in rows]
    host = [r.hit_tokens_host / max(1, r.prompt_tokens) for r in rows]
    ax.bar(names, gpu, label="GPU pool")
    ax.bar(names, host, bottom=gpu, label="host tier")
    ax.set_ylabel("share of prompt tokens served from cache")
    ax.set_ylim(0, 1)
    ax.set_title("KV cache coverage by tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
