"""Start-up costs, each in a fresh process with no compilation cache: compiling one decode step,
drawing the params, and loading a Hugging Face checkpoint.

Registered in `benchmarks.registry` (compile_time, init_time, hf_load).  The measurements run in a child
(`python -m benchmarks.startup CHILD JSON`), which prints one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from benchmarks.common import ROOT


def _no_cache():
    os.environ["KIMIK3_COMPILE_CACHE"] = "off"  # it times compiles: no persistent cache of any kind
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def compile_child(config: str, batch: int, variant: str) -> dict:
    """The first call of `model.forward` on B rows of one token (trace, lower, compile, run) minus
    the second; the two calls' logits must be equal."""
    _no_cache()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kimik3 import config as configs, fused, model, stacked

    cfg = configs.get_config(config)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    if variant == "fused":
        params = fused.fuse_projections(params, cfg)
    if variant == "stacked":
        params = stacked.stack_periods(params, cfg)
    programs = "whole" if variant == "whole" else "auto"
    cache = model.init_cache(cfg, batch, 256)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    jax.block_until_ready((params, cache))
    t0 = time.perf_counter()
    first = jax.block_until_ready(model.forward(params, cfg, tokens, cache=cache, programs=programs))[0]
    t1 = time.perf_counter()
    second = jax.block_until_ready(model.forward(params, cfg, tokens, cache=cache, programs=programs))[0]
    t2 = time.perf_counter()
    err = float(np.max(np.abs(np.asarray(first, np.float32) - np.asarray(second, np.float32))))
    return {"compile_s": (t1 - t0) - (t2 - t1), "run_s": t2 - t1, "max_err": err}


def init_child(config: str, variant: str) -> dict:
    """Seconds to draw the params (`init_params`, or flax's whole-model init as one program) and the
    process's peak RSS; whether the tree matches `model.abstract_params` with finite values."""
    _no_cache()
    import jax
    import numpy as np

    if variant == "whole_kernel":
        jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    from kimik3 import config as configs, model

    cfg = configs.get_config(config)
    key = jax.random.PRNGKey(0)
    t0 = time.perf_counter()
    if variant == "default":
        params = jax.block_until_ready(model.init_params(cfg, key))
    else:
        init = jax.jit(
            lambda k: model.cast_params(model.KimiK3(cfg).init(k, *model.example_inputs(cfg))["params"], cfg.dtype)
        )
        params = jax.block_until_ready(init(key))
    seconds = time.perf_counter() - t0
    want = model.abstract_params(cfg)
    same = jax.tree.structure(params) == jax.tree.structure(want) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want))
    )
    finite = all(bool(np.isfinite(np.asarray(x, np.float32)).all()) for x in jax.tree.leaves(params))
    return {
        "init_s": seconds,
        "peak_rss_gib": _peak_rss_gib(),
        "ok": bool(same and finite),
        "param_gib": sum(x.nbytes for x in jax.tree.leaves(params)) / 2**30,
    }


def write_synthetic_checkpoint(directory: str, width: str, layers: int, experts: int, shard_mb: int) -> int:
    """A Kimi-Linear directory at the checkpoint's widths (`width` "full": d_model 2304, KDA 32 x 128,
    MLA 32 heads, 1024-wide experts; "tiny": a few MB for the CPU) with `layers` layers (the last
    MLA) and `experts` routed experts, random bf16 values, Hub tensor names, shards of `shard_mb`
    MB.  Returns its bytes."""
    import jax
    import ml_dtypes
    import numpy as np

    from kimik3 import config as configs, hf, model

    kinds = tuple("mla" if i == layers - 1 else "kda" for i in range(layers))
    cfg = configs.kimi_linear().replace(
        name="kimi_linear_synthetic", n_layers=layers, mixer_layout=kinds, n_routed_experts=experts, vocab_size=32_768
    )
    if width == "tiny":
        cfg = cfg.replace(
            vocab_size=512,
            d_model=64,
            kda_heads=2,
            kda_head_dim=16,
            mla_heads=2,
            kv_lora_rank=32,
            qk_nope_dim=16,
            qk_rope_dim=16,
            v_head_dim=16,
            moe_latent_dim=64,
            moe_expert_dim=32,
            moe_shared_dim=32,
            dense_ffn_dim=128,
        )
    rng = np.random.default_rng(0)
    draw = lambda a: (rng.standard_normal(a.shape, np.float32) * 0.02).astype(
        ml_dtypes.bfloat16 if a.dtype == np.dtype(ml_dtypes.bfloat16) else np.float32
    )
    params = jax.tree.map(draw, model.abstract_params(cfg, "bfloat16"))
    hf.save(directory, params, cfg, names="hub", max_shard_bytes=shard_mb << 20)
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def hf_load_child(directory: str, experts: str | None) -> dict:
    """`kimik3.hf.load` of `directory` onto JAX's first device: seconds, the process's RSS before
    and its peak while loading (sampled every 5 ms), and the loaded bytes."""
    import threading

    import jax
    import psutil

    from kimik3 import hf

    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, stop = [base], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    params, _ = hf.load(directory, experts=experts)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    stop.set()
    watcher.join()
    return {
        "load_s": seconds,
        "baseline_rss_gb": base / 1e9,
        "peak_rss_gb": max(peak[0], proc.memory_info().rss) / 1e9,
        "loaded_gb": sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9,
        "params_in_host_memory": jax.devices()[0].platform == "cpu",
    }


