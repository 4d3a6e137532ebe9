"""The demo's serving setups and one run of its workload through a setup (`run_mode`).

`DemoSpec` is the demo's workload and pools; `MODES` the setups built here, each on embedded
defaults (`build_server`): one engine without or with the embedded host tier, a prefill and a
decode engine handing KV over directly or through a shared host tier.  `run_mode` also runs a
setup built elsewhere (`engines=`: the Mooncake one, `harness.demo_store`).  The report over
every setup: `harness.demo`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax

from cache.host_tier import EmbeddedHostKVTier
from kimik3 import config, model
from kimik3 import quant_store as store
from serving import metrics
from serving.disagg import DisaggregatedServer
from serving.engine import Engine, EngineConfig
from serving.workload import WorkloadSpec, generate_sessions

log = logging.getLogger(__name__)
MODES = ("colocated", "colocated+host", "pd-direct", "pd-store")


@dataclasses.dataclass(frozen=True)
class DemoSpec:
    config: str = "tiny"
    sessions: int = 8
    turns: tuple[int, int] = (3, 4)
    scale: float = 32.0  # docs/design.md token counts divided by this
    page_tokens: int = 32
    kda_block_tokens: int = 128
    num_pages: int = 48  # below the sessions' histories: evictions, so the host tier has work
    burst_size: int = 8  # sessions arriving together
    num_slots: int = 4
    host_bytes: int = 256 << 20
    burst_every_steps: int = 40
    seed: int = 0
    checkpoint: str | None = None  # serve these weights (random ones from `seed` otherwise)
    manifest: str | None = None  # with a quantized checkpoint (`kimik3 quantize`): the manifest to load


def engine_config(spec: DemoSpec, max_pages: int) -> EngineConfig:
    """Every setup's engine configuration (roles and tiers apart)."""
    return EngineConfig(
        num_pages=spec.num_pages,
        num_slots=spec.num_slots,
        num_snapshots=spec.num_slots * 4,
        page_tokens=spec.page_tokens,
        kda_block_tokens=spec.kda_block_tokens,
        max_pages_per_request=max_pages,
        prefill_chunk_tokens=256,
    )


def build_server(params, cfg, spec: DemoSpec, mode: str, max_pages: int):
    """The server of setup `mode` (one of `MODES`): an `Engine`, or a `DisaggregatedServer`."""
    common = engine_config(spec, max_pages)
    if mode.startswith("colocated"):
        host = EmbeddedHostKVTier(spec.host_bytes) if mode.endswith("host") else None
        return Engine(params, cfg, common, host=host)
    host = EmbeddedHostKVTier(spec.host_bytes) if mode == "pd-store" else None
    prefill = Engine(params, cfg, common.replace(role="prefill"), host=host)
    decode = Engine(params, cfg, common.replace(role="decode"), host=host)
    return DisaggregatedServer(prefill, decode, "store" if mode == "pd-store" else "direct")


def workload(spec: DemoSpec):
    """The seeded sessions of `spec` (`serving.workload.generate_sessions`): each a list of turns."""
    return generate_sessions(
        WorkloadSpec.scaled(
            spec.scale, sessions=spec.sessions, turns=spec.turns, seed=spec.seed, vocab=256, burst_size=spec.burst_size
        )
    )


def request_pages(spec: DemoSpec) -> int:
    """The engines' block-table width: the pages the workload's longest turn needs, and one more."""
    longest = max(len(t.prompt) + len(t.output) for s in workload(spec) for t in s)
    return -(-longest // spec.page_tokens) + 1


def run_mode(params, cfg, spec: DemoSpec, mode: str, bar=None, max_pages: int | None = None, engines=None):
    """One setup over `spec`'s workload -> (summary, records, XLA programs built while measuring
    (`metrics.CompileWatch`: step programs and helpers), the engines' step profiles: engine
    ("engine", or "prefill" and "decode") -> `metrics.StepProfile.as_dict`).  max_pages: the engines' block-table width (default: what
    this workload's longest turn needs); the warm-up's short runs pass the measured runs' width,
    so they compile the programs the measurement runs (another width is another shape of every
    step program: 28 s of compiles on an H200 at `small`).  engines: (spec, max_pages) -> the
    server, for setups built elsewhere (`harness.demo_store`)."""
    sessions = workload(spec)
    width = request_pages(spec) if max_pages is None else max_pages
    server = engines(spec, width) if engines is not None else build_server(params, cfg, spec, mode, width)
    engines = [server] if isinstance(server, Engine) else [server.prefill, server.decode]
    next_turn = {s: 0 for s in range(len(sessions))}
    live: dict[int, object] = {}
    t0 = time.monotonic()
    burst = sorted({t[0].arrival_s for t in sessions})
    steps = 0
    # every XLA program built while measuring (`metrics.CompileWatch`), the helpers' too: a step
    # program the warm-up missed, or a move, stalls the run for its compile
    with metrics.CompileWatch() as watch:
        while any(next_turn[s] < len(sessions[s]) for s in next_turn) or live:
            for s, turns in enumerate(sessions):
                # A burst starts every `burst_every_steps` engine steps (not wall time, so every mode and
                # machine sees the same schedule); a session's next turn follows its previous one.
                started = burst.index(turns[0].arrival_s) * spec.burst_every_steps <= steps or next_turn[s] > 0
                if s not in live and next_turn[s] < len(turns) and started:
                    t = turns[next_turn[s]]
                    live[s] = server.submit(list(t.prompt), len(t.output), request_id=f"s{s}t{t.turn}")
            server.step()
            steps += 1
            for s, req in list(live.items()):
                # P/D: a request whose handoff waits for decode capacity is not done (its prefill side is)
                if server.done(req.request_id) if isinstance(server, DisaggregatedServer) else req.done:
                    del live[s]
                    next_turn[s] += 1
                    if bar is not None:
                        bar.update(1)
    wall = time.monotonic() - t0
    records = server.records()
    profile = {(e.role if len(engines) > 1 else "engine"): e.profile.as_dict() for e in engines}
    log.info("%s steps: %s", mode, " | ".join(f"{e.role}: {e.profile.summary()}" for e in engines))
    if watch.count:  # expected in a warm-up's short run; the demo reports the measured runs' counts
        log.info(
            "%s built %d XLA programs while measuring (%.2f s): %s", mode, watch.count, watch.seconds, dict(watch.names)
        )
    return metrics.summarize(mode, records, wall), records, watch.count, profile


def load_params(spec: DemoSpec):
    """(params, cfg) the demo serves: the checkpoint's (as the manifest loads them), or random."""
    if spec.manifest and not spec.checkpoint:
        raise ValueError("--manifest names the quantized weights of a checkpoint: pass --checkpoint DIR")
    if spec.checkpoint:
        return store.load_params(spec.checkpoint, spec.manifest)
    cfg = config.get_config(spec.config)
    return model.init_params(cfg, jax.random.PRNGKey(spec.seed)), cfg
