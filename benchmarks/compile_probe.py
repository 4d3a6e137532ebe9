"""Where the serving engine's compile time goes (run before the serving benchmark).

    PYTHONPATH=$PWD python3 benchmarks/compile_probe.py --config small [--out DIR]

Times the first call (trace + compile + run) and a second call of:
* one `chunk_kda` / `fused_recurrent_kda` / `mla_decode` kernel at the model's shapes;
* the model's whole jitted step (`kimik3.model._forward` on a paged view) for a prefill
  chunk of T tokens and a decode batch of B rows, with `kernels` pallas and reference.
If the whole step with pallas costs about (number of KDA layers) x (one chunk_kda
compile), each layer compiles its own copy of the kernel and scanning the layer stack
(or compiling one layer body per kind) is the fix.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from kimik3 import config, model
from pallas_kernels import kda, mla


def first_and_second(fn, *args):
    """(seconds of the first call, seconds of the second) of a fresh jitted fn."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    t1 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return t1 - t0, time.perf_counter() - t1


def kernel_rows(cfg, t):
    h, d = cfg.kda_heads, cfg.kda_head_dim
    key = jax.random.PRNGKey(0)
    q, k = (jax.random.normal(key, (1, t, h, d), jnp.bfloat16) for _ in range(2))
    v = jax.random.normal(key, (1, t, h, d), jnp.bfloat16)
    g = -jnp.abs(jax.random.normal(key, (1, t, h, d), jnp.float32)) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(key, (1, t, h), jnp.bfloat16))
    rows = []
    for impl in ("fused", "split"):
        first, second = first_and_second(jax.jit(lambda *a, impl=impl: kda.chunk_kda(
            *a, output_final_state=True, tuning={"prepare_impl": impl})[:2]), q, k, v, g, beta)
        rows.append(dict(section="kernels", case=f"chunk_kda T{t} H{h} D{d} prepare={impl}", first_s=first,
                         second_s=second))
        print(rows[-1], flush=True)
    pool = jnp.zeros((4, h, d, d), jnp.float32)
    first, second = first_and_second(jax.jit(lambda *a: kda.fused_recurrent_kda(
        *a, state_pool=pool, slots=jnp.arange(1, dtype=jnp.int32))[0]), q[:, :1], k[:, :1], v[:, :1], g[:, :1],
        beta[:, :1])
    rows.append(dict(section="kernels", case=f"fused_recurrent_kda B1 H{h}", first_s=first, second_s=second))
    r, p = cfg.kv_lora_rank, cfg.qk_rope_dim
    pages = jax.random.normal(key, (16, 128, r + p), jnp.bfloat16)
    table = jnp.arange(8, dtype=jnp.int32)[None]
    first, second = first_and_second(jax.jit(lambda a, b: mla.mla_decode(a, b, pages, table, jnp.array([1000]),
                                                                         scale=0.1)[0]),
                                     jax.random.normal(key, (1, 1, cfg.mla_heads, r), jnp.bfloat16),
                                     jax.random.normal(key, (1, 1, cfg.mla_heads, p), jnp.bfloat16))
    rows.append(dict(section="kernels", case=f"mla_decode B1 H{cfg.mla_heads}", first_s=first, second_s=second))
    return rows


def step_rows(cfg, params, shapes, kernels):
    rows = []
    pools = model.init_paged_cache(cfg, 64, 9, 128, params["embed_vd"].dtype)
    for b, t in shapes:
        view = model.paged_view(pools, np.zeros((b, 32), np.int64), np.arange(b), np.zeros(b, np.int64))
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        fn = lambda tok: model._forward(params, tok, positions, view, None, cfg=cfg, expert_path="grouped",
                                        kernels=kernels)[0]
        first, second = first_and_second(fn, jnp.zeros((b, t), jnp.int32))
        rows.append(dict(section="model step", case=f"{kernels} B{b} T{t}", first_s=first, second_s=second,
                         n_layers=cfg.n_layers, kda_layers=cfg.mixer_kinds.count("kda")))
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cfg = config.get_config(args.config)
    rows = kernel_rows(cfg, args.chunk)
    for r in rows:
        print(r, flush=True)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    # a second and third prefill length: does each new chunk length pay the kernel compiles again?
    shapes = [(1, args.chunk), (8, 1), (1, args.chunk // 2), (1, 64)]
    rows += step_rows(cfg, params, shapes, "pallas")
    rows += step_rows(cfg, params, shapes, "reference")
    common.write_results(args.out, "compile_probe", rows)


if __name__ == "__main__":
    main()
