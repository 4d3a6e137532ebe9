"""KDA kernels on the GPU, against fla measured in the same run.

    PYTHONPATH=$PWD python3 benchmarks/kda.py [--quick] [--out DIR]

Needs fla (`fla-core` 0.6.0) importable for the peer columns; without it the
fla columns are left empty.  Prints a markdown table and writes it (and JSON)
under --out.  Sections:

1. correctness on the GPU: chunk_kda / fused_recurrent_kda vs the fp32 reference
   (relative L2 error), and vs fla on the same bf16 inputs;
2. prefill: ours with and without checkpoint export vs fla `chunk_kda`;
3. checkpoint export vs the align / partial replays on a 16k-token prefill;
4. decode (T=1) on pooled states vs fla `fused_recurrent_kda`, as state
   bytes/s against the copy bandwidth measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.common import time_jax
from pallas_kernels import kda

try:
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fused_recurrent_kda_fwd
except Exception as e:  # noqa: BLE001 - the peer is optional
    print(f"fla unavailable ({e!r}); peer columns stay empty", file=sys.stderr)
    torch = None


def inputs(key, b, t, h, d, dtype):
    ks = jax.random.split(key, 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (b, t, h, d))).astype(dtype)
    k = unit(jax.random.normal(ks[1], (b, t, h, d))).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, h, d)).astype(dtype)
    g = (-5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (b, t, h, d)) - 2.0)).astype(jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))).astype(dtype)
    return q, k, v, g, beta


def time_torch(fn, iters=20, warmup=3):
    """fla's ms per call by the same rule as ours (`common.time_torch_pipelined`: calls back to
    back, one sync; ours: a jitted device-side loop or `common.pipelined_ms`).  Session 9's per-call CUDA
    events counted fla's Python launch cost against it."""
    return common.time_torch_pipelined(fn, iters=iters, warmup=warmup)


def to_torch(x):
    return torch.from_dlpack(jax.block_until_ready(x)) if torch is not None else None


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def section_correctness(rows, impls=("split",)):
    key = jax.random.PRNGKey(0)
    for dtype, t in ((jnp.float32, 300), (jnp.bfloat16, 300)):
        q, k, v, g, beta = inputs(key, 2, t, 4, 128, dtype)
        h0 = jax.random.normal(key, (2, 4, 128, 128), jnp.float32)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, g, beta)]
        o_ref, s_ref = jax.jit(kda.kda_recurrent_ref)(*f32, initial_state=h0)
        _, s128 = jax.jit(kda.kda_recurrent_ref)(*[x[:, :128] for x in f32], initial_state=h0)
        for impl in impls:  # each prepare implementation, compiled by Triton
            try:
                o, s, ck = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         checkpoint_positions=[128, 256], tuning={"prepare_impl": impl})
            except Exception as e:  # noqa: BLE001 - report and go on: one GPU call measures every variant
                rows.append(dict(section="correctness", case=f"chunk_kda prepare={impl}", failed=repr(e)[:300]))
                continue
            rows.append(dict(section="correctness", case=f"chunk_kda {jnp.dtype(dtype).name} T{t} prepare={impl}",
                             o_rel=rel_err(o, o_ref), state_rel=rel_err(s, s_ref),
                             ckpt128_rel=rel_err(ck[:, 0], s128)))
        pool = jax.random.normal(key, (8, 4, 128, 128), jnp.float32)
        slots = jnp.array([6, 1], jnp.int32)
        init = pool[slots]
        qd, kd, vd, gd, bd = [x[:, :3] for x in (q, k, v, g, beta)]
        o_d, pool2 = kda.fused_recurrent_kda(qd, kd, vd, gd, bd, state_pool=pool, slots=slots)
        o_r, s_r = jax.jit(kda.kda_recurrent_ref)(*[x.astype(jnp.float32) for x in (qd, kd, vd, gd, bd)],
                                                  initial_state=init)
        rows.append(dict(section="correctness", case=f"fused_recurrent {jnp.dtype(dtype).name} T3",
                         o_rel=rel_err(o_d, o_r), state_rel=rel_err(pool2[slots], s_r)))
    if torch is not None:
        q, k, v, g, beta = inputs(key, 1, 4096, 8, 128, jnp.bfloat16)
        o_f, s_f = fla_chunk_kda(*(to_torch(x) for x in (q, k, v, g, beta)), output_final_state=True)
        o_ref, s_ref = jax.jit(kda.kda_chunked_ref)(*[x.astype(jnp.float32) for x in (q, k, v, g, beta)])
        for impl in impls:
            try:
                o, s, _ = kda.chunk_kda(q, k, v, g, beta, output_final_state=True, tuning={"prepare_impl": impl})
            except Exception as e:  # noqa: BLE001
                rows.append(dict(section="correctness", case=f"bf16 T4096 prepare={impl}", failed=repr(e)[:300]))
                continue
            rows.append(dict(section="correctness",
                             case=f"bf16 T4096 H8 prepare={impl}: ours vs fp32 ref / fla vs fp32 ref",
                             o_rel=rel_err(o, o_ref), fla_o_rel=rel_err(o_f.float().cpu().numpy(), o_ref),
                             state_rel=rel_err(s, s_ref), fla_state_rel=rel_err(s_f.float().cpu().numpy(), s_ref)))


