"""The model's commands: `kimik3 generate`, `info`, `quantize`, `train`, `train-tokenizer` and
`train-eagle`, each one's flags (`add_*_arguments`) and its run (`run_*`), listed in `COMMANDS` for
`serving.cli`.  Importing this module imports no JAX: a run imports the modules that use it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from tqdm import tqdm

from kimik3 import config, corpus, quantization, tokenizer
from kimik3.text import load_serving_tokenizer
from kimik3.text.bpe import train_bpe
from serving.cli import MANIFEST_NAMES, SERVING_MANIFESTS


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 generate`'s flags."""
    p.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint directory, or a Hugging Face Kimi-Linear model directory (overrides --config)",
    )
    p.add_argument(
        "--manifest",
        default=None,
        choices=SERVING_MANIFESTS,
        help="load --checkpoint's quantized weights (`kimik3 quantize`) as this manifest",
    )
    p.add_argument("--prompt", default="Hello, Kimi!", help="user message")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'byte', a tokenizer.json, a tiktoken file or a directory holding one (default: the "
        "checkpoint's if it has one, else 'byte')",
    )
    p.add_argument(
        "--prompt-ids",
        default=None,
        metavar="IDS",
        help="the prompt as comma-separated token ids (no chat template), e.g. 5,6,7",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens even past the EOS token")
    p.add_argument("--json", action="store_true", help='print only {"tokens": [...]} (the generated ids)')
    p.add_argument(
        "--logits-out",
        default=None,
        metavar="FILE.npy",
        help="write the fp32 logits [N, vocab] that chose each token (row 0: after the prompt)",
    )
    p.add_argument("--random-images", type=int, default=0, help="attach N random images to the message")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed (without --checkpoint)")
    p.add_argument("--oracle", action="store_true", help="use the no-cache fp32 oracle")
    p.add_argument(
        "--draft-checkpoint",
        default=None,
        metavar="DIR",
        help="an EAGLE-3 draft (`kimik3 train-eagle`): speculative decoding (the target on a cache; "
        "with --oracle the no-cache reference)",
    )
    p.add_argument("--draft-tokens", type=int, default=3, help="k drafted tokens per target pass")
    p.add_argument("--temperature", type=float, default=0.0, help="with a draft: 0 greedy, else rejection sampling")


def run_generate(args) -> int:
    # JAX and the model load when a command runs (the module docstring)
    import jax

    from kimik3 import model
    from kimik3.generate import generate
    from kimik3 import quant_store as store

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
    from kimik3 import eagle_train, speculative  # JAX: loads when the command runs

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


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 info`'s flags."""
    p.add_argument("--config", default="kimi_k3", help="tiny | small | kimi_k3 | kimi_linear | ... (kimik3.config)")
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="a checkpoint or Hugging Face model directory: its config (overrides --config)",
    )
    p.add_argument(
        "--manifest",
        default="kimi_k3_mxfp4",
        choices=sorted(MANIFEST_NAMES),
        help="the storage format of each weight (kimik3.quantization)",
    )


def run_info(args) -> int:
    from kimik3 import sizing  # JAX: loads when the command runs

    if args.checkpoint:
        from kimik3 import checkpoint  # orbax: loads only where a checkpoint's config is read

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


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 quantize`'s flags."""
    p.add_argument("--checkpoint", required=True, help="the bf16 / fp32 checkpoint (`kimik3 train`'s out/checkpoint)")
    p.add_argument("--out", required=True, help="the quantized checkpoint's directory (new)")
    p.add_argument(
        "--keep-bf16-experts",
        action="store_true",
        help="also keep the routed experts unquantized: the *_bf16_moe manifests load too",
    )


def run_quantize(args) -> int:
    from kimik3 import quant_store as store  # JAX: loads when the command runs

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


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 train`'s flags."""
    p.add_argument("--config", default="mini", help="tiny | mini | small")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="windows per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens (bytes) per window")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="run each step's batch as this many sequential micro-batches: the same update, about 1/N the activations",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine to 10%%)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up; None: steps / 10")
    p.add_argument("--eval-every", type=int, default=250, help="held-out loss every this many steps")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches per evaluation (fixed)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: the final checkpoint only")
    p.add_argument(
        "--corpus",
        default="auto",
        help="python-doc (Debian's python3.11-doc) | licenses | auto (the first present) | a directory",
    )
    p.add_argument("--max-corpus-mb", type=float, default=None, help="read at most this much text")
    p.add_argument("--seed", type=int, default=0, help="init and shuffle seed")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="end the run within this long, compiles and evaluations included: the loop stops before a step "
        "that would end it later (the schedule stays the one for --steps)",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="memory the run may hold (default 90%% of the device's free memory); it refuses up front above it",
    )
    p.add_argument("--out", default="runs/train", help="checkpoint/, train.json and loss.png go here")


def run_train(args) -> int:
    from kimik3 import train  # JAX: loads when the command runs

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


def add_train_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 train-tokenizer`'s flags."""
    p.add_argument("--vocab-size", type=int, default=4096, help="ids in all (bytes, special tokens and merges)")
    p.add_argument(
        "--corpus",
        default="auto",
        help="python-doc (Debian's python3.11-doc) | licenses | auto (the first present) | a directory",
    )
    p.add_argument("--out", default="runs/tokenizer", help="tokenizer.json goes here")


def run_train_tokenizer(args) -> int:
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


def add_train_eagle_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 train-eagle`'s flags."""
    p.add_argument("--checkpoint", required=True, help="the target (`kimik3 train`'s out/checkpoint)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--prompt-len", type=int, default=32, help="corpus tokens before the target's continuation")
    p.add_argument("--pool", type=int, default=512, help="sequences generated once, reshuffled every epoch")
    p.add_argument("--data", default="generated", help="generated (the target's greedy continuations) | text")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test depth")
    p.add_argument("--taps", default=None, help="three target layers, e.g. 2,4,5 (default vLLM's 2, L/2, L-3)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=None, help="None: steps / 10")
    p.add_argument("--corpus", default="auto", help="as for `kimik3 train`")
    p.add_argument("--max-corpus-mb", type=float, default=None, help="read at most this much text")
    p.add_argument("--seed", type=int, default=0, help="init and shuffle seed")
    p.add_argument("--out", default="runs/eagle", help="draft/ and eagle_train.json go here")


def run_train_eagle(args) -> int:
    from kimik3 import checkpoint, eagle, eagle_train  # JAX: loads when the command runs

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


# name: (its flags, its run), for `serving.cli.COMMANDS`
COMMANDS = {
    "generate": (add_generate_arguments, run_generate),
    "info": (add_info_arguments, run_info),
    "quantize": (add_quantize_arguments, run_quantize),
    "train": (add_train_arguments, run_train),
    "train-tokenizer": (add_train_tokenizer_arguments, run_train_tokenizer),
    "train-eagle": (add_train_eagle_arguments, run_train_eagle),
}
