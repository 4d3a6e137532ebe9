"""The `kimik3` command line.

kimik3 generate --config tiny --prompt "Hello"      greedy generation
kimik3 info --config kimi_k3                         sizes of a config
kimik3 train --config mini --steps 3000 --out runs/mini
                                                     train on Debian-shipped text (held-out perplexity)
kimik3 train-tokenizer --vocab-size 4096 --out runs/bpe
                                                     a byte-level BPE (tokenizer.json) on Debian-shipped text
kimik3 train-eagle --checkpoint runs/mini/checkpoint --out runs/eagle
                                                     an EAGLE-3 draft head for a trained target
kimik3 generate --checkpoint C --draft-checkpoint D --draft-tokens 3
                                                     speculative decoding (reference): acceptance
kimik3 quantize --checkpoint runs/mini/checkpoint --out runs/mini/quantized
                                                     one checkpoint for the fp8_attn / mxfp8_attn manifests
kimik3 generate --checkpoint runs/mini/quantized --manifest fp8_attn
                                                     generation on the quantized weights
kimik3 coverage --engines 3                          cache coverage: GPU / + host / + shared store
kimik3 demo                                          the agent workload end to end, 4 serving setups
kimik3 plan --config kimi_k3 --prefill tp8,ep8 --decode dp16,ep16
                                                     memory per rank and bytes per collective
kimik3 worker --role prefill|decode|both --port N    one engine in its own process (HTTP)
kimik3 router --port N --prefill URL... --decode URL...
                                                     OpenAI-compatible, load-aware router
kimik3 launch --config tiny --port N --prefill 1 --decode 1
                                                     store + workers + router in one command
kimik3 serve tiny --port N --max-model-len 1024 --max-num-seqs 8
                                                     one model behind the OpenAI API, vLLM's flags
kimik3 bench serve --base-url URL --dataset-name random|multiturn|mt-bench
                                                     load an OpenAI server: vLLM's throughput and latencies
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time

import numpy as np

from kimik3 import compile_cache


def _cmd_generate(args) -> int:
    import jax

    from kimik3 import config, model, tokenizer
    from kimik3.generate import generate
    from kimik3 import quant_store as store
    from kimik3.text import load_serving_tokenizer

    if args.manifest and not args.checkpoint:
        raise ValueError("--manifest names the quantized weights of a checkpoint: pass --checkpoint DIR")
    if args.checkpoint:
        params, cfg = store.load_params(args.checkpoint, args.manifest)
    else:
        cfg = config.get_config(args.config)
        params = model.init_params(cfg, jax.random.PRNGKey(args.seed))
    images = None
    n_images = args.random_images
    if n_images:
        if cfg.vit is None:
            raise ValueError(f"config {cfg.name} has no vision encoder")
        size = cfg.vit.image_size
        images = np.random.default_rng(args.seed).random((n_images, size, size, cfg.vit.channels), np.float32)
    tpi = cfg.vit.tokens_per_image if cfg.vit else 0
    tok = load_serving_tokenizer(args.tokenizer, args.checkpoint, cfg.vocab_size)
    if n_images and tok.image_id != tokenizer.IMAGE_ID:
        raise ValueError(f"the tokenizer {tok.name} has no image placeholder at the model's id {tokenizer.IMAGE_ID}")
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids, cfg.vocab_size)
        if n_images:
            raise ValueError("--prompt-ids takes no --random-images (the ids hold no placeholders)")
    else:
        prompt = tok.apply_chat_template(
            [tokenizer.Message("user", args.prompt, n_images=n_images)], tokens_per_image=tpi
        )
    if args.draft_checkpoint:
        return _generate_speculative(args, params, cfg, prompt, images)
    t0 = time.perf_counter()
    result = generate(
        params,
        cfg,
        prompt,
        args.max_new_tokens,
        images=images,
        use_cache=not args.oracle,
        stop_at_eos=not args.ignore_eos,
        eos_id=tok.eos_id,
    )
    dt = time.perf_counter() - t0
    if args.logits_out:
        np.save(args.logits_out, result.logits.astype(np.float32))
    if args.json:
        print(json.dumps({"tokens": result.tokens.tolist()}))
        return 0
    print(
        f"config={cfg.name} prompt_tokens={len(prompt)} images={n_images} "
        f"mode={'oracle (no cache, fp32)' if args.oracle else 'cached'}"
    )
    print(f"tokens: {result.tokens.tolist()}")
    print(f"text: {tok.decode(result.tokens, skip_special=False)!r}")
    print(
        f"{len(result.tokens)} tokens in {dt:.2f} s (compile included); weights are "
        f"{'from ' + args.checkpoint if args.checkpoint else 'random (seed %d)' % args.seed}"
        f"{' as ' + args.manifest if args.manifest else ''}"
    )
    return 0


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    """ "5,6,7" -> [5, 6, 7], each in [0, vocab_size); ValueError naming the bad entry."""
    out = []
    for part in text.split(","):
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"--prompt-ids: {part.strip()!r} is not an integer id") from None
        if not 0 <= out[-1] < vocab_size:
            raise ValueError(f"--prompt-ids: id {out[-1]} is outside the vocabulary [0, {vocab_size})")
    return out


def _generate_speculative(args, params, cfg, prompt, images) -> int:
    from kimik3 import eagle_train, speculative, tokenizer

    if not args.checkpoint:
        raise ValueError("--draft-checkpoint needs the target it was trained for: pass --checkpoint")
    if images is not None:
        raise ValueError("speculative decoding takes text prompts (no --random-images)")
    draft, ecfg = eagle_train.load_draft(args.draft_checkpoint, cfg, params)
    t0 = time.perf_counter()
    r = speculative.speculative_generate(
        params,
        cfg,
        draft,
        ecfg,
        prompt,
        args.max_new_tokens,
        args.draft_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stop_at_eos=True,
        use_cache=not args.oracle,
    )
    dt = time.perf_counter() - t0
    print(
        f"config={cfg.name} prompt_tokens={len(prompt)} mode=speculative (EAGLE-3, k={r.k}, "
        f"temperature={args.temperature:g}; {'no cache (the reference)' if args.oracle else 'cached'}, fp32)"
    )
    print(f"tokens: {r.tokens.tolist()}")
    print(f"text: {tokenizer.decode(r.tokens, skip_special=False)!r}")
    print(
        f"{len(r.tokens)} tokens in {len(r.accepted) + 1} target passes: draft acceptance {r.acceptance:.3f}, "
        f"accept length {r.accept_length:.2f}; {dt:.2f} s (compile included)"
    )
    return 0


def _cmd_eagle_ab(args) -> int:

    import jax.numpy as jnp

    from kimik3 import checkpoint, eagle_train, model
    from serving import eagle_ab

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


def _cmd_train_eagle(args) -> int:
    from kimik3 import checkpoint, eagle, eagle_train

    params, cfg = checkpoint.restore(args.checkpoint)
    dc = eagle_train.DraftTrainConfig(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        prompt_len=args.prompt_len,
        pool=args.pool,
        data=args.data,
        ttt_steps=args.ttt_steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else args.steps // 10,
        seed=args.seed,
        corpus=args.corpus,
        max_corpus_bytes=args.max_corpus_mb and int(args.max_corpus_mb * 1e6),
        out=args.out,
    )
    ecfg = eagle.default_config(cfg, ttt_steps=args.ttt_steps)
    if args.taps:
        ecfg = eagle.EagleConfig(
            taps=tuple(int(t) for t in args.taps.split(",")), ffn_dim=ecfg.ffn_dim, ttt_steps=args.ttt_steps
        )
    r, _ = eagle_train.train_draft(params, cfg, dc, ecfg)
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)
    print(
        f"{r['corpus']}\ntrained the EAGLE-3 draft of {cfg.name} (taps {tuple(ecfg.taps)}) for {dc.steps} steps "
        f"in {r['seconds']:.1f} s on {r['device']} ({r['data_seconds']:.1f} s building {dc.data} data)\n"
        f"held-out top-1 agreement with the target per draft position: {fmt(r['held_out_before']['acc'])} -> "
        f"{fmt(r['held_out_after']['acc'])}\n"
        f"draft {os.path.join(dc.out, 'draft')}; {os.path.join(dc.out, 'eagle_train.json')}"
    )
    return 0


def _cmd_train(args) -> int:
    from kimik3 import train

    tc = train.TrainConfig(
        config=args.config,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else args.steps // 10,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        corpus=args.corpus,
        max_corpus_bytes=args.max_corpus_mb and int(args.max_corpus_mb * 1e6),
        out=args.out,
        max_seconds=args.max_minutes and args.max_minutes * 60,
        grad_accum=args.grad_accum,
        memory_budget=args.memory_gib and int(args.memory_gib * 2**30),
    )
    result, _ = train.train(tc)
    stopped = f" (time limit: stopped at step {result['steps_done']} of {tc.steps})" if result["stopped_early"] else ""
    print(
        f"{result['corpus']}\ntrained {result['config']} for {result['steps_done']} steps{stopped} "
        f"({result['tokens']:,} tokens) in {result['seconds']:.1f} s ({result['setup_seconds']:.1f} s of it "
        f"set-up) on {result['device']}: held-out loss {result['initial_held_out_loss']:.3f} -> "
        f"{result['held_out_loss']:.3f} nats/byte (perplexity {result['held_out_ppl']:.2f})\n"
        f"checkpoint {result['checkpoint']}; {os.path.join(tc.out, 'train.json')}, {os.path.join(tc.out, 'loss.png')}"
    )
    return 0


def _cmd_train_tokenizer(args) -> int:
    from kimik3 import corpus
    from kimik3.text.bpe import train_bpe

    source, files = corpus.find_sources(args.corpus)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "tokenizer.json")

    def texts():
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()

    tok = train_bpe(texts(), args.vocab_size, out)
    sample = open(files[0], encoding="utf-8", errors="replace").read()
    ratio = len(sample.encode()) / max(1, len(tok.encode(sample)))
    print(
        f"{out}: a byte-level BPE of {tok.vocab_size} ids on {source} ({len(files)} files); {ratio:.2f} bytes per "
        f"token on {os.path.basename(files[0])}.  Serve it with --tokenizer {args.out} (ids 0..266 are the byte "
        f"tokenizer's: a model's vocab_size must cover {tok.vocab_size})"
    )
    return 0


def _cmd_info(args) -> int:
    from kimik3 import config, quantization, sizing

    if args.checkpoint:
        from kimik3 import checkpoint

        cfg = checkpoint.load_config(args.checkpoint)
    else:
        cfg = config.get_config(args.config)
    manifest = quantization.MANIFESTS[args.manifest]
    print(f"config        {cfg.name}")
    print(f"layers        {cfg.n_layers} ({cfg.mixer_kinds.count('kda')} KDA, {cfg.mixer_kinds.count('mla')} MLA)")
    print(f"params        {sizing.param_count(cfg):,}")
    print(f"active/token  {sizing.active_param_count(cfg):,}")
    print(f"weight bytes  {sizing.weight_bytes(cfg, manifest):,} ({args.manifest})")
    bf16 = sizing.weight_bytes(cfg, quantization.BF16)
    print("per manifest  (weight bytes; saved against bf16)")
    for name in ("bf16", "kimi_k3_mxfp4") + quantization.SERVING_MANIFESTS:
        n = sizing.weight_bytes(cfg, quantization.MANIFESTS[name])
        print(f"  {name:22s} {n / 1e9:12,.3f} GB  {(bf16 - n) / 1e9:12,.3f} GB")
    return 0


def _cmd_quantize(args) -> int:
    from tqdm import tqdm

    from kimik3 import quant_store as store

    with tqdm(desc="quantize", unit="tensor") as bar:

        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        record = store.quantize_checkpoint(
            args.checkpoint, args.out, keep_bf16_experts=args.keep_bf16_experts, progress=progress
        )
    print(f"wrote {args.out}: {record['config']} for the manifests {', '.join(record['manifests'])}")
    for name, n in record["bytes"].items():
        print(f"  {name:22s} {n / 2**20:10.1f} MiB of weights")
    counts = ", ".join(f"{len(e)} {fmt}" for fmt, e in sorted(record["entries"].items()))
    print(f"  stored once each: {counts} tensors; load with --checkpoint {args.out} --manifest NAME")
    return 0


def _cmd_media_bench(args) -> int:
    from serving import media_bench

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


def _cmd_coverage(args) -> int:
    import os

    from tqdm import tqdm

    from cache.mooncake_tier import MooncakeHostKVTier, MooncakeServices
    from kimik3 import config
    from serving import coverage
    from serving.workload import WorkloadSpec

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


def _cmd_demo(args) -> int:
    from serving import demo

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


# the manifest names, here so that --help needs no model import (tests/serving check them against
# kimik3.quantization)
SERVING_MANIFESTS = ("fp8_attn", "mxfp8_attn", "fp8_attn_bf16_moe", "mxfp8_attn_bf16_moe")
MANIFEST_NAMES = ("bf16", "kimi_k3_mxfp4") + SERVING_MANIFESTS

PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


def gpu_memory_on_demand() -> None:
    """The command-line entry points grow GPU memory on demand instead of JAX's default of
    reserving 75% of the card up front: the reservation costs ~3.4 GiB of host memory on an H200
    (the driver's bookkeeping for ~104 GiB; RESULTS.md, serving), more than a `small` engine's
    whole working set, and every worker process on a host pays it.  Before any backend starts;
    a value the user set wins, and children inherit it."""
    os.environ.setdefault(PREALLOCATE_ENV, "false")


def standalone_main(prog: str, doc: str | None, add_arguments, run, argv=None) -> int:
    """`python -m serving.<module>`: the module's own arguments, logging at its --log-level, run."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    gpu_memory_on_demand()
    compile_cache.enable()
    return run(args)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help (unless the help names its default, or there is none
    to show: None, a switch); descriptions (module docstrings) keep their lines."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in help_.lower():
            return help_
        return super()._get_help_string(action)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `kimik3` parser; `command`: the subcommand being run (its module's arguments are added;
    the other module-owned subcommands are listed without importing their modules)."""
    # no abbreviated options: `_command_of` finds the subcommand in argv before parsing
    parser = argparse.ArgumentParser(
        prog="kimik3", description=__doc__, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help=f"persistent XLA compilation cache (default ${compile_cache.ENV} or "
        f"{compile_cache.DEFAULT_DIR}; 'off' disables)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # every subcommand: -v after it too, defaults shown in --help, its docstring's layout kept
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    add = functools.partial(sub.add_parser, parents=[common], formatter_class=HelpFormatter)

    g = add("generate", help="greedy generation from a config (random weights) or a checkpoint")
    g.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    g.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint directory, or a Hugging Face Kimi-Linear model directory (overrides --config)",
    )
    g.add_argument(
        "--manifest",
        default=None,
        choices=SERVING_MANIFESTS,
        help="load --checkpoint's quantized weights (`kimik3 quantize`) as this manifest",
    )
    g.add_argument("--prompt", default="Hello, Kimi!", help="user message")
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'byte', a tokenizer.json, a tiktoken file or a directory holding one (default: the "
        "checkpoint's if it has one, else 'byte')",
    )
    g.add_argument(
        "--prompt-ids",
        default=None,
        metavar="IDS",
        help="the prompt as comma-separated token ids (no chat template), e.g. 5,6,7",
    )
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens even past the EOS token")
    g.add_argument("--json", action="store_true", help='print only {"tokens": [...]} (the generated ids)')
    g.add_argument(
        "--logits-out",
        default=None,
        metavar="FILE.npy",
        help="write the fp32 logits [N, vocab] that chose each token (row 0: after the prompt)",
    )
    g.add_argument("--random-images", type=int, default=0, help="attach N random images to the message")
    g.add_argument("--seed", type=int, default=0, help="random weights' seed (without --checkpoint)")
    g.add_argument("--oracle", action="store_true", help="use the no-cache fp32 oracle")
    g.add_argument(
        "--draft-checkpoint",
        default=None,
        metavar="DIR",
        help="an EAGLE-3 draft (`kimik3 train-eagle`): speculative decoding (the target on a cache; "
        "with --oracle the no-cache reference)",
    )
    g.add_argument("--draft-tokens", type=int, default=3, help="k drafted tokens per target pass")
    g.add_argument("--temperature", type=float, default=0.0, help="with a draft: 0 greedy, else rejection sampling")
    g.set_defaults(func=_cmd_generate)

    d = add("demo", help="the multi-turn agent workload end to end: colocated vs P/D, +/- host tier")
    d.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    d.add_argument("--sessions", type=int, default=8, help="multi-turn agent sessions (all arrive at once)")
    d.add_argument(
        "--num-pages",
        type=int,
        default=48,
        help="GPU pool pages per engine (32 tokens each): below the sessions' histories, so turns are "
        "evicted and the host tier's hits show",
    )
    d.add_argument("--seed", type=int, default=0, help="weights' and workload's seed")
    d.add_argument("--out", default="out", help="the report's JSON and plot go here")
    d.add_argument("--checkpoint", default=None, help="serve these weights (overrides --config; default random)")
    d.add_argument(
        "--manifest",
        default=None,
        choices=SERVING_MANIFESTS,
        help="load --checkpoint's quantized weights (`kimik3 quantize`) as this manifest",
    )
    d.set_defaults(func=_cmd_demo)

    q = add("quantize", help="one quantized checkpoint for the fp8_attn and mxfp8_attn manifests")
    q.add_argument("--checkpoint", required=True, help="the bf16 / fp32 checkpoint (`kimik3 train`'s out/checkpoint)")
    q.add_argument("--out", required=True, help="the quantized checkpoint's directory (new)")
    q.add_argument(
        "--keep-bf16-experts",
        action="store_true",
        help="also keep the routed experts unquantized: the *_bf16_moe manifests load too",
    )
    q.set_defaults(func=_cmd_quantize)

    c = add("coverage", help="replay the agent workload through the cache tiers")
    c.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    c.add_argument("--engines", type=int, default=3, help="engines sharing the store")
    c.add_argument("--sessions", type=int, default=12, help="agent sessions")
    c.add_argument("--min-turns", type=int, default=20, help="turns per session, at least")
    c.add_argument("--max-turns", type=int, default=30, help="turns per session, at most")
    c.add_argument("--scale", type=float, default=8.0, help="divide docs/design.md's token counts by this")
    c.add_argument("--store-mb", type=int, default=1024, help="Mooncake memory server size")
    c.add_argument("--seed", type=int, default=0, help="workload seed")
    c.add_argument("--out", default="out", help="the report goes here")
    c.set_defaults(func=_cmd_coverage)

    m = add("media-bench", help="the media cache's ablation: TTFT and hit rates, none .. all four tiers")
    m.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    m.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    m.add_argument("--turns", type=int, default=4, help="turns per session")
    m.add_argument("--fetch-latency-ms", type=float, default=50.0, help="the local image server's answer delay")
    m.add_argument("--seed", type=int, default=0, help="workload seed")
    m.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="the params' dtype (default the config's); tokens must agree across tiers only in exact fp32",
    )
    m.add_argument("--json", default=None, metavar="PATH", help="write the rows here")
    m.set_defaults(func=_cmd_media_bench)

    t = add("train", help="train a config on Debian-shipped text: held-out perplexity, an orbax checkpoint")
    t.add_argument("--config", default="mini", help="tiny | mini | small")
    t.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    t.add_argument("--batch", type=int, default=32, help="windows per step")
    t.add_argument("--seq-len", type=int, default=512, help="tokens (bytes) per window")
    t.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="run each step's batch as this many sequential micro-batches: the same update, about 1/N the activations",
    )
    t.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine to 10%%)")
    t.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up; None: steps / 10")
    t.add_argument("--eval-every", type=int, default=250, help="held-out loss every this many steps")
    t.add_argument("--eval-batches", type=int, default=16, help="held-out batches per evaluation (fixed)")
    t.add_argument("--checkpoint-every", type=int, default=0, help="0: the final checkpoint only")
    t.add_argument(
        "--corpus",
        default="auto",
        help="python-doc (Debian's python3.11-doc) | licenses | auto (the first present) | a directory",
    )
    t.add_argument("--max-corpus-mb", type=float, default=None, help="read at most this much text")
    t.add_argument("--seed", type=int, default=0, help="init and shuffle seed")
    t.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="end the run within this long, compiles and evaluations included: the loop stops before a step "
        "that would end it later (the schedule stays the one for --steps)",
    )
    t.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="memory the run may hold (default 90%% of the device's free memory); it refuses up front above it",
    )
    t.add_argument("--out", default="runs/train", help="checkpoint/, train.json and loss.png go here")
    t.set_defaults(func=_cmd_train)

    tt = add("train-tokenizer", help="train a byte-level BPE (tokenizer.json) on Debian-shipped text")
    tt.add_argument("--vocab-size", type=int, default=4096, help="ids in all (bytes, special tokens and merges)")
    tt.add_argument(
        "--corpus",
        default="auto",
        help="python-doc (Debian's python3.11-doc) | licenses | auto (the first present) | a directory",
    )
    tt.add_argument("--out", default="runs/tokenizer", help="tokenizer.json goes here")
    tt.set_defaults(func=_cmd_train_tokenizer)

    ab = add("eagle-ab", help="the EAGLE-3 tail-block A/B (drop / no-drop / exact) on two-turn MT-Bench")
    ab.add_argument("--checkpoint", required=True, help="the target (`kimik3 train`'s out/checkpoint)")
    ab.add_argument("--draft-checkpoint", required=True, help="its draft (`kimik3 train-eagle`'s out/draft)")
    ab.add_argument("--quick", action="store_true", help="a CPU run: 4 questions, 24 tokens a turn, 16-token pages")
    ab.add_argument("--questions", type=int, default=None, help="the first N questions (default 80; --quick 4)")
    ab.add_argument("--questions-file", default=None, help="MT-Bench questions (default: the packaged copy)")
    ab.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default 128; --quick 24)")
    ab.add_argument("--draft-tokens", type=int, default=None, help="k (default 3)")
    ab.add_argument("--page-tokens", type=int, default=None, help="default 128; --quick 16")
    ab.add_argument("--num-slots", type=int, default=None, help="conversations at a time (default 8; --quick 4)")
    ab.add_argument("--bootstrap", type=int, default=None, help="paired bootstrap resamples (default 2000)")
    ab.add_argument("--seed", type=int, default=None, help="sampling and bootstrap seed (default 0)")
    ab.add_argument("--dtype", default=None, help="serve the target in this dtype (default: the checkpoint's)")
    ab.add_argument("--json", default=None, metavar="PATH", help="write the arms and the differences here")
    ab.set_defaults(func=_cmd_eagle_ab)

    e = add("train-eagle", help="train an EAGLE-3 draft head on a trained target's continuations")
    e.add_argument("--checkpoint", required=True, help="the target (`kimik3 train`'s out/checkpoint)")
    e.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    e.add_argument("--batch", type=int, default=16, help="sequences per step")
    e.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    e.add_argument("--prompt-len", type=int, default=32, help="corpus tokens before the target's continuation")
    e.add_argument("--pool", type=int, default=512, help="sequences generated once, reshuffled every epoch")
    e.add_argument("--data", default="generated", help="generated (the target's greedy continuations) | text")
    e.add_argument("--ttt-steps", type=int, default=3, help="training-time-test depth")
    e.add_argument("--taps", default=None, help="three target layers, e.g. 2,4,5 (default vLLM's 2, L/2, L-3)")
    e.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    e.add_argument("--warmup-steps", type=int, default=None, help="None: steps / 10")
    e.add_argument("--corpus", default="auto", help="as for `kimik3 train`")
    e.add_argument("--max-corpus-mb", type=float, default=None, help="read at most this much text")
    e.add_argument("--seed", type=int, default=0, help="init and shuffle seed")
    e.add_argument("--out", default="runs/eagle", help="draft/ and eagle_train.json go here")
    e.set_defaults(func=_cmd_train_eagle)

    i = add("info", help="parameter count and weight bytes of a config")
    i.add_argument("--config", default="kimi_k3", help="tiny | small | kimi_k3 | kimi_linear | ... (kimik3.config)")
    i.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="a checkpoint or Hugging Face model directory: its config (overrides --config)",
    )
    i.add_argument(
        "--manifest",
        default="kimi_k3_mxfp4",
        choices=sorted(MANIFEST_NAMES),
        help="the storage format of each weight (kimik3.quantization)",
    )
    i.set_defaults(func=_cmd_info)

    # Subcommands whose modules own their arguments: only the one being run is imported (the
    # serving ones pull in the HTTP stack and JAX), so `kimik3 --help`, `info`, ... start fast and
    # run without fastapi; a missing package is named when its command is chosen.
    import importlib

    for name, (module_name, help_) in MODULE_COMMANDS.items():
        if name != command:
            add(name, help=help_)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            p = add(name, help=f"{help_} (unavailable: needs {e.name})")
            p.set_defaults(func=functools.partial(_missing, name, e.name))
            continue
        p = add(name, help=help_, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


MODULE_COMMANDS = {
    "serve": (
        "serving.serve",
        "serve a model behind the OpenAI API with vLLM's flags: a router and one colocated worker",
    ),
    "plan": ("sharding.plan", "memory per rank and bytes per collective of TP/EP prefill and DP/EP decode meshes"),
    "worker": ("serving.worker", "one engine in its own process, behind HTTP (health, load, drain)"),
    "router": ("serving.router", "OpenAI-compatible router over prefill/decode workers"),
    "launch": ("serving.launch", "a Mooncake store, prefill/decode workers and a router in one command"),
    "bench": (
        "serving.bench_serve",
        "benchmarks against a running server: `bench serve` loads an OpenAI server and reports vLLM's metrics",
    ),
}


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in argv (the first word that is not an option or an option's value)."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--compile-cache":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def _missing(command: str, module: str, args) -> int:
    print(
        f"kimik3: error: `kimik3 {command}` needs the Python package {module!r}, which is not installed "
        f"(pip install 'kimik3[serve]', or ./run.sh test to set up the full environment)",
        file=sys.stderr,
    )
    return 2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args.func, "func", None) is not _missing:  # only an unavailable command takes anything
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    gpu_memory_on_demand()
    compile_cache.enable(args.compile_cache)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kimik3: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
