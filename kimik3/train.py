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

Before the first step the run checks that it fits (`DoesNotFit` otherwise, naming the flags
that change it): the train split holds a batch of windows, and the memory the run holds at its
peak (`TrainMemory`: the params, their gradients and the optimizer state, then XLA's own buffer
figures of the compiled step and evaluation) is within `memory_budget` (default 90% of what the
device has free: `kimik3.sizing.available_memory`).  The programs are compiled once, ahead of
time, for that check and then run.  `max_seconds` bounds the whole run, set-up included: the
loop stops before a step that, with the final evaluation and checkpoint, would end past it (a
step's, an evaluation's and a checkpoint's time: the last one measured).

The step runs the model's reference kernels (`kernels="reference"`: plain jnp, differentiable),
the held-out loss the device's serving kernels (`kernels="auto"`, forward only); the
routers' selection biases stay as initialized: they only choose experts (as DeepSeek-V3's bias),
so their gradient is zero, and vectors get no weight decay.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import time
from collections.abc import Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from kimik3 import checkpoint, config as configs, corpus as corpora, model, sizing

log = logging.getLogger(__name__)

USABLE_FRACTION = 0.9  # of the device's free memory, without a memory_budget: the runtime's own share
GiB = 2**30


class DoesNotFit(ValueError):
    """A run refused before its first step: its corpus or its memory does not hold what it was
    asked for.  The message names the `kimik3 train` flags (the TrainConfig fields of the same
    names) that change it."""


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
    max_seconds: float | None = None  # the whole run's wall time, set-up included: the loop stops
    # before a step that, with the final evaluation and checkpoint, would end it later (no step at all
    # where the set-up used the time up; the schedule stays the one for `steps`; the result says where
    # it stopped)
    grad_accum: int = 1  # each step's batch as this many sequential micro-batches: the same update,
    # about 1 / grad_accum of the activations (the held-out evaluation runs micro-batches too)
    memory_budget: int | None = None  # bytes the run may hold; None: USABLE_FRACTION of what the
    # device has free (`kimik3.sizing.available_memory`)

    def __post_init__(self):
        for name in ("steps", "batch", "seq_len", "eval_every", "eval_batches", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1; got {getattr(self, name)}")
        if self.batch % self.grad_accum:
            raise ValueError(f"TrainConfig: grad_accum ({self.grad_accum}) must divide batch ({self.batch})")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"TrainConfig.max_seconds must be > 0 or None; got {self.max_seconds}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"TrainConfig.memory_budget must be > 0 or None; got {self.memory_budget}")
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
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's inline one) stays

    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8, label="train")
    ax.plot([e["step"] for e in evals], [e["held_out_loss"] for e in evals], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _corpus_flags(tc: TrainConfig) -> str:
    more = ", or a larger --max-corpus-mb" if tc.max_corpus_bytes is not None else ""
    return f"more text (--corpus python-doc after apt-get install python3.11-doc, or --corpus DIR{more})"


def check_train_windows(tokens: np.ndarray, tc: TrainConfig, corpus_name: str = "the corpus") -> None:
    """DoesNotFit, naming the flags, where the train split makes fewer windows than a batch."""
    n = max(tokens.size - 1, 0) // tc.seq_len
    if n < tc.batch:
        raise DoesNotFit(
            f"{corpus_name}'s train split ({tokens.size:,} tokens) makes {n} windows of {tc.seq_len + 1}; "
            f"a batch needs {tc.batch}: lower --batch or --seq-len, or train on {_corpus_flags(tc)}"
        )


def held_out_windows(tokens: np.ndarray, tc: TrainConfig, corpus_name: str = "the corpus") -> np.ndarray:
    """The fixed held-out evaluation set, int32 [n, micro, seq_len + 1] (micro = batch / grad_accum):
    the split's first eval_batches * batch windows, in order.  A split holding fewer uses what it
    has (the held-out loss is a mean over windows: the evaluation's batch shape does not change it),
    with a warning; one holding no window raises DoesNotFit naming the flags."""
    micro = tc.batch // tc.grad_accum
    have = max(tokens.size - 1, 0) // tc.seq_len
    take = min(have, tc.eval_batches * tc.batch)
    if take == 0:
        raise DoesNotFit(
            f"{corpus_name}'s held-out split ({tokens.size:,} tokens) is shorter than one window of "
            f"{tc.seq_len + 1}: lower --seq-len, or train on {_corpus_flags(tc)}"
        )
    if take < tc.eval_batches * tc.batch:
        log.warning(
            "%s's held-out split holds %d windows of %d tokens, fewer than --eval-batches x --batch = %d: "
            "the held-out loss is their mean",
            corpus_name,
            have,
            tc.seq_len + 1,
            tc.eval_batches * tc.batch,
        )
    rows, width = (take // micro, micro) if take >= micro else (1, take)
    idx = np.arange(rows * width)[:, None] * tc.seq_len + np.arange(tc.seq_len + 1)
    return tokens[idx].astype(np.int32).reshape(rows, width, tc.seq_len + 1)


@dataclasses.dataclass(frozen=True)
class TrainMemory:
    """Bytes a run holds at its peak, known before its first step: the params, the optimizer
    state, the resident held-out windows, and XLA's figures of the two compiled programs (None
    before compiling, or where the backend gives none): the step (params and optimizer state
    donated; its temporaries hold the gradients and the activations the backward pass reads) and
    the held-out evaluation (while the optimizer state stays resident)."""

    params: int
    optimizer_state: int
    held_out: int
    step: sizing.ProgramMemory | None = None
    evaluation: sizing.ProgramMemory | None = None

    @property
    def floor(self) -> int:
        """What any step holds whatever its batch: params, their gradients, optimizer state, held-out windows."""
        return 2 * self.params + self.optimizer_state + self.held_out

    @property
    def total(self) -> int:
        """The peak: the larger of the step (the held-out windows resident) and the evaluation
        (the optimizer state resident); the floor while XLA's figures are missing."""
        if self.step is None:
            return self.floor
        total = self.step.peak + self.held_out
        if self.evaluation is not None:
            total = max(total, self.evaluation.peak + self.optimizer_state)
        return total

    def _sides(self) -> list[tuple[int, int]]:
        """(bytes that stay, bytes that scale with a micro-batch's tokens) of each program."""
        sides = []
        if self.step is not None:  # the gradients (one params' worth) do not shrink with the batch
            scale = max(self.step.temporaries - self.params, 0)
            sides.append((self.step.peak + self.held_out - scale, scale))
        if self.evaluation is not None:
            sides.append(
                (self.evaluation.peak + self.optimizer_state - self.evaluation.temporaries, self.evaluation.temporaries)
            )
        return sides

    def shrink_factor(self, budget: int) -> float | None:
        """About how many times fewer tokens a micro-batch must hold for the run to fit `budget`
        (1.0: it fits), taking activations as proportional to them; None where no micro-batch fits
        (or XLA's figures are missing): the params, gradients and optimizer state alone are too many."""
        sides = self._sides()
        if not sides:
            return 1.0 if self.floor <= budget else None
        k = 1.0
        for stay, scale in sides:
            if stay + scale <= budget:
                continue
            if stay >= budget:
                return None
            k = max(k, scale / (budget - stay))
        return k


def memory_budget(tc: TrainConfig, device=None) -> tuple[int | None, str]:
    """(bytes the run may hold, where the figure comes from): `tc.memory_budget`, else
    USABLE_FRACTION of `kimik3.sizing.available_memory`; (None, why) where neither is known."""
    if tc.memory_budget is not None:
        return int(tc.memory_budget), "the memory budget (--memory-gib)"
    free, source = sizing.available_memory(device)
    if free is None:
        return None, source
    return int(USABLE_FRACTION * free), f"{USABLE_FRACTION:.0%} of the {free / GiB:.1f} GiB {source}"


def check_memory(
    mem: TrainMemory, tc: TrainConfig, budget: int | None, source: str, cfg_name: str | None = None
) -> None:
    """DoesNotFit where `mem.total` exceeds `budget`: the message gives the estimate and its parts,
    the budget and where it comes from, and the flags that reduce the estimate (--batch,
    --seq-len, --grad-accum, --config), with values that fit where activations are what overflow."""
    if budget is None:
        log.warning("train: %s; the memory check is skipped (--memory-gib sets a budget)", source)
        return
    if mem.total <= budget:
        return
    name = cfg_name or tc.config
    shape = f"--batch {tc.batch} --seq-len {tc.seq_len}" + (
        f" --grad-accum {tc.grad_accum}" if tc.grad_accum > 1 else ""
    )
    parts = f"params {mem.params / GiB:.2f}, optimizer state {mem.optimizer_state / GiB:.2f}"
    if mem.step is not None:
        parts += f", step temporaries (gradients, activations) {mem.step.temporaries / GiB:.2f} GiB"
    else:
        parts += f", gradients {mem.params / GiB:.2f} GiB, before any activation"
    smaller = "a smaller --config (tiny)" if name != "tiny" else None
    k = mem.shrink_factor(budget)
    if k is None:
        advice = (
            "the params, their gradients and the optimizer state leave no room for activations at any "
            "--batch or --seq-len" + (f": train {smaller}" if smaller else "")
        )
    else:
        k = math.ceil(k * 1.05)  # the scaling is not exact: a margin
        micro = tc.batch // tc.grad_accum
        ideas = []
        if micro >= k:  # --batch keeps --grad-accum dividing it
            accum = next(g for g in range(tc.grad_accum * k, tc.batch + 1) if tc.batch % g == 0)
            ideas.append(f"--batch {tc.grad_accum * (micro // k)}")
            ideas.append(f"--grad-accum {accum} (the same batch in {accum} passes a step)")
        if tc.seq_len >= k:
            ideas.append(f"--seq-len {tc.seq_len // k}")
        advice = (
            f"activations grow with the tokens of a micro-batch (--batch / --grad-accum windows of --seq-len "
            f"tokens): about {k}x fewer fit, e.g. {', '.join(ideas) or 'fewer tokens'}"
            + (f"; or {smaller}" if smaller else "")
        )
    raise DoesNotFit(
        f"training {name} at {shape} needs about {mem.total / GiB:.2f} GiB ({parts}), more than "
        f"{budget / GiB:.2f} GiB ({source}). {advice[0].upper()}{advice[1:]}. "
        f"--memory-gib sets the budget instead."
    )


@dataclasses.dataclass(frozen=True)
class Programs:
    """The run's compiled programs and what they hold (`compile_programs`)."""

    step: Callable  # (params, opt_state, windows [batch, seq_len + 1]) -> (params, opt_state, loss, grad norm)
    evaluate: Callable  # (params, held-out windows [n, micro, seq_len + 1]) -> mean loss
    memory: TrainMemory


def compile_programs(tc: TrainConfig, cfg, abstract_params, held_shape: tuple[int, int, int]) -> Programs:
    """Lower and compile the step and the evaluation for `abstract_params` (a tree of
    `jax.ShapeDtypeStruct`s or arrays) without allocating them, and read their memory off XLA."""
    opt = optimizer(tc)
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params)
    abstract_state = jax.eval_shape(opt.init, abstract_params)
    micro = tc.batch // tc.grad_accum

    def grads_of(p, window):
        if tc.grad_accum == 1:
            return jax.value_and_grad(loss_fn)(p, cfg, window)

        def one(acc, w):  # micro-batches of equal size: the mean of their means is the batch's mean
            loss, grads = jax.value_and_grad(loss_fn)(p, cfg, w)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, p))
        (loss, grads), _ = jax.lax.scan(one, zero, window.reshape(tc.grad_accum, micro, -1))
        return loss / tc.grad_accum, jax.tree.map(lambda g: g / tc.grad_accum, grads)

    def step(p, state, window):
        loss, grads = grads_of(p, window)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss, optax.tree.norm(grads)

    def evaluate(p, windows):
        # The serving kernels ("auto": Pallas on the GPU), not the reference: XLA:GPU did not finish
        # compiling the forward-only reference loss of `mini` in 170 s (RESULTS.md),
        # while the serving path's forward programs compile in seconds.
        return jnp.mean(jax.lax.map(lambda w: loss_fn(p, cfg, w, kernels="auto"), windows))

    window = jax.ShapeDtypeStruct((tc.batch, tc.seq_len + 1), jnp.int32)
    step_c = jax.jit(step, donate_argnums=(0, 1)).lower(abstract_params, abstract_state, window).compile()
    eval_c = jax.jit(evaluate).lower(abstract_params, jax.ShapeDtypeStruct(held_shape, jnp.int32)).compile()
    memory = TrainMemory(
        params=sizing.tree_bytes(abstract_params),
        optimizer_state=sizing.tree_bytes(abstract_state),
        held_out=math.prod(held_shape) * 4,
        step=sizing.program_memory(step_c),
        evaluation=sizing.program_memory(eval_c),
    )
    return Programs(step_c, eval_c, memory)


