"""Quantized manifests on a trained model (issue 20): held-out perplexity and greedy next-token
agreement, bf16 vs fp8_attn vs mxfp8_attn (both with MXFP4 experts) and the *_bf16_moe variants;
and the fused quantized groups against their members bit for bit on the trained weights.

    PYTHONPATH=$PWD python3 benchmarks/quant_accuracy.py --config mini --corpus DIR --train-minutes 3 --out DIR
    PYTHONPATH=$PWD python3 benchmarks/quant_accuracy.py --checkpoint DIR --corpus DIR --out DIR

Trains `--config` (`kimik3.train`, fp32; skipped with `--checkpoint`), writes the quantized
checkpoint (`kimik3.quant.store.quantize_checkpoint`, experts kept in bf16 too) and loads each
manifest from it.  On `--windows` held-out windows of `--window` tokens, teacher-forced, no
cache, the backend's kernels (Pallas on a GPU), params in bf16 as served:

* held-out loss (nats / token) and perplexity per manifest;
* greedy agreement: the share of positions whose argmax equals the bf16 model's (and the fp32
  model's) argmax.

Writes `quant_accuracy.json` under --out as it goes.
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

from kimik3 import checkpoint, corpus, model, ops, train
from kimik3.quant import formats, store

log = logging.getLogger("quant_accuracy")
GROUPS = {"kda": ("w_q_dhk", "w_k_dhk", "w_v_dhv", "w_fa_dr", "w_beta_dh", "w_ga_dr"),
          "mla": ("w_qa_dq", "w_kva_dr", "w_gate_dhv")}


def windows_of(held_out: np.ndarray, n: int, size: int) -> np.ndarray:
    starts = np.linspace(0, held_out.size - size - 2, n).astype(int)
    return np.stack([held_out[s:s + size + 1] for s in starts]).astype(np.int32)


def evaluate(params, cfg, windows: np.ndarray, kernels: str, batch: int = 4):
    """(mean next-token loss, argmax [W, T]) of teacher-forced windows [W, T + 1]."""
    losses, argmax = [], []
    for i in range(0, len(windows), batch):
        w = jnp.asarray(windows[i:i + batch])
        logits = model.forward(params, cfg, w[:, :-1], kernels=kernels, programs="whole")[0].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        losses.append(np.asarray(-jnp.take_along_axis(logp, w[:, 1:, None], axis=-1)[..., 0]))
        argmax.append(np.asarray(jnp.argmax(logits, axis=-1)))
    return float(np.concatenate(losses).mean()), np.concatenate(argmax)


def fused_bit_exact(path: str, manifest: str, cfg, kernels: str, rng) -> dict:
    """Per group: whether the fused GEMM's columns equal each member's GEMM on the trained weights."""
    fused, _ = store.load(path, manifest)
    apart, _ = store.load(path, manifest, fuse=False)
    x = jnp.asarray(rng.standard_normal((16, cfg.d_model)), jnp.bfloat16)
    out = {}
    for i in range(cfg.n_layers):
        for kind, members in GROUPS.items():
            layer = apart[f"layer_{i}"].get(kind)
            if layer is None:
                continue
            y = np.asarray(ops.linear(x, fused[f"layer_{i}"][kind]["w_in_dx"], kernels=kernels), np.float32)
            start, same = 0, True
            for name in members:
                q = layer[name]
                assert isinstance(q, formats.QTensor)
                same &= bool(np.array_equal(y[:, start:start + q.shape[1]],
                                            np.asarray(ops.linear(x, q, kernels=kernels), np.float32)))
                start += q.shape[1]
            out[f"layer_{i}/{kind}"] = same
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="mini")
    ap.add_argument("--checkpoint", default=None, help="trained params (skips training)")
    ap.add_argument("--corpus", default="auto")
    ap.add_argument("--train-minutes", type=float, default=3.0)
    ap.add_argument("--train-steps", type=int, default=3000)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--out", default="quant_accuracy_out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.makedirs(args.out, exist_ok=True)
    result = {"config": args.config, "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d")}
    path_json = os.path.join(args.out, "quant_accuracy.json")
    save = lambda: json.dump(result, open(path_json, "w"), indent=1)
    src = args.checkpoint
    if src is None:
        tc = train.TrainConfig(config=args.config, steps=args.train_steps, batch=32, seq_len=512, lr=3e-3,
                               warmup_steps=100, eval_every=250, eval_batches=8, corpus=args.corpus,
                               out=os.path.join(args.out, "train"), progress=False,
                               max_seconds=args.train_minutes * 60)
        summary, _ = train.train(tc)
        src = summary["checkpoint"]
        result["training"] = {k: summary[k] for k in ("held_out_loss", "held_out_ppl", "steps_done") if k in summary}
        save()
    t0 = time.monotonic()
    qdir = os.path.join(args.out, "quantized")
    record = store.quantize_checkpoint(src, qdir, keep_bf16_experts=True)
    result["quantize_seconds"] = time.monotonic() - t0
    result["bytes"] = record["bytes"]
    p32, cfg = checkpoint.restore(src, "float32")
    cfg16 = cfg.replace(dtype="bfloat16")
    windows = windows_of(corpus.load(args.corpus).held_out, args.windows, args.window)
    loss32, arg32 = evaluate(p32, cfg.replace(dtype="float32"), windows, args.kernels)
    loss16, arg16 = evaluate(model.cast_params(p32, jnp.bfloat16), cfg16, windows, args.kernels)
    result["manifests"] = {"fp32": {"loss": loss32, "ppl": float(np.exp(loss32))},
                           "bf16": {"loss": loss16, "ppl": float(np.exp(loss16)),
                                    "agree_fp32": float(np.mean(arg16 == arg32))}}
    save()
    rng = np.random.default_rng(0)
    for name in record["manifests"]:
        params, qcfg = store.load(qdir, name)
        loss, arg = evaluate(model.cast_params(params, jnp.bfloat16), qcfg.replace(dtype="bfloat16"), windows,
                             args.kernels)
        result["manifests"][name] = {"loss": loss, "ppl": float(np.exp(loss)), "delta_loss_vs_bf16": loss - loss16,
                                     "agree_bf16": float(np.mean(arg == arg16)),
                                     "agree_fp32": float(np.mean(arg == arg32))}
        if not name.endswith("_bf16_moe"):
            exact = fused_bit_exact(qdir, name, cfg16, args.kernels, rng)
            result["manifests"][name]["fused_groups_bit_exact"] = all(exact.values())
            result["manifests"][name]["fused_groups_checked"] = len(exact)
        log.info("%s: %s", name, result["manifests"][name])
        save()
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
