"""Time the chunk_kda kernels separately on the GPU across settings.

    PYTHONPATH=$PWD python3 benchmarks/kda_tune.py [B T H D] [--prepare-only]

The prepare step is timed whole for every PREPARE setting, and for the "split"
implementation also kernel by kernel (intra: A / decays, solve: (I + A)^-1 and W, U).
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kda import inputs, time_jax
from pallas_kernels import kda

PREPARE = [dict(prepare=(4, 1), prepare_dot="bf16", prepare_impl="fused"),
           dict(prepare_impl="split"),  # the defaults
           dict(prepare_impl="split", intra=(4, 1)),
           dict(prepare_impl="split", intra=(4, 2)),
           dict(prepare_impl="split", intra=(8, 2)),
           dict(prepare_impl="split", intra=(16, 1)),
           dict(prepare_impl="split", prepare_dot="tf32x3")]
STATE = [(dict(state=(4, 3)), 32), (dict(state=(4, 3)), 16), (dict(state=(4, 2)), 32), (dict(state=(8, 3)), 32),
         (dict(state=(4, 3)), 64)]


def time_split_kernels(args, tu):
    """The split prepare's two kernels, each on its own."""
    q, k, v, g, beta = args
    intra = jax.jit(lambda q, k, g, beta: kda._split_intra_call(q, k, g, beta, interpret=False, tuning=tu))
    try:
        ms = time_jax(intra, q, k, g, beta, iters=10)
        _, _, _, _, akk, kbg = intra(q, k, g, beta)
        print(f"  split intra: {ms:.3f} ms", flush=True)
        solve = jax.jit(lambda akk, kbg, v, beta: kda._split_solve_call(akk, kbg, v, beta, interpret=False,
                                                                        tuning=tu, in_dtype=q.dtype))
        print(f"  split solve: {time_jax(solve, akk, kbg, v, beta, iters=10):.3f} ms", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"  split kernels: FAILED {str(e)[:200]}", flush=True)


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--")]
    prepare_only = "--prepare-only" in sys.argv[1:]
    b, t, h, d = (int(x) for x in (argv or ["1", "32768", "32", "128"]))
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
            continue
        if tuning.get("prepare_impl") == "split":
            time_split_kernels(args, tuple(sorted(tuning.items())))
    if prepare_only:
        return
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
