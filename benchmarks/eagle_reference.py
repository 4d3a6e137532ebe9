"""Draft acceptance of an EAGLE-3 head through the speculative reference (`kimik3.speculative`).

    PYTHONPATH=$PWD python benchmarks/eagle_reference.py --target runs/tiny/checkpoint \
        --draft runs/eagle/draft --prompts 16 --max-new 64 --k 1,2,3,4 [--json out.json]

Prompts are the first --prompt-len bytes of held-out corpus windows (`kimik3.corpus`, never
trained on); every run is greedy and checked token for token against the oracle (`generate`,
no cache, fp32).  Prints, per k: draft acceptance (kept / drafted), accept length (tokens per
target pass) and the acceptance at each draft position (P(a >= j)), with a bootstrap 95% CI
over prompts for the accept length.  The reference recomputes everything, so its seconds say
nothing; with --cached the target keeps its cache and each k is timed (compiles excluded) beside
plain cached greedy decoding: on a host-bound CPU run, a first look, not the engine's speed.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--corpus", default="auto")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--k", default="1,2,3,4")
    ap.add_argument("--cached", action="store_true",
                    help="the target on its cache (`use_cache=True`, still fp32 and oracle-checked), timed beside "
                         "`generate(use_cache=True)`")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from kimik3 import checkpoint, corpus, eagle_train, speculative
    from kimik3.generate import generate

    params, cfg = checkpoint.restore(args.target)
    draft, ecfg = eagle_train.load_draft(args.draft, cfg, params)
    held = corpus.load(args.corpus).held_out
    rng = np.random.default_rng(0)
    starts = rng.integers(0, held.size - args.prompt_len, size=args.prompts)
    prompts = [held[s:s + args.prompt_len].tolist() for s in starts]
    oracle = [generate(params, cfg, p, args.max_new).tokens for p in prompts]
    plain_s = None
    if args.cached:  # the plain cached decode, timed after a warm-up run (compiles excluded)
        generate(params, cfg, prompts[0], args.max_new, use_cache=True)
        t0 = time.perf_counter()
        for p in prompts:
            generate(params, cfg, p, args.max_new, use_cache=True)
        plain_s = time.perf_counter() - t0
        print(f"generate(use_cache=True): {plain_s:.2f} s for {args.prompts} x {args.max_new} tokens", flush=True)
    rows = []
    for k in (int(x) for x in args.k.split(",")):
        spec = lambda p: speculative.speculative_generate(params, cfg, draft, ecfg, p, args.max_new, k,
                                                          use_cache=args.cached)
        if args.cached:
            spec(prompts[0])  # compiles
        t0 = time.perf_counter()
        runs = [spec(p) for p in prompts]
        seconds = time.perf_counter() - t0
        assert all(np.array_equal(r.tokens, o) for r, o in zip(runs, oracle)), "speculative != oracle"
        acc = [a for r in runs for a in r.accepted]
        per_prompt = np.array([r.accept_length for r in runs])
        boot = [np.mean(rng.choice(per_prompt, per_prompt.size)) for _ in range(2000)]
        row = dict(k=k, acceptance=sum(acc) / (len(acc) * k), accept_length=float(np.mean([a + 1 for a in acc])),
                   accept_length_ci=[float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
                   by_position=[float(np.mean([a >= j for a in acc])) for j in range(1, k + 1)],
                   target_passes=len(acc) + len(runs), seconds=seconds)
        rows.append(row)
        print(f"k={k}: acceptance {row['acceptance']:.3f}, accept length {row['accept_length']:.2f} "
              f"(95% CI {row['accept_length_ci'][0]:.2f}-{row['accept_length_ci'][1]:.2f}), by position "
              + " ".join(f"{x:.2f}" for x in row["by_position"])
              + (f"; {seconds:.2f} s ({plain_s / seconds:.2f}x generate(use_cache=True))" if args.cached else ""),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(target=cfg.name, taps=list(ecfg.taps), prompts=args.prompts, prompt_len=args.prompt_len,
                           max_new=args.max_new, cached=args.cached, plain_cached_seconds=plain_s, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
