"""Accuracy of the served quantized manifests: held-out loss and greedy agreement against bf16 and
fp32, teacher-forced windows, no cache, the backend's kernels, params in bf16 as served.

Registered in `benchmarks.registry` (quant_accuracy).  Options: `checkpoint=DIR` (trained params;
else the preset's config is trained for its `minutes` on `corpus`, or drawn at random where
`minutes` is 0), `corpus=NAME` (`kimik3.corpus`; default "auto"), `out=DIR` (the training's
output).  Rows carry no time: loss, perplexity and agreement are in `extra`.
"""

from __future__ import annotations

import logging
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import checkpoint, config, model, ops
from kimik3 import quant_store as store
from kimik3.quant import formats

log = logging.getLogger("benchmarks.quant_accuracy")
# fused projection groups of the serving layout and their members, in column order
GROUPS = {
    "kda": ("w_q_dhk", "w_k_dhk", "w_v_dhv", "w_fa_dr", "w_beta_dh", "w_ga_dr"),
    "mla": ("w_qa_dq", "w_kva_dr", "w_gate_dhv"),
}
BF16_LOGIT_TOL = 0.15  # mean |logit error| of bf16 against fp32 a trained model must stay under


def windows_of(held_out: np.ndarray, n: int, size: int) -> np.ndarray:
    """n windows of size + 1 tokens at evenly spread offsets of held_out."""
    starts = np.linspace(0, held_out.size - size - 2, n).astype(int)
    return np.stack([held_out[s : s + size + 1] for s in starts]).astype(np.int32)


def evaluate(params, cfg, windows: np.ndarray, batch: int = 4):
    """(mean next-token loss, argmax [W, T], logits fp32 [W, T, V]) of teacher-forced windows [W, T + 1]."""
    losses, argmax, logits_all = [], [], []
    for i in range(0, len(windows), batch):
        w = jnp.asarray(windows[i : i + batch])
        logits = model.forward(params, cfg, w[:, :-1], kernels="auto", programs="whole")[0].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        losses.append(np.asarray(-jnp.take_along_axis(logp, w[:, 1:, None], axis=-1)[..., 0]))
        argmax.append(np.asarray(jnp.argmax(logits, axis=-1)))
        logits_all.append(np.asarray(logits))
    return float(np.concatenate(losses).mean()), np.concatenate(argmax), np.concatenate(logits_all)


def fused_groups_exact(fused, apart, cfg, rng) -> dict:
    """{layer/group: whether the fused GEMM's columns equal each member's GEMM}: `fused` and `apart`
    are one manifest's params quantized with and without fusing the projection groups."""
    x = jnp.asarray(rng.standard_normal((16, cfg.d_model)), jnp.bfloat16)
    out = {}
    for i in range(cfg.n_layers):
        for kind, members in GROUPS.items():
            layer = apart[f"layer_{i}"].get(kind)
            if layer is None or not isinstance(fused[f"layer_{i}"][kind].get("w_in_dx"), formats.QTensor):
                continue
            y = np.asarray(ops.linear(x, fused[f"layer_{i}"][kind]["w_in_dx"]), np.float32)
            start, same = 0, True
            for name in members:
                q = layer[name]
                same &= bool(np.array_equal(y[:, start : start + q.shape[1]], np.asarray(ops.linear(x, q), np.float32)))
                start += q.shape[1]
            out[f"layer_{i}/{kind}"] = same
    return out


def _params(ctx, name: str, minutes: float):
    """(fp32 params, cfg, trained?) from the checkpoint option, a short training run, or a random draw."""
    if ctx.options.get("checkpoint"):
        p32, cfg = checkpoint.restore(ctx.options["checkpoint"], "float32")
        return p32, cfg, True
    cfg = config.get_config(name)
    if minutes > 0:
        from kimik3 import train  # the corpus pipeline's packages: only where it trains

        out = ctx.options.get("out") or tempfile.mkdtemp(prefix="kimik3-quant-accuracy-")
        tc = train.TrainConfig(
            config=name,
            steps=3000,
            batch=32,
            seq_len=512,
            lr=3e-3,
            warmup_steps=100,
            eval_every=250,
            eval_batches=8,
            corpus=ctx.options.get("corpus", "auto"),
            out=os.path.join(out, "train"),
            progress=False,
            max_seconds=minutes * 60,
        )
        summary, p32 = train.train(tc)
        log.info("trained %s: held-out loss %s", name, summary.get("held_out_loss"))
        return model.cast_params(p32, jnp.float32), cfg, True
    return model.init_params(cfg, jax.random.PRNGKey(0), "float32"), cfg, False


def quant_accuracy(ctx):
    """quant_accuracy: one row for bf16 (checked: mean |logit error| against fp32) and one per
    served manifest (checked: its fused groups bit-exact against their members)."""
    rng = np.random.default_rng(0)
    for case in ctx.cases():
        name, n_windows, size, minutes, which = case
        p32, cfg, trained = _params(ctx, name, minutes)
        if trained:
            from kimik3 import corpus

            windows = windows_of(corpus.load(ctx.options.get("corpus", "auto")).held_out, n_windows, size)
        else:  # random weights: any tokens are as good as the corpus's
            windows = rng.integers(0, cfg.vocab_size, (n_windows, size + 1)).astype(np.int32)
        cfg16 = cfg.replace(dtype="bfloat16")
        loss32, arg32, logits32 = evaluate(p32, cfg.replace(dtype="float32"), windows)
        loss16, arg16, logits16 = evaluate(model.cast_params(p32, jnp.bfloat16), cfg16, windows)
        err16 = float(np.abs(logits16 - logits32).mean())
        base = {"config": cfg.name, "trained": trained, "windows": int(n_windows), "window": int(size)}
        chk = {"max_err": err16, "tol": BF16_LOGIT_TOL, "ok": err16 <= BF16_LOGIT_TOL}
        yield ctx.row(
            f"{ctx.label(case)} bf16",
            chk,
            None,
            extra=dict(
                base,
                loss=loss16,
                ppl=float(np.exp(loss16)),
                fp32_loss=loss32,
                agree_fp32=float(np.mean(arg16 == arg32)),
                mean_abs_logit_err=err16,
            ),
        )
        manifests = store.served_manifests(keep_bf16_experts=True) if which == "all" else tuple(which.split("+"))
        for manifest in manifests:

            def one(manifest=manifest):
                fused = store.quantize_params(p32, cfg16, manifest)
                loss, arg, _ = evaluate(model.cast_params(fused, jnp.bfloat16), cfg16, windows)
                exact = fused_groups_exact(fused, store.quantize_params(p32, cfg16, manifest, fuse=False), cfg16, rng)
                bad = sum(not v for v in exact.values())
                chk = {"max_err": float(bad), "tol": 0.0, "ok": bad == 0}
                return ctx.row(
                    f"{ctx.label(case)} {manifest}",
                    chk,
                    None,
                    extra=dict(
                        base,
                        loss=loss,
                        ppl=float(np.exp(loss)),
                        delta_loss_vs_bf16=loss - loss16,
                        agree_bf16=float(np.mean(arg == arg16)),
                        agree_fp32=float(np.mean(arg == arg32)),
                        fused_groups_checked=len(exact),
                    ),
                )

            yield ctx.attempt(f"{ctx.label(case)} {manifest}", "default", one)
