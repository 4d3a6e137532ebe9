"""The demo (the main job): the seeded multi-turn agent workload, end to end.

Runs the workload through each serving setup on embedded defaults (`harness.demo_setups`):

* colocated: one engine, GPU pool only;
* colocated + host tier: one engine with the embedded host-memory tier;
* P/D direct: a prefill engine hands KV to a decode engine directly;
* P/D via store: the handoff goes through a shared host tier;
* P/D via Mooncake (when Mooncake is installed): the same through a Mooncake store, in a child
  process under the loopback shim (`harness.demo_store`).

Sessions are closed-loop: a session's next turn (history + new input) is
submitted when its previous turn finishes; sessions start in bursts.  The
default burst is every session at once, more sessions than slots, on a GPU pool
smaller than their histories (48 pages of 32 tokens for 8 sessions of ~400
tokens each): a finished turn's pages are evicted while the other sessions run,
so the host tier's hits (and what recomputing costs without it) show in the
prefix-hit share and TTFT.

`main` returns the report (`format_report`): what ran where, start-up and memory, one summary
line per setup, the table of every figure (`metrics.format_table`), each engine's steps by kind;
and writes under its output directory `demo_report.json` (`report_dict`: the same figures, per
setup, with the config and backend) and `demo_latency.png` (`plot_latency`: TTFT and TPOT
distributions on log axes; needs matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import resource
import time

import jax
import numpy as np
from tqdm import tqdm

from harness import demo_store
from harness.demo_setups import MODES, DemoSpec, build_server, load_params, request_pages, run_mode, workload
from kimik3 import stacked
from serving import metrics

log = logging.getLogger(__name__)
# What the P/D rows' TPOT measures here, said under the table: both engines share this process
# and device and step in turn, so a decode token also waits for the prefill engine's step.
PD_NOTE = (
    "pd-*: the prefill and decode engines share this process and device and step in turn, so a decode\n"
    "  token also waits for a prefill step: these TPOTs are not a disaggregated deployment's"
)
REPORT_JSON = "demo_report.json"
PLOT_PNG = "demo_latency.png"
# `metrics.StepProfile`'s kinds of engine step, in words
STEP_KINDS = {
    "decode": "decode",
    "chained": "chained decode",
    "mixed": "decode + prefill",
    "prefill": "prefill",
    "idle": "idle",
}
STEP_LEGEND = (
    "engine steps by kind: N x H+W ms = N steps, each H ms of host work (scheduling, dispatch, sampling,\n"
    "  bookkeeping) + W ms waiting for the device's results, means; chained decode = dispatched on the\n"
    "  previous step's device tokens; on a CPU, XLA may compute inside a dispatch (counted as host work)"
)


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


def weights_label(spec: DemoSpec) -> str:
    """What the demo serves, in words: "random weights", or the checkpoint (and its manifest)."""
    if not spec.checkpoint:
        return "random weights"
    return f"checkpoint {spec.checkpoint}" + (f" as {spec.manifest}" if spec.manifest else "")


def _finite(x):
    """JSON's numbers: NaN (no sample) and infinities become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _ms(d: dict) -> dict:
    return {q: 1e3 * v for q, v in d.items()}


def setup_dict(s: metrics.Summary, compiles: int, profile: dict) -> dict:
    """One setup's figures: every column of `metrics.format_table` (latencies in ms at p50 / p90 /
    p99, prefix-hit shares of the prompt tokens), its output tokens and wall time, the XLA
    programs built while measuring and its engines' steps by kind (mean host / wait ms a step)."""
    return {
        "requests": s.requests,
        "output_tokens": s.output_tokens,
        "wall_s": s.wall_s,
        "output_tok_s": s.throughput_tok_s,
        "ttft_ms": _ms(s.ttft_s),
        "tpot_ms": _ms(s.tpot_s),
        "tpot_decode_only_ms": _ms(s.tpot_decode_only_s),
        "tpot_mixed_ms": _ms(s.tpot_mixed_s),
        "queue_ms": _ms(s.queue_s),
        "prefix_hit_share": {"total": s.cache_rate, "device": s.cache_rate_gpu, "host": s.cache_rate_host},
        "xla_programs_built_while_measuring": compiles,
        "engine_steps": profile,
    }


