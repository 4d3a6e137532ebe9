"""Where a speculative decode round's time goes, against the plain decode step (issue 18).

    PYTHONPATH=$PWD python benchmarks/spec_profile.py --config mini --batch 1,8 --k 3 \
        [--target CKPT --draft DIR] [--dtype bfloat16] [--trace /tmp/trace] [--json out.json]

Round and step times do not depend on the weights (only accept lengths do), so random `mini`
weights serve unless --target / --draft name trained ones.  For each batch size B, B requests
are brought into decode in a plain engine and in one with the draft; then, on those live rows:

  engine      the engine's own decode steps, host-timed (the plain engine chains step n + 1 on
              step n's device tokens; the speculative round is synchronous)
  device      the same program dispatched back to back on fixed rows, one sync at the end: the
              device's time per step / round, no host in between
  parts       the round's pieces as separate programs, back to back: the draft (catch-up +
              chain + k draft heads), the verify pass, accept + commit

With --trace, a profiler trace of a few steps and rounds is kept there and its GPU kernels are
summed by name (top 25 per program).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import logging
import time

import numpy as np

log = logging.getLogger(__name__)


def _loop(fn, n: int) -> float:
    """Seconds per call of fn() over n calls dispatched back to back (fn returns what to wait on)."""
    import jax

    for _ in range(3):
        jax.block_until_ready(fn())
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def _live(eng, prompts, max_new: int):
    """Submit prompts and step until every request is decoding; returns the requests."""
    reqs = [eng.submit(p, max_new) for p in prompts]
    while not all(len(r.output) >= 2 for r in reqs):
        eng.step()
    if hasattr(eng, "_settle_decode"):
        eng._settle_decode()
    return reqs


def _engine_steps(eng, n: int) -> tuple[float, int]:
    """(host seconds per engine step, tokens emitted) over n decode steps."""
    before = sum(len(r.output) for r in eng.running)
    t0 = time.perf_counter()
    for _ in range(n):
        eng.step()
    if hasattr(eng, "_settle_decode"):
        eng._settle_decode()
    return (time.perf_counter() - t0) / n, sum(len(r.output) for r in eng.running) - before


def kernel_table(trace_dir: str, top: int = 25) -> list[dict]:
    """GPU kernels of the newest trace under trace_dir, summed by name: [{name, calls, total_us}]."""
    from jax.profiler import ProfileData

    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    data = ProfileData.from_file(path)
    total, calls = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower() or "memcpy" in line.name.lower():
                continue
            for ev in line.events:
                total[ev.name] += ev.duration_ns / 1e3
                calls[ev.name] += 1
    return [dict(name=n[:90], calls=calls[n], total_us=round(t, 1)) for n, t in total.most_common(top)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="mini")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import jax
    import jax.numpy as jnp

    from kimik3 import checkpoint, config, eagle, eagle_train, model
    from serving import model_runner, spec_decode
    from serving.engine import Engine

    if args.target:
        params, cfg = checkpoint.restore(args.target)
    else:
        cfg = config.get_config(args.config)
        params = model.init_params(cfg, jax.random.PRNGKey(0))
    if args.draft:
        draft, ecfg = eagle_train.load_draft(args.draft, cfg, params)
    else:
        ecfg = eagle.default_config(cfg)
        draft = eagle.init_draft(jax.random.PRNGKey(1), cfg, ecfg, params)
    params = model.cast_params(params, jnp.dtype(args.dtype))
    rng = np.random.default_rng(0)
    k = args.k
    results = []
    for b in [int(x) for x in args.batch.split(",")]:
        prompts = [rng.integers(32, 127, args.prompt_len).tolist() for _ in range(b)]  # printable bytes: no specials
        max_new = 4 * args.iters * (k + 1) + 64  # never finishes while timed
        kw = dict(num_pages=8 * b * -(-(args.prompt_len + max_new) // 128) + 8, num_slots=b, num_snapshots=4 * b,
                  page_tokens=128, prefill_chunk_tokens=256, kernels=args.kernels)
        row = dict(batch=b, k=k, config=cfg.name, dtype=args.dtype)

        plain = Engine(params, cfg, **kw)
        reqs = _live(plain, prompts, max_new)
        step_s, toks = _engine_steps(plain, args.iters)
        row.update(plain_engine_step_ms=1e3 * step_s, plain_engine_tok_s=toks / (step_s * args.iters))
        drows = plain._decode_rows(reqs, [r.output[-1] for r in reqs])
        io = {"io": jax.device_put(drows.as_dict()), "pools": plain.pools}

        def plain_step():
            io["pools"], io["io"] = model_runner.decode_program(plain.params, io["pools"], io["io"], cfg=cfg,
                                                                kernels=args.kernels, greedy=True)
            return io["io"]["tokens"]

        row["plain_device_step_ms"] = 1e3 * _loop(plain_step, args.iters)

        spec = Engine(params, cfg, draft=(draft, ecfg), draft_tokens=k, **kw)
        sreqs = _live(spec, prompts, max_new)
        spec.spec.stats = type(spec.spec.stats)()
        step_s, toks = _engine_steps(spec, args.iters // 2)
        st = spec.spec.stats
        row.update(spec_engine_round_ms=1e3 * step_s, spec_round_host_ms_p50=1e3 * float(np.median(st.round_s)),
                   spec_engine_tok_s=toks / (step_s * (args.iters // 2)), accept_length=st.accept_length)
        sd = spec.spec
        static = dict(cfg=cfg, kernels=args.kernels, k=k, page_tokens=sd.page_tokens)
        box = {"rows": jax.device_put(sd._rows(spec, sreqs, spec._decode_bucket(len(sreqs))))}
        kv = spec.kv

        def round_():  # the rows advance on the device from round to round, as in the engine
            kv.pools, kv.dpools, box["rows"], out = spec_decode.spec_step(spec.params, sd.draft, kv.pools, kv.dpools,
                                                                          box["rows"], taps=sd.taps, **static)
            return out

        row["spec_device_round_ms"] = 1e3 * _loop(round_, args.iters)

        draft_prog = jax.jit(functools.partial(spec_decode._draft_body, **static), donate_argnums=(2,))
        verify_prog = jax.jit(functools.partial(spec_decode._verify_body, cfg=cfg, kernels=args.kernels, taps=sd.taps,
                                                k=k), donate_argnums=(2,))

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def accept_commit(pools, dpools, logits, drafts, qs, exports, g, keys, rows):
            a, nxt = spec_decode.accept_on_device(logits, drafts, qs, rows["temperature"], keys[:, k], keys[:, k + 1])
            pools, dpools = spec_decode._commit_body(pools, dpools, exports, g, rows["slots"], a + 1, cfg=cfg)
            return pools, dpools, a, nxt

        state = {}

        def draft_part():
            kv.dpools, drafts, qs, keys = draft_prog(sd.draft, spec.params["embed_vd"], kv.dpools, srows)
            state.update(drafts=drafts, qs=qs, keys=keys)
            return drafts

        def verify_part():
            kv.pools, logits, exports, g = verify_prog(spec.params, sd.draft, kv.pools, srows, state["drafts"])
            state.update(logits=logits, exports=exports, g=g)
            return logits

        def commit_part():
            kv.pools, kv.dpools, a, _ = accept_commit(kv.pools, kv.dpools, state["logits"], state["drafts"],
                                                      state["qs"], state["exports"], state["g"], state["keys"], srows)
            return a

        srows = jax.device_put(sd._rows(spec, sreqs, spec._decode_bucket(len(sreqs))))
        draft_part()
        verify_part()
        row["part_draft_ms"] = 1e3 * _loop(draft_part, args.iters)
        row["part_verify_ms"] = 1e3 * _loop(verify_part, args.iters)
        row["part_accept_commit_ms"] = 1e3 * _loop(commit_part, args.iters)
        if args.trace:
            jax.profiler.start_trace(args.trace)
            for _ in range(10):
                jax.block_until_ready(plain_step())
            for _ in range(10):
                jax.block_until_ready(round_())
            jax.profiler.stop_trace()
            row["kernels_plain10_spec10"] = kernel_table(args.trace)
        results.append(row)
        log.info("%s", json.dumps({k_: v for k_, v in row.items() if not k_.startswith("kernels")}))
        for kr in row.get("kernels_plain10_spec10", []):
            log.info("  %8.1f us %5d  %s", kr["total_us"], kr["calls"], kr["name"])
        for r in reqs + sreqs:
            (plain if r in reqs else spec).cancel(r.request_id)
    meta = dict(device=jax.devices()[0].device_kind, iters=args.iters, rows=results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
