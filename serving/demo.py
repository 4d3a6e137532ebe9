"""The demo (the main job): the seeded multi-turn agent workload, end to end.

Runs the workload through four setups on embedded defaults and prints one
metrics table, plus a plot of the TTFT / TPOT distributions:

* colocated: one engine, GPU pool only;
* colocated + host tier: one engine with the embedded host-memory tier;
* P/D direct: a prefill engine hands KV to a decode engine directly;
* P/D via store: the handoff goes through a shared host tier;
* P/D via Mooncake (when Mooncake is installed): the same through a Mooncake store, in a child
  process under the loopback shim (`serving.demo_store`).

Sessions are closed-loop: a session's next turn (history + new input) is
submitted when its previous turn finishes; sessions start in bursts.  The
default burst is every session at once, more sessions than slots, on a GPU pool
smaller than their histories (48 pages of 32 tokens for 8 sessions of ~400
tokens each): a finished turn's pages are evicted while the other sessions run,
so the host tier's hits (and what recomputing costs without it) show in the
table's cache rate and TTFT.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import time

import jax
from tqdm import tqdm

from cache.host_tier import EmbeddedHostKVTier
from kimik3 import config, model, stacked
from serving import metrics
from serving.disagg import DisaggregatedServer
from serving.engine import Engine, EngineConfig
from serving.workload import WorkloadSpec, generate_sessions  # noqa: F401 - WorkloadSpec used by _workload

log = logging.getLogger(__name__)
MODES = ("colocated", "colocated+host", "pd-direct", "pd-store")
# What the P/D rows' TPOT measures here, said under the table: both engines share this process
# and device and step in turn, so a decode token also waits for the prefill engine's step.
PD_NOTE = (
    "pd-*: both engines in this process on one device, stepped in turn (`DisaggregatedServer`, serial): "
    "a decode token waits for the prefill engine's step, so these TPOTs are not a disaggregated "
    "deployment's (separate instances, or `concurrent=True` with an engine per device)"
)


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


def _engines(params, cfg, spec: DemoSpec, mode: str, max_pages: int):
    common = engine_config(spec, max_pages)
    if mode.startswith("colocated"):
        host = EmbeddedHostKVTier(spec.host_bytes) if mode.endswith("host") else None
        return Engine(params, cfg, common, host=host)
    host = EmbeddedHostKVTier(spec.host_bytes) if mode == "pd-store" else None
    prefill = Engine(params, cfg, common.replace(role="prefill"), host=host)
    decode = Engine(params, cfg, common.replace(role="decode"), host=host)
    return DisaggregatedServer(prefill, decode, "store" if mode == "pd-store" else "direct")


def _workload(spec: DemoSpec):
    return generate_sessions(
        WorkloadSpec.scaled(
            spec.scale, sessions=spec.sessions, turns=spec.turns, seed=spec.seed, vocab=256, burst_size=spec.burst_size
        )
    )


def _max_pages(spec: DemoSpec) -> int:
    longest = max(len(t.prompt) + len(t.output) for s in _workload(spec) for t in s)
    return -(-longest // spec.page_tokens) + 1


def run_mode(params, cfg, spec: DemoSpec, mode: str, bar=None, max_pages: int | None = None, engines=None):
    """One setup over `spec`'s workload -> (summary, records, XLA programs built while measuring
    (`metrics.CompileWatch`: step programs and helpers), the engines' step profiles as a line:
    `metrics.StepProfile.summary`).  max_pages: the engines' block-table width (default: what
    this workload's longest turn needs); the warm-up's short runs pass the measured runs' width,
    so they compile the programs the measurement runs (another width is another shape of every
    step program: 28 s of compiles on an H200 at `small`).  engines: (spec, max_pages) -> the
    server, for setups built elsewhere (`serving.demo_store`)."""
    sessions = _workload(spec)
    width = _max_pages(spec) if max_pages is None else max_pages
    server = engines(spec, width) if engines is not None else _engines(params, cfg, spec, mode, width)
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
    profile = " | ".join(
        f"{e.role}: {e.profile.summary()}" if len(engines) > 1 else e.profile.summary() for e in engines
    )
    log.info("%s steps: %s", mode, profile)
    if watch.count:  # expected in a warm-up's short run; the demo reports the measured runs' counts
        log.info(
            "%s built %d XLA programs while measuring (%.2f s): %s", mode, watch.count, watch.seconds, dict(watch.names)
        )
    return metrics.summarize(mode, records, wall), records, watch.count, profile


def _rss_gib() -> tuple[float, float]:
    """(current, peak) resident set of this process in GiB (Linux /proc; peak from getrusage elsewhere)."""
    cur = peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        cur = int(fields["VmRSS"].split()[0]) / 2**20
        peak = int(fields["VmHWM"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        pass
    return cur, peak


def _params(spec: DemoSpec):
    """(params, cfg) the demo serves: the checkpoint's (as the manifest loads them), or random."""
    if spec.manifest and not spec.checkpoint:
        raise ValueError("--manifest names the quantized weights of a checkpoint: pass --checkpoint DIR")
    if spec.checkpoint:
        from kimik3.quant import store

        return store.load_params(spec.checkpoint, spec.manifest)
    cfg = config.get_config(spec.config)
    return model.init_params(cfg, jax.random.PRNGKey(spec.seed)), cfg


