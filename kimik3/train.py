"""Train a config of the model on real text (`kimik3 train`): next-token cross-entropy, AdamW.

    from kimik3 import train
    result = train.train(train.TrainConfig(config="tiny", steps=200, out="runs/tiny"))

The pieces, each replaceable: `kimik3.corpus` (byte-level tokens of Debian-shipped text, split
by block into train / held-out), a grain pipeline of windows (`batches`: seq_len + 1 tokens
from non-overlapping offsets, shuffled every epoch), optax AdamW with linear warm-up and cosine
decay (no weight decay on norms, biases and other vectors, global-norm clipping), one jitted
step with its params and optimizer state donated, held-out loss every `eval_every` steps, and
`kimik3.checkpoint` (orbax) for the result, which `kimik3 generate --checkpoint` and the
serving commands read.  Progress is a tqdm bar; the losses land in `train.json` and
`loss.png` under `out`.

The step runs the model's reference kernels (`kernels="reference"`: plain jnp, differentiable),
the held-out loss the device's serving kernels (`kernels="auto"`, forward only); the
routers' selection biases stay as initialized: they only choose experts (as DeepSeek-V3's bias),
so their gradient is zero, and vectors get no weight decay.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

from kimik3 import checkpoint, config as configs, corpus as corpora, model

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    config: str = "tiny"
    steps: int = 300
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # the cosine ends at lr * this
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8  # held-out batches per evaluation (the same ones every time)
    checkpoint_every: int = 0  # 0: the final checkpoint only
    seed: int = 0
    corpus: str = "auto"  # `kimik3.corpus.find_sources`
    max_corpus_bytes: int | None = None
    held_out_fraction: float = 0.05
    out: str = "train_out"
    progress: bool = True
    max_seconds: float | None = None  # stop the loop early once this much time has passed (the
    # schedule stays the one for `steps`; the result says where it stopped)

    def __post_init__(self):
        for name in ("steps", "batch", "seq_len", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1; got {getattr(self, name)}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"TrainConfig.max_seconds must be > 0 or None; got {self.max_seconds}")
        if self.lr <= 0 or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"TrainConfig: lr must be > 0 and warmup_steps in [0, steps); "
                f"got lr={self.lr}, warmup_steps={self.warmup_steps}, steps={self.steps}"
            )


def batches(tokens: np.ndarray, batch: int, seq_len: int, *, seed: int, repeat: bool = True):
    """A grain dataset of int32 [batch, seq_len + 1] windows of `tokens` (non-overlapping offsets,
    shuffled each epoch with `seed`; repeat=False: one pass in order, a last partial batch dropped)."""
    n = (tokens.size - 1) // seq_len
    if n < batch:
        raise ValueError(f"{tokens.size} tokens make {n} windows of {seq_len + 1}; a batch needs {batch}")
    ds = grain.MapDataset.range(n)
    if repeat:
        ds = ds.shuffle(seed=seed).repeat(None)
    return ds.map(lambda i: tokens[i * seq_len : i * seq_len + seq_len + 1]).batch(batch, drop_remainder=True)


def loss_fn(params, cfg, window_bt, kernels="reference"):
    """Mean next-token cross-entropy (nats per token) of windows [B, T + 1]: fp32 log-softmax.
    kernels: "reference" (differentiable, what the step trains through) or "auto" (the device's
    serving kernels: the held-out loss needs no gradient)."""
    logits, _ = model.forward(params, cfg, window_bt[:, :-1], kernels=kernels)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, window_bt[:, 1:, None], axis=-1))


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps, tc.lr * tc.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # matrices only
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask),
    )


def _plot(history: list[dict], evals: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8, label="train")
    ax.plot([e["step"] for e in evals], [e["held_out_loss"] for e in evals], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(tc: TrainConfig, params=None) -> tuple[dict, dict]:
    """Train `tc.config` (from `params`, else a fresh init with `tc.seed`); writes the checkpoint
    (`out/checkpoint`), `out/train.json` and `out/loss.png`.  Returns (train.json's contents:
    held-out loss and perplexity at each evaluation, the step losses, tokens and seconds; the
    trained params)."""
    cfg = configs.get_config(tc.config)
    os.makedirs(tc.out, exist_ok=True)
    text = corpora.load(tc.corpus, held_out_fraction=tc.held_out_fraction, max_bytes=tc.max_corpus_bytes)
    if params is None:
        params = model.init_params(cfg, jax.random.PRNGKey(tc.seed), "float32")
    opt = optimizer(tc)
    opt_state = opt.init(params)

    @jax.jit
    def evaluate(p, windows):
        # The serving kernels ("auto": Pallas on the GPU), not the reference: XLA:GPU did not finish
        # compiling the forward-only reference loss of `mini` in 170 s (RESULTS.md),
        # while the serving path's forward programs compile in seconds.
        return jnp.mean(jax.lax.map(lambda w: loss_fn(p, cfg, w, kernels="auto"), windows))

    def step(p, state, window):
        loss, grads = jax.value_and_grad(loss_fn)(p, cfg, window)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss, optax.tree.norm(grads)

    step = jax.jit(step, donate_argnums=(0, 1))
    held = np.stack(
        [b for _, b in zip(range(tc.eval_batches), batches(text.held_out, tc.batch, tc.seq_len, seed=0, repeat=False))]
    )
    history, evals = [], []

    def record_eval(at: int):
        loss = float(evaluate(params, jnp.asarray(held)))
        evals.append(dict(step=at, held_out_loss=loss, held_out_ppl=math.exp(loss)))
        log.info("step %d: held-out loss %.4f (perplexity %.2f per byte)", at, loss, math.exp(loss))

    from tqdm.auto import tqdm

    record_eval(0)
    t0 = time.perf_counter()
    it = iter(batches(text.train, tc.batch, tc.seq_len, seed=tc.seed).to_iter_dataset())
    bar = tqdm(range(1, tc.steps + 1), desc=f"train {cfg.name}", disable=not tc.progress, unit="step")
    done = 0
    for i in bar:
        params, opt_state, loss, gnorm = step(params, opt_state, jnp.asarray(next(it)))
        done = i
        out_of_time = tc.max_seconds is not None and time.perf_counter() - t0 > tc.max_seconds
        last = i == tc.steps or out_of_time
        if i % 10 == 0 or last:  # reading the loss waits for the step: not every step
            history.append(
                dict(step=i, loss=float(loss), grad_norm=float(gnorm), elapsed_s=round(time.perf_counter() - t0, 3))
            )
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
        if i % tc.eval_every == 0 or last:
            record_eval(i)
        if out_of_time:
            log.warning("train: max_seconds %.0f reached at step %d of %d; stopping", tc.max_seconds, i, tc.steps)
            break
        if tc.checkpoint_every and i % tc.checkpoint_every == 0 and i != tc.steps:
            checkpoint.save(os.path.join(tc.out, f"step_{i}"), params, cfg)
    seconds = time.perf_counter() - t0
    ckpt = os.path.join(tc.out, "checkpoint")
    checkpoint.save(ckpt, params, cfg)
    result = dict(
        config=cfg.name,
        corpus=text.describe(),
        train_config=dataclasses.asdict(tc),
        steps_done=done,
        stopped_early=done < tc.steps,
        tokens=done * tc.batch * tc.seq_len,
        seconds=seconds,
        checkpoint=ckpt,
        held_out_loss=evals[-1]["held_out_loss"],
        held_out_ppl=evals[-1]["held_out_ppl"],
        initial_held_out_loss=evals[0]["held_out_loss"],
        evals=evals,
        history=history,
        device=jax.devices()[0].device_kind,
    )
    with open(os.path.join(tc.out, "train.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(history, evals, os.path.join(tc.out, "loss.png"))
    log.info(
        "trained %s for %d steps in %.1f s: held-out loss %.4f -> %.4f",
        cfg.name,
        done,
        seconds,
        evals[0]["held_out_loss"],
        evals[-1]["held_out_loss"],
    )
    return result, params
