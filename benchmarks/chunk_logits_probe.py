"""The chunk-over-a-cache logits of `small`'s dims (4 layers, bf16) on each chunk kernel against the
model in fp32 on the reference kernels: the model-level check of
`tests/gpu/test_dispatch_and_serving.py`'s chunk test, runnable anywhere (Mosaic GPU's and
Triton's interpreters off the GPU: minutes on 2 CPU cores).  Prints each path's mean |logit
error| and its argmax agreement with fp32.

    PYTHONPATH=$PWD python3 benchmarks/chunk_logits_probe.py
"""
import os, time
import jax, jax.numpy as jnp, numpy as np
from kimik3 import config, model

cfg = config.small().replace(n_layers=4)
params = model.init_params(cfg, jax.random.PRNGKey(4))
tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (1, 160)), jnp.int32)

def chunk_logits(p, c, kernels):
    cache = model.init_cache(c, 1, 256)
    _, cache = model.forward(p, c, tokens[:, :128], cache=cache, kernels=kernels)
    return np.asarray(model.forward(p, c, tokens[:, 128:], cache=cache, kernels=kernels)[0], np.float32)

t0 = time.time()
with jax.default_matmul_precision("highest"):
    want = chunk_logits(model.cast_params(params, jnp.float32), cfg.replace(dtype="float32"), "reference")
print("ref", time.time() - t0, flush=True)
bf = chunk_logits(params, cfg, "reference")
print("bf16 reference kernels: mean |err|", float(np.abs(bf - want).mean()), time.time() - t0, flush=True)
for choice in ("triton", "hopper"):
    os.environ["KIMIK3_MLA_CHUNK"] = choice
    jax.clear_caches()
    got = chunk_logits(params, cfg, "pallas")
    print(choice, "mean |err|", float(np.abs(got - want).mean()), "argmax agree", float(np.mean(got.argmax(-1) == want.argmax(-1))),
          time.time() - t0, flush=True)
