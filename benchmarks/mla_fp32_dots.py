"""fp32 MLA prefill on the GPU: each dot algorithm's error against the fp32 reference, and time.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 benchmarks/mla_fp32_dots.py [--out results.jsonl]

`small`'s MLA dims, the GPU test's shapes (tests/gpu/test_fp32_kernels.py): a 300-token chunk
after 0 and 200 cached tokens over latent pages, and packed fresh tokens.  Per algorithm
(`pallas_kernels.dots.GPU_DOT_ALGORITHMS`): max abs error, elements over the test's 1e-3
tolerance, ms per call (10 calls back to back, one sync), or the error it raised.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import config
from pallas_kernels import mla
from tests.gpu.test_fp32_kernels import _latent_prefix  # the GPU test's own inputs

CFG = config.small()
T = 300


def cases():
    h, dqk, dv = CFG.mla_heads, CFG.qk_nope_dim + CFG.qk_rope_dim, CFG.v_head_dim
    scale = dqk ** -0.5
    for cached in (0, 200):
        rng = np.random.default_rng(2)
        prefix = _latent_prefix(rng, 1, 128, 8, [cached])
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
        q, k, v = f(1, T, h, dqk), f(1, T, h, dqk), f(1, T, h, dv)
        ref = mla.mla_prefill_ref(q[0], k[0], v[0], cu_seqlens=[0, T], scale=scale, prefix=prefix)[0]
        run = lambda dots, q=q, k=k, v=v, prefix=prefix: mla.mla_prefill_chunk(
            q, k, v, prefix, scale=scale, rope_dim=CFG.qk_rope_dim, fp32_dots=dots)[0][0]
        yield f"chunk after {cached}", run, ref
    rng = np.random.default_rng(3)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v = f(T + 77, h, dqk), f(T + 77, h, dqk), f(T + 77, h, dv)
    cu = [0, T, T + 77]
    ref = mla.mla_prefill_ref(q, k, v, cu_seqlens=cu, scale=scale)[0]
    yield "fresh", lambda dots: mla.mla_prefill(q, k, v, cu_seqlens=cu, scale=scale, rope_dim=CFG.qk_rope_dim,
                                                 fp32_dots=dots)[0], ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--algorithms", default="tf32,ieee")
    args = ap.parse_args()
    for name, run, ref in cases():
        ref = np.asarray(ref, np.float32)
        for dots in args.algorithms.split(","):
            row = {"case": name, "fp32_dots": dots}
            try:
                got = np.asarray(jax.block_until_ready(run(dots)), np.float32)
                err = np.abs(got - ref)
                row.update(max_abs=float(err.max()), over_tol=int((err > 1e-3 + 1e-3 * np.abs(ref)).sum()),
                           elements=int(err.size))
                t = time.perf_counter()
                for _ in range(10):
                    out = run(dots)
                jax.block_until_ready(out)
                row["ms"] = (time.perf_counter() - t) * 100
            except Exception as e:  # noqa: BLE001 (the probe reports what each choice raises)
                row["error"] = f"{type(e).__name__}: {e}"[:1500]
                row["where"] = traceback.format_exc()[-1500:]
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(line + "\n")


if __name__ == "__main__":
    main()