def main(spec: DemoSpec, out_dir: str) -> str:
    t_start = time.monotonic()
    rss = {"start": _rss_gib()}  # where host memory and start-up time go: current / peak GiB after each phase
    params, cfg = _params(spec)  # before any phase: a bad checkpoint or manifest fails first
    # Start-up shows its phases as they pass (a run cut short says where it was).
    setup = tqdm(total=2 + len(MODES), desc="warm-up", unit="phase", postfix="params")
    # the serving layout once, shared by every engine (each would otherwise fuse its own copy)
    params = stacked.serving_layout(params, cfg, scan=False)
    jax.block_until_ready(params)
    rss["params"] = _rss_gib()
    seconds = {"params": time.monotonic() - t_start}
    setup.set_postfix_str(f"engine compiles (params {seconds['params']:.1f} s)")
    setup.update(1)
    n_turns = sum(len(s) for s in _workload(spec))
    summaries, all_records, compiles, profiles = [], {}, {}, {}
    t0 = time.monotonic()  # warm-up: compile the step shapes once, outside the measurements
    max_pages = _max_pages(spec)
    probe = _engines(params, cfg, spec, "colocated", max_pages)
    probe.warmup()
    rss["warm-up compiles"] = _rss_gib()
    seconds["warm-up compiles"] = time.monotonic() - t0
    setup.set_postfix_str(f"short runs (compiles {seconds['warm-up compiles']:.1f} s)")
    setup.update(1)
    for mode in MODES:  # the cache bookkeeping and handoff ops compile here too, not while measuring
        run_mode(params, cfg, dataclasses.replace(spec, sessions=1, turns=(2, 2)), mode, max_pages=max_pages)
        setup.set_postfix_str(f"{mode} at {time.monotonic() - t0:.1f} s")
        setup.update(1)
    setup.close()
    warmup_s = time.monotonic() - t0
    rss["warm-up runs"] = _rss_gib()
    seconds["warm-up runs"] = warmup_s - seconds["warm-up compiles"]
    cap = probe.capacity()
    with tqdm(total=n_turns * len(MODES), desc="demo", unit="turn") as bar:
        for mode in MODES:
            bar.set_postfix_str(mode)
            summary, records, compiles[mode], profiles[mode] = run_mode(params, cfg, spec, mode, bar)
            summaries.append(summary)
            all_records[mode] = records
            rss[mode] = _rss_gib()
    from serving import demo_store

    if demo_store.available():  # the shared tier as production runs it: a Mooncake store (a child process)
        with tqdm(total=1, desc=demo_store.MODE, unit="run") as bar:
            records, wall, compiles[demo_store.MODE], profiles[demo_store.MODE] = demo_store.run(spec)
            bar.update(1)
        summaries.append(metrics.summarize(demo_store.MODE, records, wall))
        all_records[demo_store.MODE] = records
    for phase, (cur, peak) in rss.items():
        log.info(
            "host RSS after %s: %.2f GiB (peak %.2f)%s",
            phase,
            cur,
            peak,
            f"; {seconds[phase]:.1f} s" if phase in seconds else "",
        )
    table = metrics.format_table(summaries)
    os.makedirs(out_dir, exist_ok=True)
    metrics.plot(all_records, os.path.join(out_dir, "demo_latency.png"))
    weights = f"{spec.checkpoint} as {spec.manifest}" if spec.manifest else spec.checkpoint or "random"
    header = (
        f"config={cfg.name} ({jax.default_backend()}, weights {weights}), {spec.sessions} sessions x {spec.turns[0]}-{spec.turns[1]} "
        f"turns, docs/design.md token counts / {spec.scale:g}, pages of {spec.page_tokens} tokens, "
        f"{spec.num_pages} pages per engine; capacity per engine: {cap['kv_tokens']} KV tokens, "
        f"{cap['sessions']} concurrent sessions, {cap['pool_bytes'] / 2**20:.1f} MiB of pools, "
        f"{cap['checkpoint_block_bytes_per_request'] / 2**10:.0f} KiB checkpoint block per request; "
        f"warm-up (compiles) {warmup_s:.1f} s (engine warm-up {seconds['warm-up compiles']:.1f} s, then one "
        f"short run per setup {seconds['warm-up runs']:.1f} s; params {seconds['params']:.1f} s before it); "
        f"new compiles while measuring (every XLA program built, helpers too): {compiles}; "
        f"peak RSS of this process {_rss_gib()[1]:.2f} GiB (current / peak GiB after each phase: "
        + ", ".join(f"{k} {c:.2f}/{p:.2f}" for k, (c, p) in rss.items())
        + ")"
    )
    steps = "".join(f"  {mode}: {line}\n" for mode, line in profiles.items())
    return (
        header + "\n" + table + "\n" + PD_NOTE + "\nengine steps by kind (host time, then the wait on the "
        "device: `metrics.StepProfile`; XLA:CPU may compute inside a dispatch):\n"
        + steps
        + f"plot: {os.path.join(out_dir, 'demo_latency.png')}"
    )