def _refuse_earlier_run(tc: TrainConfig) -> str:
    """The path of the run's final checkpoint (`out/checkpoint`); ValueError where `out` already
    holds it or an intermediate `out/step_*` one (an earlier run's)."""
    ckpt = os.path.join(tc.out, "checkpoint")
    earlier = [p for p in (ckpt, *glob.glob(os.path.join(tc.out, "step_*"))) if os.path.exists(p)]
    if earlier:  # orbax writes no checkpoint over another: refuse now, not after the last step
        raise ValueError(f"{earlier[0]} exists (an earlier run's): pass another --out or remove it")
    return ckpt


def _fitting_programs(tc: TrainConfig, cfg, params, held: np.ndarray) -> tuple[Programs, int | None]:
    """Compile the step and the evaluation for `params` (None: `cfg`'s float32 init) and the
    held-out windows `held`, checking the run fits the memory budget: its floor before compiling,
    then XLA's figures (DoesNotFit otherwise).  Returns (the programs, the budget in bytes, None
    where it is unknown)."""
    abstract = model.abstract_params(cfg, "float32") if params is None else params
    budget, source = memory_budget(tc)
    floor = TrainMemory(
        params=sizing.tree_bytes(abstract),
        optimizer_state=sizing.tree_bytes(jax.eval_shape(optimizer(tc).init, abstract)),
        held_out=held.nbytes,
    )
    check_memory(floor, tc, budget, source, cfg.name)  # before compiling: a config far too large
    programs = compile_programs(tc, cfg, abstract, held.shape)
    mem = programs.memory
    check_memory(mem, tc, budget, source, cfg.name)
    if mem.step is None:
        log.warning(
            "train: no XLA memory figures on %s: only the params and optimizer state were checked",
            jax.default_backend(),
        )
    log.info(
        "train: the run holds about %.2f GiB at its peak (budget %s)",
        mem.total / GiB,
        "none" if budget is None else f"{budget / GiB:.2f} GiB",
    )
    return programs, budget


