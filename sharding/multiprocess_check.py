"""`python -m sharding.multiprocess_check`: the sharded steps across a process group, against one process.

Run once per process (same arguments but --process-id)::

    python -m sharding.multiprocess_check --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I \\
        --cpu-devices 4 --out DIR

Each process joins the group (`sharding.distributed`), prefills a batch of prompts on a tp2/ep2
mesh whose two ranks are the first device of process 0 and of the last process, hands the cache
to a DP/EP decode mesh over every device of every process (through the host: the P/D handoff
across processes), decodes greedy tokens there, and compares logits, caches and tokens with
the model on this process alone and with the no-cache oracle.  It writes DIR/process-I.json.
`python -m harness.multiprocess_engine_check` (these flags and the engine's) runs this and then
serves requests with the serving engine as the same group (`run(args, then=...)`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import numpy as np

from sharding import distributed

BATCH, PROMPT, MAX_LEN, STEPS = 8, 8, 32, 3


def run(args, then=None) -> dict:
    """Join the group, run the sharded steps and compare them (the result: this process's JSON).
    then(args) -> dict: more of the group's work before it is left, its keys added to the result.
    The model and the steps are imported only once the group is joined (its CPU device count is
    set there, before anything may touch a device)."""
    group = distributed.ProcessGroup(args.coordinator, args.num_processes, args.process_id, args.cpu_devices)
    distributed.initialize(group)

    # after the group is joined (the docstring)
    from kimik3 import config, model
    from kimik3.generate import generate
    from sharding.decode import ShardedDecode
    from sharding.mesh import decode_mesh, prefill_mesh
    from sharding.prefill import ShardedPrefill

    cfg = config.get_config(args.config)
    params = model.init_params(cfg, jax.random.PRNGKey(args.seed), "float32")  # the same on every process
    prompts = np.random.default_rng(args.seed).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)
    devices = jax.devices()
    firsts = [next(d for d in devices if d.process_index == p) for p in (0, jax.process_count() - 1)]
    sp = ShardedPrefill(cfg, prefill_mesh(2, 2, devices=firsts, cfg=cfg), dispatch="dense", kernels="reference")
    logits, cache = sp(sp.place_params(params), prompts, sp.place_cache(model.init_cache(cfg, BATCH, MAX_LEN)))
    dp = len(devices)
    sd = ShardedDecode(
        cfg,
        decode_mesh(dp, math.gcd(dp, cfg.n_routed_experts), devices=devices, cfg=cfg),
        dispatch="dense",
        kernels="reference",
    )
    # the handoff between meshes of different processes goes through the host here
    cache = sd.place_cache(distributed.gather(cache))
    dparams = sd.place_params(params)
    ref_logits, ref_cache = model.forward(
        params, cfg, prompts, cache=model.init_cache(cfg, BATCH, MAX_LEN), kernels="reference"
    )
    errors = [float(np.abs(distributed.gather(logits) - np.asarray(ref_logits)).max())]
    tokens, ref_tokens = [], []
    nxt = distributed.gather(logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
    ref_nxt = np.asarray(ref_logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
    for _ in range(STEPS):
        tokens.append(nxt[:, 0].tolist())
        ref_tokens.append(ref_nxt[:, 0].tolist())
        logits, cache = sd(dparams, nxt, cache)
        ref_logits, ref_cache = model.forward(params, cfg, ref_nxt, cache=ref_cache, kernels="reference")
        errors.append(float(np.abs(distributed.gather(logits) - np.asarray(ref_logits)).max()))
        nxt = distributed.gather(logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
        ref_nxt = np.asarray(ref_logits)[:, -1].argmax(-1)[:, None].astype(np.int32)
    tokens.append(nxt[:, 0].tolist())
    ref_tokens.append(ref_nxt[:, 0].tolist())
    cache_err = max(
        float(np.abs(distributed.gather(g) - np.asarray(w)).max())
        for g, w in zip(jax.tree_util.tree_leaves(cache["layers"]), jax.tree_util.tree_leaves(ref_cache["layers"]))
    )
    # what this process holds of the decode cache: its own devices' requests only
    held = sorted({s.index[0].start for g in jax.tree_util.tree_leaves(cache["layers"]) for s in g.addressable_shards})
    oracle = generate(params, cfg, prompts[0], STEPS + 1).tokens.tolist()
    out = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": len(devices),
        "local_devices": len(jax.local_devices()),
        "prefill_ranks": [d.process_index for d in firsts],
        "logit_errors": errors,
        "cache_error": cache_err,
        "tokens": tokens,
        "ref_tokens": ref_tokens,
        "oracle_row0": oracle,
        "decode_rows_held": held,
    }
    if then is not None:
        out.update(then(args))
    distributed.shutdown()
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The group's, the model's and the output's flags (`main`'s, and the engine check's)."""
    parser.add_argument("--coordinator", required=True, help="host:port of process 0's coordination service")
    parser.add_argument("--num-processes", type=int, required=True, help="processes in the group")
    parser.add_argument("--process-id", type=int, required=True, help="this process's id in [0, num-processes)")
    parser.add_argument("--cpu-devices", type=int, default=None, help="devices per process on CPU")
    parser.add_argument("--config", default="tiny", help="model config")
    parser.add_argument("--seed", type=int, default=0, help="weights' and prompts' seed")
    parser.add_argument("--out", required=True, help="process-I.json goes here")


def write(args, result: dict) -> None:
    """This process's result as OUT/process-I.json."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"process-{args.process_id}.json"), "w") as f:
        json.dump(result, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sharding.multiprocess_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    write(args, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
