"""Scaling of the serving engine's decode over GPUs (run on a machine with >= 2 GPUs).

    python -m harness.scaling_bench --n 2 --out engine_scaling.json

An engine on one GPU with B requests against an engine whose decode mesh is dp n / ep n
(`sharding.mesh.decode_mesh`) with n * B requests (the same requests per GPU, the same context),
each rank on its own pools: decode tokens/s, tokens/s per GPU and the scaling efficiency (n
GPUs' tokens/s over n times one GPU's).  The sharded model's own steps on the same meshes:
`python -m sharding.bench`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from kimik3 import config, model
from serving.engine import Engine
from sharding.mesh import decode_mesh


def _engine_decode_tok_s(engine, requests: int, context: int, steps: int, rng) -> dict:
    """Decode tokens/s of `engine` with `requests` requests of `context`-token prompts, timed over
    `steps` engine steps once all of them decode (prefill and compiles before the clock)."""
    reqs = [engine.submit(rng.integers(0, 256, context).tolist(), steps + 8) for _ in range(requests)]
    while any(r.planned_len < len(r.context) or not r.output for r in reqs):
        engine.step()
    engine.step()  # every bucket compiled, one decode step in flight at most
    engine.settle()
    done = sum(len(r.output) for r in reqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.settle()
    dt = time.perf_counter() - t0
    made = sum(len(r.output) for r in reqs) - done
    for r in reqs:
        engine.cancel(r.request_id)
    return {"requests": requests, "tokens": made, "seconds": dt, "tok_s": made / dt, "step_ms": 1e3 * dt / steps}


def engine_scaling(
    n: int,
    cfg_name: str,
    per_gpu_batch: int,
    context: int,
    steps: int,
    kernels: str,
    page_tokens: int = 128,
    dtype=None,
    devices=None,
) -> dict:
    """The serving engine's decode on one device vs a dp n / ep n decode mesh with n times the
    requests (`per_gpu_batch` per device, `context`-token prompts): tokens/s, per GPU, efficiency."""
    cfg = config.get_config(cfg_name)
    params = model.init_params(cfg, jax.random.PRNGKey(0), dtype)
    devices = list(devices or jax.devices())[:n]
    pages = per_gpu_batch * (-(-(context + steps + 16) // page_tokens) + 1) + 1
    kw = dict(
        page_tokens=page_tokens,
        kda_block_tokens=max(page_tokens, 4 * page_tokens),
        prefill_chunk_tokens=min(2048, max(page_tokens, context)),
        kernels=kernels,
        max_pages_per_request=-(-(context + steps + 16) // page_tokens),
    )
    out = {"config": cfg.name, "gpus": n, "per_gpu_batch": per_gpu_batch, "context": context, "steps": steps}
    rng = np.random.default_rng(0)
    with jax.default_device(devices[0]):
        one = Engine(
            params,
            cfg,
            num_pages=pages,
            num_slots=per_gpu_batch,
            num_snapshots=2 * per_gpu_batch,
            max_step_tokens=kw["prefill_chunk_tokens"] + per_gpu_batch,
            **kw,
        )
        out["1gpu"] = _engine_decode_tok_s(one, per_gpu_batch, context, steps, rng)
    del one
    print(json.dumps(out), flush=True)  # a run cut short still reports one GPU
    mesh = decode_mesh(n, n, devices=devices, cfg=cfg)
    many = Engine(
        params,
        cfg,
        mesh=(None, mesh),
        num_pages=n * pages,
        num_slots=n * per_gpu_batch,
        num_snapshots=2 * n * per_gpu_batch,
        max_step_tokens=kw["prefill_chunk_tokens"] + n * per_gpu_batch,
        **kw,
    )
    out[f"{n}gpu"] = _engine_decode_tok_s(many, n * per_gpu_batch, context, steps, rng)
    out["tok_s_per_gpu_1gpu"] = out["1gpu"]["tok_s"]
    out[f"tok_s_per_gpu_{n}gpu"] = out[f"{n}gpu"]["tok_s"] / n
    out["speedup"] = out[f"{n}gpu"]["tok_s"] / out["1gpu"]["tok_s"]
    out["scaling_efficiency"] = out["speedup"] / n
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.scaling_bench", description=__doc__)
    p.add_argument("--n", type=int, default=len(jax.devices()), help="GPUs of the decode mesh")
    p.add_argument("--config", default="small")
    p.add_argument("--per-gpu-batch", type=int, default=32, help="requests per device")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--out", default=None, help="the result as JSON")
    args = p.parse_args(argv)
    result = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
    result["engine_scaling"] = engine_scaling(
        args.n, args.config, args.per_gpu_batch, args.context, args.steps, args.kernels
    )
    print(json.dumps(result, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