@dataclasses.dataclass(eq=False)
class _Loop:
    """The training loop's state: the params and optimizer state, the recorded step losses
    (`history`) and evaluations (`evals`), the steps done, and the run's clock.

    The clock is read once between phases: each phase's time is the difference (`lap`), and what
    the time limit reserves for the next step, evaluation and checkpoint is what the last one took."""

    tc: TrainConfig
    cfg: configs.ModelConfig
    programs: Programs
    params: dict
    opt_state: optax.OptState
    held: jax.Array
    clock: Callable[[], float]
    start: float
    now: float = dataclasses.field(init=False)
    history: list[dict] = dataclasses.field(default_factory=list)
    evals: list[dict] = dataclasses.field(default_factory=list)
    done: int = 0
    loss: jax.Array | None = None
    gnorm: jax.Array | None = None
    step_s: float = 0.0
    eval_s: float = 0.0
    save_s: float = 0.0

    def __post_init__(self):
        self.now = self.start

    @property
    def deadline(self) -> float | None:
        return None if self.tc.max_seconds is None else self.start + self.tc.max_seconds

    def lap(self) -> float:
        """Seconds since the previous read of the clock (the run's start for the first)."""
        t = self.clock()
        t, self.now = t - self.now, t
        return t

    def record_eval(self, at: int) -> None:
        loss = float(self.programs.evaluate(self.params, self.held))
        self.evals.append(dict(step=at, held_out_loss=loss, held_out_ppl=math.exp(loss)))
        log.info("step %d: held-out loss %.4f (perplexity %.2f per byte)", at, loss, math.exp(loss))

    def _out_of_time(self, i: int, eval_due: bool, save_due: bool) -> bool:
        """Whether step `i`, what falls due after it, and the final evaluation and checkpoint would
        end past the deadline (logged as a warning where they would)."""
        if self.deadline is None:
            return False
        need = (
            self.step_s
            + (eval_due and i != self.tc.steps) * self.eval_s
            + save_due * self.save_s
            + self.eval_s
            + self.save_s
        )
        if self.now + need <= self.deadline:
            return False
        log.warning(
            "train: stopping after step %d of %d: %.1f s more (the next step, then the final evaluation "
            "and checkpoint, timed by the last of each) would end past max_seconds %.0f",
            self.done,
            self.tc.steps,
            need,
            self.tc.max_seconds,
        )
        return True

    def _step(self, i: int, window: np.ndarray, bar) -> None:
        """Run step `i` on `window`, recording its loss every 10th step and the last, and time it."""
        self.params, self.opt_state, self.loss, self.gnorm = self.programs.step(
            self.params, self.opt_state, jnp.asarray(window)
        )
        self.done = i
        if self.deadline is not None:  # a dispatched step is not a finished one: wait for it, to time it
            jax.block_until_ready(self.loss)
        logged = i % 10 == 0 or i == self.tc.steps  # reading the loss waits for the step: not every step
        if logged:
            self.history.append(dict(step=i, loss=float(self.loss), grad_norm=float(self.gnorm)))
        self.step_s = self.lap()
        if logged:
            self.history[-1]["elapsed_s"] = round(self.now - self.start, 3)
            bar.set_postfix(loss=f"{self.history[-1]['loss']:.3f}")

    def run(self, train_tokens: np.ndarray) -> None:
        """The held-out loss at step 0, then the steps on batches of `train_tokens` with their
        evaluations and intermediate checkpoints, until `tc.steps` or the deadline."""
        tc = self.tc
        self.record_eval(0)
        self.eval_s = self.lap()
        # until timed: a save at ~100 MB/s, a step as a forward and a backward pass (~3 forwards) of each
        # micro-batch, at the first evaluation's rate
        self.save_s = 1.0 + self.programs.memory.params / 1e8
        rows, width = self.held.shape[:2]
        self.step_s = 3 * tc.grad_accum * self.eval_s / rows * (tc.batch // tc.grad_accum) / width
        it = iter(batches(train_tokens, tc.batch, tc.seq_len, seed=tc.seed).to_iter_dataset())
        bar = tqdm(range(1, tc.steps + 1), desc=f"train {self.cfg.name}", disable=not tc.progress, unit="step")
        for i in bar:
            eval_due = i % tc.eval_every == 0 or i == tc.steps
            save_due = bool(tc.checkpoint_every) and i % tc.checkpoint_every == 0 and i != tc.steps
            if self._out_of_time(i, eval_due, save_due):
                break
            self._step(i, next(it), bar)
            if eval_due:
                self.record_eval(i)
                self.eval_s = self.lap()
            if save_due:
                checkpoint.save(os.path.join(tc.out, f"step_{i}"), self.params, self.cfg)
                self.save_s = self.lap()
        bar.close()

    def finish(self, ckpt: str) -> None:
        """Record the last step's loss and held-out loss where not yet recorded, and save the
        final checkpoint to `ckpt`."""
        done = self.done
        if done and (not self.history or self.history[-1]["step"] != done):
            self.history.append(
                dict(
                    step=done,
                    loss=float(self.loss),
                    grad_norm=float(self.gnorm),
                    elapsed_s=round(self.now - self.start, 3),
                )
            )
        if self.evals[-1]["step"] != done:
            self.record_eval(done)
            self.lap()
        checkpoint.save(ckpt, self.params, self.cfg)
        self.lap()


def _report(loop: _Loop, text, setup_s: float, budget: int | None, ckpt: str) -> dict:
    """train.json's contents, written with loss.png under `out`, and the run's summary logged."""
    tc, cfg, evals, history, done = loop.tc, loop.cfg, loop.evals, loop.history, loop.done
    seconds = loop.now - loop.start
    result = dict(
        config=cfg.name,
        corpus=text.describe(),
        train_config=dataclasses.asdict(tc),
        steps_done=done,
        stopped_early=done < tc.steps,
        tokens=done * tc.batch * tc.seq_len,
        seconds=seconds,
        setup_seconds=setup_s,
        memory_estimate_bytes=loop.programs.memory.total,
        memory_budget_bytes=budget,
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
        "trained %s for %d steps in %.1f s (%.1f s of it set-up): held-out loss %.4f -> %.4f",
        cfg.name,
        done,
        seconds,
        setup_s,
        evals[0]["held_out_loss"],
        evals[-1]["held_out_loss"],
    )
    return result


def train(tc: TrainConfig, params=None, *, clock: Callable[[], float] = time.perf_counter) -> tuple[dict, dict]:
    """Train `tc.config` (from `params`, else a fresh init with `tc.seed`); writes the checkpoint
    (`out/checkpoint`), `out/train.json` and `out/loss.png`.  Returns (train.json's contents:
    held-out loss and perplexity at each evaluation, the step losses, tokens and seconds; the
    trained params).

    Raises DoesNotFit before any step (and before writing anything) where the corpus or the
    memory does not hold the run, and ValueError where `out` holds an earlier run's checkpoints.  clock: monotonic seconds; `max_seconds` and the reported
    times read it (`time.perf_counter`; tests pass their own)."""
    start = clock()
    cfg = configs.get_config(tc.config)
    ckpt = _refuse_earlier_run(tc)
    text = corpora.load(tc.corpus, held_out_fraction=tc.held_out_fraction, max_bytes=tc.max_corpus_bytes)
    check_train_windows(text.train, tc, text.name)
    held = held_out_windows(text.held_out, tc, text.name)
    programs, budget = _fitting_programs(tc, cfg, params, held)

    os.makedirs(tc.out, exist_ok=True)
    if params is None:
        params = model.init_params(cfg, jax.random.PRNGKey(tc.seed), "float32")
    opt_state = optimizer(tc).init(params)
    loop = _Loop(tc, cfg, programs, params, opt_state, jnp.asarray(held), clock, start)
    setup_s = loop.lap()  # corpus, compiles, init
    loop.run(text.train)
    loop.finish(ckpt)
    return _report(loop, text, setup_s, budget, ckpt), loop.params
