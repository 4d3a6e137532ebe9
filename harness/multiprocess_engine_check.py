"""`python -m harness.multiprocess_engine_check`: the serving engine as a process group, against
the oracle.

Run once per process (same arguments but --process-id)::

    python -m harness.multiprocess_engine_check --coordinator 127.0.0.1:PORT --num-processes 2 \\
        --process-id I --cpu-devices 4 --ep 2 --engine-devices 2 --out DIR

Each process joins the group and runs the sharded steps' check (`sharding.multiprocess_check`),
then `serve`: it builds an `Engine` whose decode mesh
(DP attention, EP MoE) spans every device of every process; it owns the ranks of its own
devices (pools per rank) and serves requests of its own, and the group's engines step together
(`Engine.group`).  The workloads differ in size, so an engine also runs decode steps with
padding rows only while the other still decodes.  Process I serves, on its own ranks:

* sessions: a first turn per rank, then each session's second turn, which returns to its rank
  for a prefix hit;
* two 60-token prompts per rank that grow past a rank's 8 pages (process 0 only): preemption,
  offload to the host tier and resume;
* the first session's third turn after that pressure evicted it: a host-tier hit.

Every request's tokens are compared with the no-cache fp32 oracle's; `serve` returns what each
request got and where it ran, under "engine" in DIR/process-I.json beside the sharded steps'
results.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from sharding import multiprocess_check

PAGE = 16


def _prompt(kind: str, i: int, n: int) -> list[int]:
    return np.random.default_rng([*map(ord, kind), i]).integers(0, 256, n).tolist()


def serve(args) -> dict:
    """The engine's part, in a process that has joined its group (what uses JAX is imported here,
    once the group has set the process's devices)."""
    # after the group is joined (the docstring)
    from cache.host_tier import EmbeddedHostKVTier
    from kimik3 import config, model
    from kimik3.generate import generate
    from serving.engine import Engine
    from sharding import rank_pools
    from sharding.mesh import decode_mesh

    cfg = config.get_config(args.config)
    params = model.init_params(cfg, jax.random.PRNGKey(args.seed), "float32")  # the same on every process
    # the first `engine_devices` devices of each process, each process's ranks together
    local = args.engine_devices or len(jax.local_devices())
    devices = [
        d
        for p in range(jax.process_count())
        for d in sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[:local]
    ]
    mesh = decode_mesh(len(devices), args.ep, devices=devices, cfg=cfg)
    eng = Engine(
        params,
        cfg,
        mesh=(None, mesh),
        num_slots=2 * local,
        num_pages=9 * local,
        num_snapshots=6 * local,
        page_tokens=PAGE,
        kda_block_tokens=4 * PAGE,
        max_pages_per_request=8,
        prefill_chunk_tokens=32,
        max_step_tokens=32 + 2 * local,
        kernels="reference",
        dispatch="dense",
        host=EmbeddedHostKVTier(1 << 26),
    )
    me = jax.process_index()
    tag = lambda kind: f"{kind}{me}"
    sessions = local if me == 0 else 1  # the other engine idles through most of process 0's steps
    first = [eng.submit(_prompt(tag("a"), i, 37), 5) for i in range(sessions)]
    eng.run()
    second = [eng.submit(r.prompt + r.output + _prompt(tag("b"), i, 8), 5) for i, r in enumerate(first)]
    eng.run()
    grown = [eng.submit(_prompt(tag("c"), i, 60), 8) for i in range(2 * local if me == 0 else 0)]
    eng.run()
    third = eng.submit(second[0].prompt + second[0].output + _prompt(tag("d"), 0, 6), 4)
    eng.run()
    first_rank = rank_pools.local_ranks(mesh)[0]

    def record(kind, r):
        oracle = generate(params, cfg, r.prompt, r.max_new_tokens).tokens.tolist()
        return {
            "kind": kind,
            "rank": first_rank + r.rank,
            "error": r.error,
            "equal": r.output == oracle,
            "cached": r.cached_tokens,
            "cached_host": r.cached_tokens_host,
        }

    out = {
        "process": me,
        "processes": jax.process_count(),
        "devices": len(devices),
        "local_devices": local,
        "ranks": rank_pools.local_ranks(mesh),
        "preemptions": eng.preemptions,
        "offloaded_resumes": eng.offloaded_resumes,
        "decode_programs": eng._decode_step.programs(),
        "requests": [record("first", r) for r in first]
        + [record("second", r) for r in second]
        + [record("grown", r) for r in grown]
        + [record("third", third)],
        "sessions_kept_their_rank": [a.rank == b.rank for a, b in zip(first, second)],
        "pools_on_own_devices": all(
            leaf.devices() <= set(jax.local_devices()) for kv in eng.kvs for leaf in jax.tree_util.tree_leaves(kv.pools)
        ),
        "released": not any(m.requests for m in eng.managers),
    }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.multiprocess_engine_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    multiprocess_check.add_arguments(parser)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks of the engine's decode mesh")
    parser.add_argument(
        "--engine-devices",
        type=int,
        default=None,
        help="devices of each process in the engine's decode mesh (default: all)",
    )
    args = parser.parse_args(argv)
    multiprocess_check.write(args, multiprocess_check.run(args, then=lambda a: {"engine": serve(a)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