def section_prefill(rows, shapes, tunings, copy_gbs):
    """Prefill with and without exporting a state at every 128 and 1536 multiple, vs fla.
    export_floor: the exported fp32 states' bytes at the run's copy rate, as a fraction of
    the pass without export (the overhead that writing them costs at the least)."""
    for b, t, h, d in shapes:
        q, k, v, g, beta = inputs(jax.random.PRNGKey(1), b, t, h, d, jnp.bfloat16)
        positions = sorted(set(range(128, t + 1, 128)) | set(range(1536, t + 1, 1536)))
        best = None
        for tuning in tunings:
            plain = jax.jit(lambda *a, tu=tuning: kda.chunk_kda(*a, output_final_state=True, tuning=tu)[:2])
            try:
                ms = common.pipelined_ms(plain, q, k, v, g, beta, iters=10)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile must not end the run
                rows.append(dict(section="prefill tuning", case=f"B{b} T{t} H{h} D{d}", tuning=str(tuning),
                                 failed=repr(e)[:300]))
                print(f"prefill {tuning}: FAILED {e!r:.300}", flush=True)
                continue
            print(f"prefill B{b} T{t} H{h} D{d} {tuning}: {ms:.3f} ms", flush=True)
            rows.append(dict(section="prefill tuning", case=f"B{b} T{t} H{h} D{d}", tuning=str(tuning), ms=ms))
            best = min(best or (ms, tuning), (ms, tuning), key=lambda x: x[0])
        if best is None:
            continue
        ms_plain, tuning = best
        export = jax.jit(lambda *a: kda.chunk_kda(*a, output_final_state=True, checkpoint_positions=positions,
                                                  tuning=tuning))
        # the best of three: one 10-call batch at B1 T32768 read 7.2 ms where the same program
        # alone reads 3.07 (session 32, `kda_export_probe.py`); a lone batch can catch a stall
        ms_export = min(common.pipelined_ms(export, q, k, v, g, beta, iters=10) for _ in range(3))
        ms_fla = vs_fla = None
        if torch is not None:
            tq, tk, tv, tg, tb = (to_torch(x) for x in (q, k, v, g, beta))
            ms_fla = time_torch(lambda: fla_chunk_kda(tq, tk, tv, tg, tb, output_final_state=True))
            o_fla, s_fla = fla_chunk_kda(tq, tk, tv, tg, tb, output_final_state=True)
            o, s, _ = export(q, k, v, g, beta)
            vs_fla = (rel_err(o[:, :2048], o_fla[:, :2048].float().cpu().numpy()),
                      rel_err(s, s_fla.float().cpu().numpy()))
        rows.append(dict(section="prefill", case=f"B{b} T{t} H{h} D{d} bf16", tuning=str(tuning), ours_ms=ms_plain,
                         ours_export_ms=ms_export, fla_ms=ms_fla, n_ckpt=len(positions),
                         export_overhead=ms_export / ms_plain - 1,
                         export_floor=b * len(positions) * h * d * d * 4 / (copy_gbs * 1e9) / (ms_plain * 1e-3),
                         export_vs_fla=(ms_export / ms_fla) if ms_fla else None,
                         mtok_s=b * t / (ms_export * 1e-3) / 1e6,
                         o_and_state_rel_diff_vs_fla=vs_fla))
        print(rows[-1], flush=True)