CHILDREN = {"compile": compile_child, "init": init_child, "hf_load": hf_load_child}


def _child(what: str, **kw) -> dict:
    """Run CHILDREN[what](**kw) in a fresh interpreter; its JSON line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.startup", what, json.dumps(kw)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"{what} child exited {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_time(ctx):
    """compile_time: the decode step's compile seconds (as ms) in a fresh process."""
    for case in ctx.cases():
        name, batch = case
        for variant in ["default"] + ctx.wanted():

            def one(variant=variant):
                out = _child("compile", config=name, batch=batch, variant=variant)
                chk = {"max_err": out["max_err"], "tol": 0.0, "ok": out["max_err"] == 0.0}
                return ctx.row(case, chk, 1e3 * out["compile_s"], variant=variant, extra={"run_ms": 1e3 * out["run_s"]})

            yield ctx.attempt(case, variant, one)


def init_time(ctx):
    """init_time: seconds (as ms) to draw the params in a fresh process, and its peak RSS."""
    for case in ctx.cases():
        (name,) = case
        for variant in ["default"] + ctx.wanted():
            if variant == "whole_kernel" and not ctx.on_gpu:
                continue  # a GPU lowering

            def one(variant=variant):
                out = _child("init", config=name, variant=variant)
                chk = {"max_err": 0.0 if out["ok"] else 1.0, "tol": 0.0, "ok": out["ok"]}
                return ctx.row(
                    case,
                    chk,
                    1e3 * out["init_s"],
                    variant=variant,
                    extra={"peak_rss_gib": out["peak_rss_gib"], "param_gib": out["param_gib"]},
                )

            yield ctx.attempt(case, variant, one)


def hf_load(ctx):
    """hf_load: seconds (as ms) to stream a synthetic multi-shard Kimi-Linear directory of the
    checkpoint's widths onto the device, and the peak host RSS while doing it.  The check: the
    loader's own host memory (peak RSS minus the RSS before, minus the loaded bytes where the
    device is the host's memory) stays under a quarter of the directory plus 2 GB."""
    import tempfile

    for case in ctx.cases():
        width, layers, experts, shard_mb = case
        for variant in ["default"] + ctx.wanted():

            def one(variant=variant):
                with tempfile.TemporaryDirectory(prefix="hf_load_") as d:
                    n_bytes = write_synthetic_checkpoint(d, width, layers, experts, shard_mb)
                    out = _child("hf_load", directory=d, experts=None if variant == "default" else variant)
                resident = out["loaded_gb"] if out["params_in_host_memory"] else 0.0
                overhead = out["peak_rss_gb"] - out["baseline_rss_gb"] - resident
                bound = n_bytes / 1e9 / 4 + 2.0
                chk = {"max_err": overhead, "tol": bound, "ok": overhead <= bound}
                return ctx.row(
                    case,
                    chk,
                    1e3 * out["load_s"],
                    variant=variant,
                    extra={"dir_gb": n_bytes / 1e9, "loader_rss_gb": overhead, **out},
                )

            yield ctx.attempt(case, variant, one)


if __name__ == "__main__":
    print(json.dumps(CHILDREN[sys.argv[1]](**json.loads(sys.argv[2]))), flush=True)
