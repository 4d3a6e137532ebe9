"""GPU check and throughput of the sharded model (run on a machine with >= 2 GPUs).

    python -m sharding.bench --n 2 --out results.json

1. Exactness on the GPUs: the tiny model (fp32) through sharded prefill and
   decode with the ragged (`ragged_all_to_all`) and dense dispatch equals the
   single-device model.
2. Throughput of the `small` model (bf16): prefill tokens/s and decode
   tokens/s, one GPU (`kimik3.model.forward`) vs `n` GPUs (tp n / ep n
   prefill, dp n / ep n decode).

The serving engine's decode on the same meshes: `python -m harness.scaling_bench`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import config, model
from sharding.decode import ShardedDecode
from sharding.mesh import decode_mesh, prefill_mesh
from sharding.prefill import ShardedPrefill


def _time(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile + warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_exact(n: int, kernels: str) -> dict:
    cfg = config.tiny()
    params = model.init_params(cfg, jax.random.PRNGKey(0), "float32")
    tokens = np.random.default_rng(0).integers(0, 256, (n * 2, 16)).astype(np.int32)
    cache = model.init_cache(cfg, n * 2, 32)
    ref, ref_cache = model.forward(params, cfg, tokens, cache=cache, kernels="reference")
    step = np.asarray(ref)[:, -1].argmax(-1)[:, None].astype(np.int32)
    ref_step, _ = model.forward(params, cfg, step, cache=ref_cache, kernels="reference")
    out = {}
    for dispatch in ("ragged", "dense"):
        sp = ShardedPrefill(cfg, prefill_mesh(n, n, cfg=cfg), dispatch=dispatch, kernels=kernels)
        logits, pc = sp(sp.place_params(params), tokens, sp.place_cache(cache))
        sd = ShardedDecode(cfg, decode_mesh(n, n, cfg=cfg), dispatch=dispatch, kernels=kernels)
        dlogits, _ = sd(sd.place_params(params), step, sd.place_cache(pc))
        out[dispatch] = {
            "prefill_max_abs": float(np.abs(np.asarray(logits) - np.asarray(ref)).max()),
            "prefill_argmax_equal": bool((np.asarray(logits).argmax(-1) == np.asarray(ref).argmax(-1)).all()),
            "decode_max_abs": float(np.abs(np.asarray(dlogits) - np.asarray(ref_step)).max()),
            "decode_argmax_equal": bool((np.asarray(dlogits).argmax(-1) == np.asarray(ref_step).argmax(-1)).all()),
        }
    return out


def throughput(n: int, cfg_name: str, seq: int, decode_batch: int, context: int, reps: int, kernels: str) -> dict:
    cfg = config.get_config(cfg_name)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    res = {"config": cfg.name, "gpus": n, "seq": seq, "decode_batch": decode_batch, "context": context}
    # prefill: one sequence of `seq` tokens
    tokens = rng.integers(0, 256, (1, seq)).astype(np.int32)
    cache1 = model.init_cache(cfg, 1, seq)
    t1 = _time(lambda: model.forward(params, cfg, tokens, cache=cache1, kernels=kernels), reps)
    sp = ShardedPrefill(cfg, prefill_mesh(n, n, cfg=cfg), kernels=kernels)
    sp_params, sp_cache = sp.place_params(params), sp.place_cache(cache1)
    tn = _time(lambda p=sp_params, c=sp_cache: sp(p, tokens, c), reps)
    res["prefill_s_1gpu"], res[f"prefill_s_{n}gpu"] = t1, tn
    res["prefill_tok_s_1gpu"], res[f"prefill_tok_s_{n}gpu"] = seq / t1, seq / tn
    print(json.dumps(res), flush=True)  # a run cut short still reports prefill
    del sp_params, sp_cache
    # decode: `decode_batch` requests with `context`-row caches, one token each
    cache = model.init_cache(cfg, decode_batch, context)
    cache["lengths"] = jnp.full((decode_batch,), context - 8, jnp.int32)
    step = rng.integers(0, 256, (decode_batch, 1)).astype(np.int32)
    t1 = _time(lambda: model.forward(params, cfg, step, cache=cache, kernels=kernels), reps)
    sd = ShardedDecode(cfg, decode_mesh(n, n, cfg=cfg), kernels=kernels)
    sd_params, sd_cache = sd.place_params(params), sd.place_cache(cache)
    tn = _time(lambda p=sd_params, c=sd_cache: sd(p, step, c), reps)
    res["decode_s_1gpu"], res[f"decode_s_{n}gpu"] = t1, tn
    res["decode_tok_s_1gpu"], res[f"decode_tok_s_{n}gpu"] = decode_batch / t1, decode_batch / tn
    return res


def _report(result: dict, out: str | None) -> int:
    print(json.dumps(result, indent=1), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sharding.bench", description=__doc__)
    p.add_argument("--n", type=int, default=len(jax.devices()))
    p.add_argument("--config", default="small")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--skip-exact", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
    if not args.skip_exact:
        result["exact"] = check_exact(args.n, args.kernels)
        print(json.dumps(result["exact"], indent=1), flush=True)
    result["throughput"] = throughput(
        args.n, args.config, args.seq, args.decode_batch, args.context, args.reps, args.kernels
    )
    return _report(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