def section_modes(rows, t=16384, h=32, d=128):
    q, k, v, g, beta = inputs(jax.random.PRNGKey(2), 1, t, h, d, jnp.bfloat16)
    positions = sorted(set(range(128, t + 1, 128)) | set(range(1536, t + 1, 1536)))
    ckpt = jax.jit(lambda *a: kda.chunk_kda(*a, checkpoint_positions=positions))
    align = jax.jit(lambda *a: kda.chunk_kda_replay(*a, mode="align"))
    partial = jax.jit(lambda *a: kda.chunk_kda_replay(*a, mode="partial"))
    ms = {name: common.pipelined_ms(f, q, k, v, g, beta, iters=10) for name, f in
          (("checkpoint", ckpt), ("align", align), ("partial", partial))}
    rows.append(dict(section="modes", case=f"B1 T{t} H{h} D{d} bf16, states at 1536/128 multiples",
                     checkpoint_ms=ms["checkpoint"], align_ms=ms["align"], partial_ms=ms["partial"],
                     vs_align=ms["checkpoint"] / ms["align"], vs_partial=ms["checkpoint"] / ms["partial"]))


def section_decode(rows, copy_gbs, batches=(64, 128, 256, 512), h=32, d=128, reps=50,
                   tilings=((64, 8), (64, 8, True), (32, 4), (64, 4), (32, 2), (128, 8))):
    """Ours at each (block_v, num_warps) (the first is the default; each checked against it) vs
    fla's `fused_recurrent_kda` (fla 0.6: 32 columns a program on 4 warps, 2 stages), same inputs
    and state, and vs fla's kernel as vLLM calls it for decode (`fused_recurrent_kda_fwd` on a
    state pool by slot, in place: our exact work; its outputs checked against ours)."""
    for b in batches:
        q, k, v, g, beta = inputs(jax.random.PRNGKey(3), b, 1, h, d, jnp.bfloat16)
        n_slots = b * 2
        pool = jax.random.normal(jax.random.PRNGKey(4), (n_slots, h, d, d), jnp.float32)
        slots = jax.random.permutation(jax.random.PRNGKey(5), n_slots)[:b].astype(jnp.int32)
        ms_by, err_by, want, ms_by_rolled = {}, {}, None, {}
        for bv, warps, *hints in tilings:  # (block_v, num_warps[, cache_hints])
            hints = bool(hints and hints[0])

            # `reps` steps launched back to back in one program (unrolled: the rule fla is timed by,
            # its calls issued back to back then one sync); a rolled loop is XLA's while, whose
            # predicate the host reads every step on the GPU, kept beside it for the default
            def make_loop(unroll, bv=bv, warps=warps, hints=hints):
                def loop(pool):
                    def body(_, p):
                        _, p = kda._fused_recurrent_core(q, k, v, g, beta, p, slots, jnp.ones((b,), jnp.int32),
                                                         scale=d ** -0.5, block_v=bv, interpret=False,
                                                         num_warps=warps, cache_hints=hints)
                        return p
                    return jax.lax.fori_loop(0, reps, body, pool, unroll=unroll)
                return jax.jit(loop)

            loop = make_loop(True)

            key = f"{bv},{warps}" + (",hints" if hints else "")
            try:
                got = np.asarray(loop(jnp.copy(pool))[slots[:4]])
            except Exception as e:  # noqa: BLE001 - a tiling Triton refuses is reported, not fatal
                err_by[key] = f"{type(e).__name__}: {str(e)[:100]}"
                continue
            want = got if want is None else want
            err_by[key] = rel_err(got, want)
            ms_by[key] = time_jax(loop, pool, iters=5) / reps
            if not ms_by_rolled:
                ms_by_rolled[key] = time_jax(make_loop(1), pool, iters=5) / reps
        best = min(ms_by, key=ms_by.get)
        ms = ms_by[best]
        state_bytes = 2 * b * h * d * d * 4
        ms_fla = None
        if torch is not None:
            tq, tk, tv, tg, tb = (to_torch(x) for x in (q, k, v, g, beta))
            h0 = torch.randn(b, h, d, d, device="cuda", dtype=torch.float32)
            ms_fla = time_torch(lambda: fla_fused_recurrent_kda(tq, tk, tv, tg, tb, initial_state=h0,
                                                                output_final_state=True), iters=50)
        # fla as vLLM's decode calls it: states in a pool by slot, updated in place (our work exactly;
        # `out` given, so no memset), checked against ours on the same pool first
        ms_fla_pool = fla_pool_err = None
        if torch is not None:
            pool_t = to_torch(jnp.copy(pool))
            slots_t = to_torch(slots)
            out_t = torch.empty_like(tv)
            fla_pool = lambda: fla_fused_recurrent_kda_fwd(tq, tk, tv, tg, tb, initial_state=pool_t, scale=d ** -0.5,
                                                           inplace_final_state=True, ssm_state_indices=slots_t,
                                                           out=out_t)
            fla_pool()
            torch.cuda.synchronize()
            o_ours, pool_ours = kda._fused_recurrent_core(q, k, v, g, beta, jnp.copy(pool), slots,
                                                           jnp.ones((b,), jnp.int32), scale=d ** -0.5,
                                                           block_v=tilings[0][0], interpret=False,
                                                           num_warps=tilings[0][1])
            fla_pool_err = max(rel_err(np.asarray(out_t.float().cpu()), np.asarray(o_ours, np.float32)),
                               rel_err(np.asarray(pool_t.cpu())[np.asarray(slots)], np.asarray(pool_ours[slots])))
            ms_fla_pool = time_torch(fla_pool, iters=50)
        rows.append(dict(section="decode", case=f"B{b} T1 H{h} D{d} bf16", ours_ms=ms, best_tiling=best,
                         ours_default_ms=ms_by.get(f"{tilings[0][0]},{tilings[0][1]}"), fla_ms=ms_fla,
                         fla_pool_ms=ms_fla_pool, fla_pool_rel_err_vs_ours=fla_pool_err,
                         ours_vs_fla_pool=(ms / ms_fla_pool) if ms_fla_pool else None,
                         ours_vs_fla=(ms / ms_fla) if ms_fla else None,
                         ours_gbs=state_bytes / (ms * 1e-3) / 1e9,
                         fla_gbs=(state_bytes / (ms_fla * 1e-3) / 1e9) if ms_fla else None,
                         copy_gbs=copy_gbs, ours_of_copy=state_bytes / (ms * 1e-3) / 1e9 / copy_gbs,
                         ms_by_tiling=ms_by, default_rolled_loop_ms=ms_by_rolled, rel_err_vs_default=err_by))
        print(rows[-1], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default="correctness,prefill,modes,decode")
    ap.add_argument("--shapes", default=None, help="prefill shapes BxTxHxD,... (default: the issue's three)")
    ap.add_argument("--tunings", default='[{}, {"intra": [16, 1]}]',
                    help='JSON list of kda.TUNING overrides to time in the prefill section, e.g. '
                         '\'[{}, {"gcum": "xla"}, {"prepare_impl": "fused"}]\' ({} = the defaults)')
    ap.add_argument("--prepare-impl", default="split",
                    help="prepare implementations to check in the correctness section: fused,split")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip sections that start after this many seconds")
    args = ap.parse_args()
    t_start = time.perf_counter()
    in_budget = lambda: time.perf_counter() - t_start < args.budget_s
    sections = args.sections.split(",")
    rows = []
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    ceil = common.ceilings()
    copy_gbs = ceil["copy_gbs"]
    rows.append(dict(section="roofline", case=f"copy 1 GiB (read+write): {ceil['copy_source']}", **ceil))
    if "correctness" in sections:
        section_correctness(rows, impls=args.prepare_impl.split(","))
        print("correctness done", flush=True)
    if "prefill" in sections and in_budget():
        shapes = [(1, 8192, 32, 128)] if args.quick else [(1, 32768, 32, 128), (8, 4096, 32, 128), (4, 8192, 12, 128)]
        if args.shapes:
            shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
        tunings = [{k: tuple(v) if isinstance(v, list) else v for k, v in tu.items()}
                   for tu in json.loads(args.tunings)]
        section_prefill(rows, shapes, tunings, copy_gbs)
        print("prefill done", flush=True)
    if "modes" in sections and in_budget():
        section_modes(rows, t=4096 if args.quick else 16384)
        print("modes done", flush=True)
    if "decode" in sections and in_budget():
        section_decode(rows, copy_gbs)
    common.write_results(args.out, "kda_bench", rows)

if __name__ == "__main__":
    main()
