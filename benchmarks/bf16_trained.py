"""bf16 against the fp32 oracle on a trained model (issue 16): |logit error| per generated position.

    PYTHONPATH=$PWD python3 benchmarks/bf16_trained.py --config mini --corpus DIR --train-minutes 4 --out DIR
    PYTHONPATH=$PWD python3 benchmarks/bf16_trained.py --checkpoint DIR --corpus DIR --out DIR

Trains `--config` on the corpus for `--train-minutes` (`kimik3.train`, fp32; skipped with
`--checkpoint`), then on `--prompts` held-out prompts of `--prompt-bytes` bytes:

* the oracle: `generate(use_cache=False)` (fp32 params, the whole sequence recomputed each
  step, reference kernels) at the highest matmul precision, `--positions` greedy tokens, and
  its logits at each of them;
* the bf16 model as users run it: params cast to bf16 (`cast_params`: router and KDA gate
  parameters stay fp32), a contiguous bf16 cache, the backend's kernels (Pallas on a GPU),
  default matmul precision, prefilled with the prompt and then teacher-forced one decode step
  per oracle token, so every position compares the same context.

Per position: mean |logit error| over the vocabulary (the issue's figure, averaged over
prompts; its bound is 0.15), the largest error, the logits' scale and the top-1 agreement.
Writes `bf16_trained.json` under `--out` after each prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import checkpoint, config, corpus, generate, model, train

log = logging.getLogger("bf16_trained")


def prompts_of(held_out: np.ndarray, n: int, size: int) -> list[np.ndarray]:
    """n windows of `size` tokens of the held-out ids, at evenly spread offsets."""
    starts = np.linspace(0, held_out.size - size - 1, n).astype(int)
    return [np.asarray(held_out[s:s + size], np.int32) for s in starts]


def bf16_teacher_forced(p16, cfg16, prompt, oracle_tokens, kernels: str) -> np.ndarray:
    """fp32 logits [N, V] of the bf16 model through its cache: the prompt's last position, then
    one decode step per oracle token but the last (the logits that choose token i)."""
    cache = model.init_cache(cfg16, 1, len(prompt) + len(oracle_tokens), jnp.bfloat16)
    logits, cache = model.forward(p16, cfg16, prompt[None], cache=cache, kernels=kernels, programs="whole")
    rows = [np.asarray(logits[0, -1], np.float32)]
    for tok in oracle_tokens[:-1]:
        logits, cache = model.forward(p16, cfg16, np.asarray([[tok]], np.int32), cache=cache, kernels=kernels,
                                      programs="whole")
        rows.append(np.asarray(logits[0, -1], np.float32))
    return np.stack(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="mini")
    ap.add_argument("--checkpoint", default=None, help="trained params (skips training)")
    ap.add_argument("--corpus", default="auto", help="kimik3.corpus source (default: %(default)s)")
    ap.add_argument("--train-minutes", type=float, default=4.0)
    ap.add_argument("--train-steps", type=int, default=3000, help="the schedule's length (default: %(default)s)")
    ap.add_argument("--train-batch", type=int, default=32)
    ap.add_argument("--train-seq-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-bytes", type=int, default=300)
    ap.add_argument("--positions", type=int, default=8)
    ap.add_argument("--kernels", default="auto", help="the bf16 model's kernels (default: %(default)s)")
    ap.add_argument("--out", default="bf16_trained_out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.makedirs(args.out, exist_ok=True)
    result = {"config": args.config, "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d")}
    if args.checkpoint:
        p32, cfg = checkpoint.restore(args.checkpoint, "float32")
    else:
        tc = train.TrainConfig(config=args.config, steps=args.train_steps, batch=args.train_batch,
                               seq_len=args.train_seq_len, lr=3e-3,
                               warmup_steps=min(100, args.train_steps - 1), eval_every=250,
                               eval_batches=min(8, args.train_batch),
                               corpus=args.corpus, out=os.path.join(args.out, "train"), progress=False,
                               max_seconds=args.train_minutes * 60)
        summary, p32 = train.train(tc)
        cfg = config.get_config(args.config)
        result["training"] = {k: summary[k] for k in ("held_out_loss", "held_out_ppl", "initial_held_out_loss",
                                                       "steps_done", "stopped_early") if k in summary}
        log.info("trained: %s", result["training"])
    p32 = model.cast_params(p32, jnp.float32)
    cfg32, cfg16 = cfg.replace(dtype="float32"), cfg.replace(dtype="bfloat16")
    p16 = model.cast_params(p32, jnp.bfloat16)
    held_out = corpus.load(args.corpus).held_out
    rows = []
    for i, prompt in enumerate(prompts_of(held_out, args.prompts, args.prompt_bytes)):
        with jax.default_matmul_precision("highest"):
            oracle = generate.generate(p32, cfg32, prompt, args.positions, use_cache=False, stop_at_eos=False)
        got = bf16_teacher_forced(p16, cfg16, prompt, oracle.tokens, args.kernels)
        err = np.abs(got - oracle.logits)
        rows.append({"prompt": i, "mean_abs_err": err.mean(-1).tolist(), "max_abs_err": err.max(-1).tolist(),
                     "logit_max_abs": np.abs(oracle.logits).max(-1).tolist(),
                     "top1_same": (got.argmax(-1) == oracle.tokens).tolist()})
        log.info("prompt %d: mean |err| per position %s", i, np.round(err.mean(-1), 3).tolist())
        mean = np.mean([r["mean_abs_err"] for r in rows], 0)
        result.update(prompts=rows, mean_abs_err_per_position=mean.tolist(),
                      worst_position_mean_abs_err=float(mean.max()),
                      top1_agreement=float(np.mean([r["top1_same"] for r in rows])))
        with open(os.path.join(args.out, "bf16_trained.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "prompts"}), flush=True)


if __name__ == "__main__":
    main()
