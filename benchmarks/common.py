"""Timing and reporting shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import statistics
import time


def time_jax(fn, *args, iters=20, warmup=3):
    """Median wall-clock ms of fn(*args), synchronized with block_until_ready."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def copy_gbs() -> float:
    """XLA device copy bandwidth (read + write) of a 1 GiB array, GB/s."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 28,), jnp.float32)
    return 2 * x.nbytes / (time_jax(jax.jit(lambda a: a * 1.0 + 0.0), x) * 1e-3) / 1e9


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown_tables(rows: list[dict]) -> str:
    """One markdown table per distinct row["section"] (or a single table without sections)."""
    lines = []
    for section in dict.fromkeys(r.get("section") for r in rows):
        sec = [r for r in rows if r.get("section") == section]
        keys = [k for k in dict.fromkeys(k for r in sec for k in r) if k != "section"]
        if section is not None:
            lines.append(f"\n### {section}\n")
        lines += ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
        lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in sec]
    return "\n".join(lines)


def write_results(out_dir: str, name: str, rows: list[dict]) -> str:
    """Print the tables and write <name>.md and <name>.json under out_dir; returns the markdown."""
    table = markdown_tables(rows)
    print(table)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return table
