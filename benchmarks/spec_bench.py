"""Decode speed of the serving engine with and without EAGLE-3 speculative decoding (issue 18).

    PYTHONPATH=$PWD python benchmarks/spec_bench.py --target runs/mini/checkpoint --draft runs/eagle/draft \
        --batch 1,8 --k 3 --max-new 128 [--dtype bfloat16] [--json out.json]

For each batch size B: B greedy requests (prompts: the first --prompt-len tokens of held-out
corpus windows, never trained on) through `serving.engine.Engine` without a draft, then with
the draft at each k, in one process on one device.  Each engine first serves the same batch
twice (compiles, the second with prefix hits: not timed), then again, timed.  Reported per engine: decode tokens/s (tokens
after each request's first, over the span from the first request's first token to the last
token), TPOT p50, and with the draft its acceptance, accept length (tokens per verify pass)
and the round's period as the host sees it (catch-up + chain + verify + accept + commit; rounds
are chained, so it is the time between reads of consecutive rounds, dispatch to read for a lone one);
`same_tokens` counts requests whose tokens equal the plain engine's (greedy: they must, up to
the rounding of another kernel order at bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _serve(eng, prompts, max_new: int):
    reqs = [eng.submit(p, max_new) for p in prompts]
    eng.run()
    return reqs


def _row(eng, reqs, label: str, batch: int, plain_out=None) -> dict:
    first = min(r.token_times_s[0] for r in reqs)
    last = max(r.token_times_s[-1] for r in reqs)
    decoded = sum(len(r.output) - 1 for r in reqs)
    tpot = [(r.token_times_s[-1] - r.token_times_s[0]) / (len(r.output) - 1) for r in reqs if len(r.output) > 1]
    row = dict(engine=label, batch=batch, decode_tok_s=decoded / (last - first), tpot_ms_p50=1e3 * statistics.median(tpot),
               tokens=decoded)
    if eng.spec is not None:
        s = eng.spec.stats
        row.update(acceptance=s.acceptance, accept_length=s.accept_length,
                   round_ms_p50=1e3 * statistics.median(s.round_s))
        if plain_out is not None:
            row["same_tokens"] = sum(r.output == o for r, o in zip(reqs, plain_out))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--corpus", default="auto")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--k", default="3")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", help="serve the target in this dtype (the draft stays fp32)")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from kimik3 import checkpoint, corpus, eagle_train, model
    from serving.engine import Engine

    params, cfg = checkpoint.restore(args.target)
    draft, ecfg = eagle_train.load_draft(args.draft, cfg, params)
    params = model.cast_params(params, jnp.dtype(args.dtype))
    text = corpus.load(args.corpus)
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batch.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    starts = rng.integers(0, text.held_out.size - args.prompt_len, size=max(batches))
    prompts = [text.held_out[s:s + args.prompt_len].tolist() for s in starts]
    rows = []
    for b in batches:
        kw = dict(num_pages=max(64, 4 * b * -(-(args.prompt_len + args.max_new + 16) // 128)), num_slots=max(b, 1),
                  num_snapshots=4 * max(b, 1), page_tokens=128, prefill_chunk_tokens=256, kernels=args.kernels)
        plain = Engine(params, cfg, **kw)
        for _ in range(2):  # compiles (the second run's prefix hits take other prefill shapes)
            _serve(plain, prompts[:b], args.max_new)
        t0 = time.perf_counter()
        reqs = _serve(plain, prompts[:b], args.max_new)
        plain_row = dict(_row(plain, reqs, "plain", b), wall_s=time.perf_counter() - t0)
        rows.append(plain_row)
        plain_out = [r.output for r in reqs]
        print(rows[-1], flush=True)
        for k in ks:
            eng = Engine(params, cfg, draft=(draft, ecfg), draft_tokens=k, **kw)
            for _ in range(2):
                _serve(eng, prompts[:b], args.max_new)
            eng.spec.stats = type(eng.spec.stats)()  # count the timed run only
            t0 = time.perf_counter()
            reqs = _serve(eng, prompts[:b], args.max_new)
            row = dict(_row(eng, reqs, f"eagle3 k={k}", b, plain_out), wall_s=time.perf_counter() - t0)
            rows.append(dict(row, speedup=row["decode_tok_s"] / plain_row["decode_tok_s"]))
            print(rows[-1], flush=True)
    meta = dict(target=args.target, config=cfg.name, dtype=args.dtype, prompt_len=args.prompt_len,
                max_new=args.max_new, device=jax.devices()[0].device_kind, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    for r in rows:
        print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