def summary_line(s: metrics.Summary, width: int = 14) -> str:
    """One setup in a line: requests, TTFT p50 / p99, TPOT p50, output tokens per second and the
    share of prompt tokens served from a cache (device pool + host tier); fixed-width fields, so
    the lines of several setups align."""
    ms = lambda d, q: f"{1e3 * d[q]:.1f}"
    return (
        f"{s.name:<{width}} {s.requests:3d} requests  TTFT p50 / p99 {ms(s.ttft_s, 'p50'):>6} / {ms(s.ttft_s, 'p99'):>6} ms"
        f"  TPOT p50 {ms(s.tpot_s, 'p50'):>5} ms  output {s.throughput_tok_s:6.1f} tok/s  prefix hits {s.cache_rate:.1%}"
    )


def steps_table(setups: dict[str, dict]) -> list[str]:
    """Each engine's steps by kind (`metrics.StepProfile`), one line per engine, a column per kind
    of step: "N x H+W ms" = N steps, each H ms of host work + W ms waiting for the device (means)."""
    rows = []
    for name, v in setups.items():
        for engine, profile in v["engine_steps"].items():
            cells = []
            for kind in STEP_KINDS:
                k = profile.get(kind)
                cells.append(f"{k['steps']} x {k['host_ms']:.2f}+{k['wait_ms']:.2f} ms" if k else "-")
            rows.append([name if engine == "engine" else f"{name} {engine}"] + cells)
    header = ["setup / engine"] + list(STEP_KINDS.values())
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt(header).rstrip()] + [fmt(r).rstrip() for r in rows]


def _wrapped(prefix: str, items: list[str], width: int = 100) -> str:
    """`prefix` then `items` joined by ", ", broken between items (never inside one) at `width`."""
    lines, line = [], prefix
    for k, item in enumerate(items):
        piece = item + (", " if k < len(items) - 1 else "")
        if len(line) + len(piece.rstrip()) > width and line.strip():
            lines.append(line.rstrip())
            line = "  "
        line += piece
    return "\n".join(lines + [line])


def _where(report: dict) -> str:
    """The backend the demo ran on, with its device where that says more ("gpu (NVIDIA H100 80GB HBM3)")."""
    where = report["backend"]
    return where + (f" ({report['device']})" if report["device"].lower() != where else "")


def format_report(report: dict, summaries: list[metrics.Summary]) -> str:
    """The demo's text report of `main`'s figures: lines of at most ~120 characters (the table of
    every figure apart)."""
    spec, cap, sec = report["spec"], report["capacity"], report["startup_s"]
    setups = report["setups"]
    built = [f"{name} {v['xla_programs_built_while_measuring']}" for name, v in setups.items()]
    rss = [f"{k} {v['current']:.2f}/{v['peak']:.2f}" for k, v in report["host_rss_gib"].items()]
    width = max(len(s.name) for s in summaries)
    lines = [
        f"kimik3 demo: config {report['config']} on {_where(report)}, {report['weights']}",
        f"workload: {spec['sessions']} sessions x {spec['turns'][0]}-{spec['turns'][1]} turns, docs/design.md token "
        f"counts / {spec['scale']:g}; {spec['num_pages']} pages of {spec['page_tokens']} tokens per engine",
        f"capacity per engine: {cap['kv_tokens']} KV tokens, {cap['sessions']} concurrent sessions, "
        f"{cap['pool_bytes'] / 2**20:.1f} MiB of pools, {cap['checkpoint_block_bytes_per_request'] / 2**10:.0f} KiB "
        "checkpoint block per request",
        f"start-up: params {sec['params']:.1f} s, then warm-up (compiles) {sec['warm-up total']:.1f} s: engine "
        f"warm-up {sec['warm-up compiles']:.1f} s + one short run per setup {sec['warm-up runs']:.1f} s",
        _wrapped("XLA programs built while measuring (every program, helpers too; 0: the warm-up built all): ", built),
        f"host memory: peak RSS of this process {report['peak_rss_gib']:.2f} GiB",
        _wrapped("  (current / peak GiB after each phase: ", rss) + ")",
        "",
        "per setup: TTFT = time to first token, TPOT = time per output token; prefix hits = the share of",
        "  prompt tokens served from a cache (device pool or host tier) instead of computed",
    ]
    lines += ["  " + summary_line(s, width) for s in summaries]
    lines += ["", "every figure (ms; p50 / p90 / p99):", metrics.format_table(summaries), PD_NOTE, "", STEP_LEGEND]
    lines += steps_table(setups)
    lines += ["", f"report: {report['json']}"]
    lines.append(f"plot: {report['plot']}" if report["plot"] else f"plot: none ({report['plot_skipped']})")
    return "\n".join(lines)


