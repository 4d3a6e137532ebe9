"""Where a step's device time goes: a few calls traced with `jax.profiler`, the GPU's op events
summed by op and by the model part their scope names (`layer_<i>/mix`, `.../ffn`, the head).

`device_profile(fn, steps, part_of)` runs `fn` `steps` times under a trace and returns per-step
milliseconds: the total, each part's (``part_of(scope, op name)`` -> a label, e.g. "kda mixer"),
and the top ops.  The trace's device plane is read with `jax.profiler.ProfileData`; a backend
without one (the CPU) gives None.
"""

from __future__ import annotations

import collections
import glob
import logging
import re
import tempfile

import jax

log = logging.getLogger("benchmarks.profile")

OPS_LINE = "XLA Ops"  # the device plane's line of XLA ops (kernels, fusions, custom calls)
LAYER = re.compile(r"layer_(\d+)")


def op_times(space) -> dict[tuple[str, str], tuple[float, int]]:
    """{(scope, op name): (total ns, count)} over the device planes' XLA-ops lines of a
    `jax.profiler.ProfileData` (every stream line where a plane has no XLA-ops line).  scope: the
    event's `tf_op` stat (its named-scope path), else ""."""
    out: dict = collections.defaultdict(lambda: [0.0, 0])
    for plane in space.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        chosen = [ln for ln in lines if ln.name == OPS_LINE] or [ln for ln in lines if ln.name.startswith("Stream")]
        for line in chosen:
            for event in line.events:
                stats = dict(event.stats)
                key = (str(stats.get("tf_op", "")), event.name)
                out[key][0] += event.duration_ns
                out[key][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def summarize(times: dict, steps: int, part_of, top: int = 12) -> dict:
    """Per-step ms: {"total_ms", "parts_ms": {label: ms}, "top_ops": [[label, op, ms, calls]]}."""
    parts: dict = collections.defaultdict(float)
    ops = []
    for (scope, name), (ns, count) in times.items():
        label = part_of(scope, name)
        parts[label] += ns
        ops.append((label, name, ns, count))
    ops.sort(key=lambda o: -o[2])
    per = lambda ns: ns / 1e6 / steps
    return {
        "total_ms": per(sum(parts.values())),
        "parts_ms": {k: per(v) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "top_ops": [[label, name, per(ns), count // steps] for label, name, ns, count in ops[:top]],
    }


def model_part(mixer_kinds) -> callable:
    """part_of for the model's programs: "<kind> mixer" / "<kind> ffn" of the layer the scope names
    (`mixer_kinds[i]` for `layer_i`; Flax's scopes read `layer_i/layer_i.mix/...`, `.ffn/...`), "embed and
    head" for a scope outside the layers, "other" for an op without one."""

    def part_of(scope: str, name: str) -> str:
        m = LAYER.search(scope)
        if m and int(m.group(1)) < len(mixer_kinds):
            kind = mixer_kinds[int(m.group(1))]
            half = "ffn" if re.search(r"[./]ffn\b", scope) else "mixer"
            return f"{kind} {half}"
        if scope:  # outside the layers: the embedding, the final norm and the head
            return "embed and head"
        return "other"

    return part_of


def device_profile(fn, steps: int, part_of) -> dict | None:
    """`fn()` called `steps` times (each result waited for) under a `jax.profiler` trace; the
    `summarize` of its device ops, or None where the trace has no device plane (the CPU)."""
    with tempfile.TemporaryDirectory() as d:
        jax.block_until_ready(fn())  # compiled and warm before the trace
        jax.profiler.start_trace(d)
        try:
            for _ in range(steps):
                jax.block_until_ready(fn())
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            return None
        times = op_times(jax.profiler.ProfileData.from_file(files[0]))
    if not times:
        return None
    return summarize(times, steps, part_of)
