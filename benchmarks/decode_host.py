"""Where a chained decode step's wall time goes: the demo's engine (`serving.demo.engine_config`,
random weights) with `--rows` requests in a steady decode-only phase.

Per step, averaged over `--steps` chained steps: the engine's host time and its wait on the
device (`metrics.StepProfile`), and inside the host time the calls into XLA that enqueue work
(`decode_program`, `_read_tokens`, `_overwrite`), timed around each call.  Then the decode program
alone on one bucket's buffers: `--reps` calls back to back, then one sync (the device's time a
step), and the host time of one such call.  Then the rows' rewrite (`_overwrite`) and one small
transfer on an idle device, behind one program, and behind what a chained step leaves in flight
(two programs and their tokens' copies); the rewrite there also with its values already on the
device and with its io not donated, beside the program's own enqueue: where the chain's rewrite
waits.  Run it under different `XLA_FLAGS` to see what the enqueue costs (e.g.
`--xla_gpu_enable_command_buffer=` turns XLA's CUDA graphs off).

    PYTHONPATH=$PWD python3 benchmarks/decode_host.py --config small --rows 8 --out /tmp/decode_host.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import time

import jax
import numpy as np

from kimik3 import stacked
from serving import demo, model_runner
from serving.engine import Engine



def _timed(calls: collections.Counter, seconds: collections.Counter, name: str, fn):
    """fn, with the wall time of each call added to seconds[name] (the host's side of a dispatch)."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds[name] += time.perf_counter() - t0
        calls[name] += 1
        return out

    if hasattr(fn, "_cache_size"):  # the engine counts compiled programs through it
        wrapper._cache_size = fn._cache_size
    return wrapper


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small")
    parser.add_argument("--rows", type=int, default=8, help="requests decoding together")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens a request")
    parser.add_argument("--steps", type=int, default=150, help="chained steps measured")
    parser.add_argument("--reps", type=int, default=50, help="decode programs back to back")
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args(argv)

    spec = dataclasses.replace(demo.DemoSpec(config=args.config), num_slots=max(args.rows, 8), num_pages=4096)
    params, cfg = demo._params(spec)
    params = stacked.serving_layout(params, cfg, scan=False)
    new_tokens = 40 + args.steps + 40
    max_pages = -(-(args.prompt + new_tokens) // spec.page_tokens) + 1
    eng = Engine(params, cfg, demo.engine_config(spec, max_pages))
    rng = np.random.default_rng(0)
    submit = lambda n: [eng.submit(rng.integers(0, 256, args.prompt).tolist(), n) for _ in range(args.rows)]
    submit(24)  # a first batch compiles every program this run uses
    eng.run()
    eng.profile = type(eng.profile)()
    submit(new_tokens)
    while eng.profile.steps["chained"] < 10:  # prefill, then the chain starts
        eng.step()

    calls, seconds = collections.Counter(), collections.Counter()
    originals = {name: getattr(model_runner, name) for name in ("decode_program", "_read_tokens", "_overwrite")}
    for name, fn in originals.items():
        setattr(model_runner, name, _timed(calls, seconds, name, fn))
    try:
        eng.profile = type(eng.profile)()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        wall_s = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(model_runner, name, fn)
    eng._settle_decode()
    prof = eng.profile.as_dict()
    n = args.steps
    result = {
        "device": str(jax.devices()[0].device_kind), "config": args.config, "rows": args.rows,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "steps": n, "step_ms": 1e3 * wall_s / n,
        "profile": prof,
        "enqueue_ms_a_step": {k: 1e3 * seconds[k] / n for k in seconds},
        "enqueue_calls_a_step": {k: calls[k] / n for k in calls},
        "param_leaves": len(jax.tree.leaves(eng.params)), "pool_leaves": len(jax.tree.leaves(eng.pools)),
    }

    # the program alone: the last bucket's buffers, the same rows each call (no host between)
    runner = eng.runner.decode
    bucket = max(runner._io)
    io = runner._io.pop(bucket)
    pools = eng.pools
    jax.block_until_ready((pools, io))
    host = []
    t0 = time.perf_counter()
    for _ in range(args.reps):
        t = time.perf_counter()
        pools, io = model_runner.decode_program(eng.params, pools, io, cfg=cfg, kernels=runner.kernels, greedy=True)
        host.append(time.perf_counter() - t)
    jax.block_until_ready((pools, io))
    result["program_back_to_back_ms"] = 1e3 * (time.perf_counter() - t0) / args.reps
    result["program_enqueue_ms_median"] = 1e3 * float(np.median(host))
    # the rows' rewrite (`_overwrite`: every entry but the tokens, from numpy), on an idle device
    # and right behind a decode program still running
    held = {k: np.asarray(v) for k, v in io.items() if k != "tokens"}
    state = {"pools": pools, "io": io}

    def enqueue_program():
        state["pools"], state["io"] = model_runner.decode_program(
            eng.params, state["pools"], state["io"], cfg=cfg, kernels=runner.kernels, greedy=True)

    def as_chained():  # what a chained step leaves in flight: two steps, each with its tokens' copy
        for _ in range(2):
            enqueue_program()
            model_runner._read_tokens(state["io"])

    def host_ms(call, before) -> float:
        """Median host ms of call(io) -> io over 10 tries, each right after before() (nothing:
        an idle device)."""
        times = []
        for _ in range(10):
            jax.block_until_ready(state)
            before()
            t = time.perf_counter()
            state["io"] = call(state["io"])
            times.append(time.perf_counter() - t)
        return 1e3 * float(np.median(times))

    on_device = jax.device_put(held)
    overwrite_kept = jax.jit(model_runner._overwrite.__wrapped__)  # the same write, io not donated
    for label, before in (("idle", lambda: None), ("behind_program", enqueue_program), ("as_chained", as_chained)):
        result[f"overwrite_host_ms_{label}"] = host_ms(lambda io: model_runner._overwrite(io, held), before)
        # one small host-to-device transfer alone
        result[f"device_put_host_ms_{label}"] = host_ms(lambda io: (jax.device_put(held["slots"]), io)[1], before)
    # where the chain's rewrite waits (session 41: 3.1 ms a call inside the chain, 0.4 alone): its
    # values already on the device (no transfer), or its io not donated, or the program itself
    result["overwrite_host_ms_as_chained_values_on_device"] = host_ms(
        lambda io: model_runner._overwrite(io, on_device), as_chained)
    result["overwrite_host_ms_as_chained_not_donated"] = host_ms(lambda io: overwrite_kept(io, held), as_chained)

    def program(io):
        state["pools"], io = model_runner.decode_program(eng.params, state["pools"], io, cfg=cfg,
                                                         kernels=runner.kernels, greedy=True)
        return io

    result["program_enqueue_host_ms_as_chained"] = host_ms(program, as_chained)
    pools, io = state["pools"], state["io"]
    jax.block_until_ready((pools, io))
    eng.pools, runner._io[bucket], runner._holds[bucket] = pools, io, None
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
