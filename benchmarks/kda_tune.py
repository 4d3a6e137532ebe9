"""Time the two chunk_kda kernels separately on the GPU across settings.

    PYTHONPATH=$PWD python3 benchmarks/kda_tune.py [B T H D]
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kda import inputs, time_jax
from pallas_kernels import kda

PREPARE = [dict(prepare=(4, 1), prepare_dot="tf32x3"), dict(prepare=(4, 1), prepare_dot="tf32"),
           dict(prepare=(2, 1), prepare_dot="tf32x3")]
STATE = [(dict(state=(4, 2)), 64), (dict(state=(4, 2)), 32), (dict(state=(4, 3)), 64), (dict(state=(8, 2)), 128)]


def main():
    b, t, h, d = (int(x) for x in (sys.argv[1:] or ["1", "32768", "32", "128"]))
    q, k, v, g, beta = inputs(jax.random.PRNGKey(1), b, t, h, d, jnp.bfloat16)
    flat = lambda x: x.reshape((b * t,) + x.shape[2:])
    args = [flat(x) for x in (q, k, v, g, beta)]
    prep = None
    for tuning in PREPARE:
        f = jax.jit(lambda *a, tu=tuple(sorted(tuning.items())): kda._chunk_prepare_call(*a, interpret=False, tuning=tu))
        try:
            ms = time_jax(f, *args, iters=10)
            out = f(*args)
            prep = prep or out
            print(f"prepare {tuning}: {ms:.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"prepare {tuning}: FAILED {str(e)[:200]}", flush=True)
    nt = b * t // kda.CHUNK
    chunk_start = jnp.asarray(np.arange(b + 1) * (t // kda.CHUNK), jnp.int32)
    h0 = jnp.zeros((b, h, d, d), jnp.float32)
    for export in (False, True):
        slots = np.full(nt, -1, np.int32)
        if export:
            slots[1::2] = np.arange(nt // 2)  # a state every 128 tokens
        n_ckpt = int((slots >= 0).sum())
        for tuning, block_v in STATE:
            f = jax.jit(lambda p, tu=tuple(sorted(tuning.items())), bv=block_v, n=n_ckpt, s=jnp.asarray(slots):
                        kda._chunk_state_call(p, h0, chunk_start, s, out_dtype=jnp.bfloat16, n_ckpt=n, scale=d ** -0.5,
                                              block_v=bv, interpret=False, tuning=tu))
            try:
                ms = time_jax(f, prep, iters=10)
                print(f"state export={export} {tuning} block_v={block_v}: {ms:.3f} ms", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"state {tuning} block_v={block_v}: FAILED {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