def plot_latency(records: dict[str, list[metrics.RequestRecord]], path: str, title: str) -> None:
    """TTFT and TPOT distributions per setup (empirical CDFs, log-scale latency axes) under
    `title`, written to `path`.  ImportError with what to install where matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401 (present, or the ImportError below)
        from matplotlib.figure import Figure  # no pyplot: the caller's backend stays
    except ImportError:
        raise ImportError("matplotlib is not installed: `pip install 'kimik3[plot]'` (./run.sh installs it)") from None
    from matplotlib.ticker import FuncFormatter  # optional: matplotlib (the plot extra), as above

    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for name, recs in records.items():
        for ax, attr in zip(axes, ("ttft_s", "tpot_s")):
            v = np.sort([1e3 * getattr(r, attr) for r in recs if getattr(r, attr) is not None and getattr(r, attr) > 0])
            if v.size:
                ax.step(np.concatenate([[v[0]], v]), np.arange(v.size + 1) / v.size, where="post", label=name)
    for ax, label in zip(axes, ("time to first token (ms, log scale)", "time per output token (ms, log scale)")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(spec: DemoSpec, out_dir: str) -> str:
    """Run every setup over `spec`'s workload; write `REPORT_JSON` and `PLOT_PNG` under `out_dir`
    and return the text report (`format_report`)."""
    t_start = time.monotonic()
    rss = {"start": _rss_gib()}  # where host memory and start-up time go: current / peak GiB after each phase
    params, cfg = load_params(spec)  # before any phase: a bad checkpoint or manifest fails first
    # Start-up shows its phases as they pass (a run cut short says where it was).
    setup = tqdm(total=2 + len(MODES), desc="warm-up", unit="phase", postfix="params")
    # the serving layout once, shared by every engine (each would otherwise fuse its own copy)
    params = stacked.serving_layout(params, cfg, scan=False)
    jax.block_until_ready(params)
    rss["params"] = _rss_gib()
    seconds = {"params": time.monotonic() - t_start}
    setup.set_postfix_str(f"engine compiles (params {seconds['params']:.1f} s)")
    setup.update(1)
    n_turns = sum(len(s) for s in workload(spec))
    summaries, all_records, compiles, profiles = [], {}, {}, {}
    t0 = time.monotonic()  # warm-up: compile the step shapes once, outside the measurements
    max_pages = request_pages(spec)
    probe = build_server(params, cfg, spec, "colocated", max_pages)
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
    seconds["warm-up total"] = warmup_s
    cap = probe.capacity()
    with tqdm(total=n_turns * len(MODES), desc="demo", unit="turn") as bar:
        for mode in MODES:
            bar.set_postfix_str(mode)
            summary, records, compiles[mode], profiles[mode] = run_mode(params, cfg, spec, mode, bar)
            summaries.append(summary)
            all_records[mode] = records
            rss[mode] = _rss_gib()
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
    os.makedirs(out_dir, exist_ok=True)
    backend = jax.default_backend()
    device = jax.devices()[0].device_kind
    report = {
        "config": cfg.name,
        "backend": backend,
        "device": device,
        "devices_visible": jax.device_count(),  # the engines run on the first
        "weights": weights_label(spec),
        "spec": dataclasses.asdict(spec),
        "capacity": cap,
        "startup_s": seconds,
        "host_rss_gib": {k: {"current": c, "peak": p} for k, (c, p) in rss.items()},
        "peak_rss_gib": _rss_gib()[1],
        "setups": {s.name: setup_dict(s, compiles[s.name], profiles[s.name]) for s in summaries},
        "notes": {"pd": " ".join(PD_NOTE.split()), "engine_steps": " ".join(STEP_LEGEND.split())},
        "json": os.path.join(out_dir, REPORT_JSON),
        "plot": os.path.join(out_dir, PLOT_PNG),
        "plot_skipped": None,
    }
    title = (
        f"kimik3 demo: config {cfg.name} on {_where(report)}, {report['weights']}\n"
        f"{spec.sessions} sessions x {spec.turns[0]}-{spec.turns[1]} turns: latency of each setup's requests"
    )
    try:
        plot_latency(all_records, report["plot"], title)
    except ImportError as e:
        log.warning("no plot: %s", e)
        report["plot"], report["plot_skipped"] = None, str(e)
    with open(report["json"], "w") as f:
        json.dump(_finite(report), f, indent=1)
    return format_report(report, summaries)
