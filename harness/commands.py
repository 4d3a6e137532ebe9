"""The harnesses' commands: `kimik3 demo`, `coverage`, `media-bench` and `eagle-ab`, each one's flags
(`add_*_arguments`) and its run (`run_*`), listed in `COMMANDS` for `serving.cli`.  Importing this
module imports no JAX: a run imports the modules that use it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

from cache.mooncake_tier import MooncakeHostKVTier, MooncakeServices
from harness import coverage
from kimik3 import config
from serving.cli import SERVING_MANIFESTS
from serving.workload import WorkloadSpec


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 demo`'s flags."""
    p.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    p.add_argument("--sessions", type=int, default=8, help="multi-turn agent sessions (all arrive at once)")
    p.add_argument(
        "--num-pages",
        type=int,
        default=48,
        help="GPU pool pages per engine (32 tokens each): below the sessions' histories, so turns are "
        "evicted and the host tier's hits show",
    )
    p.add_argument("--seed", type=int, default=0, help="weights' and workload's seed")
    p.add_argument("--out", default="out", help="the report's JSON and plot go here")
    p.add_argument("--checkpoint", default=None, help="serve these weights (overrides --config; default random)")
    p.add_argument(
        "--manifest",
        default=None,
        choices=SERVING_MANIFESTS,
        help="load --checkpoint's quantized weights (`kimik3 quantize`) as this manifest",
    )


def run_demo(args) -> int:
    from harness import demo  # JAX: loads when the command runs (the module docstring)

    spec = demo.DemoSpec(
        config=args.config,
        sessions=args.sessions,
        seed=args.seed,
        checkpoint=args.checkpoint,
        manifest=args.manifest,
        num_pages=args.num_pages,
    )
    print(demo.main(spec, args.out))
    return 0


def add_coverage_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 coverage`'s flags."""
    p.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    p.add_argument("--engines", type=int, default=3, help="engines sharing the store")
    p.add_argument("--sessions", type=int, default=12, help="agent sessions")
    p.add_argument("--min-turns", type=int, default=20, help="turns per session, at least")
    p.add_argument("--max-turns", type=int, default=30, help="turns per session, at most")
    p.add_argument("--scale", type=float, default=8.0, help="divide docs/design.md's token counts by this")
    p.add_argument("--store-mb", type=int, default=1024, help="Mooncake memory server size")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--out", default="out", help="the report goes here")


def run_coverage(args) -> int:
    cfg = config.get_config(args.config)
    workload = WorkloadSpec.scaled(
        args.scale, sessions=args.sessions, seed=args.seed, turns=(args.min_turns, args.max_turns)
    )
    spec = coverage.CoverageSpec(engines=args.engines, seed=args.seed)
    rows = []
    services = None
    try:
        for name in coverage.CONFIGS:
            shared = None
            if name == "shared":
                services = MooncakeServices(segment_bytes=args.store_mb << 20).start()
                shared = MooncakeHostKVTier(services.master_addr, services.metadata_url)
            with tqdm(desc=f"coverage [{name}]", unit="turn", leave=False) as bar:

                def progress(done, total, bar=bar):
                    bar.total = total
                    bar.update(done - bar.n)

                rows.append(coverage.replay(cfg, workload, spec, name, shared, progress))
            if shared is not None:
                shared.close()
    finally:
        if services is not None:
            services.stop()
    print(
        f"workload: {args.sessions} sessions, {rows[0].turns} turns, token counts / {args.scale:g} of docs/design.md; "
        f"{args.engines} engines; GPU pool = {rows[0].gpu_pages_per_engine} pages of "
        f"128 tokens per engine (about half of its share of the working set)"
    )
    print(coverage.format_table(rows))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "coverage.png")
    coverage.plot(rows, path)
    print(f"plot: {path}")
    return 0


def add_media_bench_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 media-bench`'s flags."""
    p.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--fetch-latency-ms", type=float, default=50.0, help="the local image server's answer delay")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="the params' dtype (default the config's); tokens must agree across tiers only in exact fp32",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows here")


def run_media_bench(args) -> int:
    from harness import media_bench  # JAX: loads when the command runs (the module docstring)

    spec = media_bench.MediaBenchSpec(
        config=args.config,
        sessions=args.sessions,
        turns=args.turns,
        fetch_latency_ms=args.fetch_latency_ms,
        seed=args.seed,
        dtype=args.dtype,
    )
    print(media_bench.main(spec, args.json))
    return 0


def add_eagle_ab_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 eagle-ab`'s flags."""
    p.add_argument("--checkpoint", required=True, help="the target (`kimik3 train`'s out/checkpoint)")
    p.add_argument("--draft-checkpoint", required=True, help="its draft (`kimik3 train-eagle`'s out/draft)")
    p.add_argument("--quick", action="store_true", help="a CPU run: 4 questions, 24 tokens a turn, 16-token pages")
    p.add_argument("--questions", type=int, default=None, help="the first N questions (default 80; --quick 4)")
    p.add_argument("--questions-file", default=None, help="MT-Bench questions (default: the packaged copy)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default 128; --quick 24)")
    p.add_argument("--draft-tokens", type=int, default=None, help="k (default 3)")
    p.add_argument("--page-tokens", type=int, default=None, help="default 128; --quick 16")
    p.add_argument("--num-slots", type=int, default=None, help="conversations at a time (default 8; --quick 4)")
    p.add_argument("--bootstrap", type=int, default=None, help="paired bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, default=None, help="sampling and bootstrap seed (default 0)")
    p.add_argument("--dtype", default=None, help="serve the target in this dtype (default: the checkpoint's)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the arms and the differences here")


def run_eagle_ab(args) -> int:
    # JAX loads when the command runs (the module docstring)
    import jax.numpy as jnp

    from harness import eagle_ab
    from kimik3 import checkpoint, eagle_train, model

    params, cfg = checkpoint.restore(args.checkpoint)
    draft = eagle_train.load_draft(args.draft_checkpoint, cfg, params)
    if args.dtype:
        params = model.cast_params(params, jnp.dtype(args.dtype))
    kw = {
        name: getattr(args, name)
        for name in ("questions", "max_new_tokens", "draft_tokens", "page_tokens", "num_slots", "bootstrap", "seed")
        if getattr(args, name) is not None
    }
    ac = eagle_ab.ABConfig.quick(**kw) if args.quick else eagle_ab.ABConfig(**kw)
    result = eagle_ab.run(
        params,
        cfg,
        draft,
        ac,
        questions_path=args.questions_file,
        progress=lambda arm, n: print(f"  {arm}: {n} conversations", file=sys.stderr, flush=True),
    )
    print(
        f"two-turn MT-Bench A/B: {result['arms']['drop']['questions']} conversations, {cfg.name} "
        f"({jnp.dtype(params['embed_vd'].dtype).name}), k={ac.draft_tokens}, greedy, {ac.max_new_tokens} tokens a "
        f"turn, {ac.page_tokens}-token pages; second turns:"
    )
    print(eagle_ab.report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


# name: (its flags, its run), for `serving.cli.COMMANDS`
COMMANDS = {
    "demo": (add_demo_arguments, run_demo),
    "coverage": (add_coverage_arguments, run_coverage),
    "media-bench": (add_media_bench_arguments, run_media_bench),
    "eagle-ab": (add_eagle_ab_arguments, run_eagle_ab),
}
