"""Train an EAGLE-3 draft head on its frozen target (`kimik3 train-eagle`), and its checkpoints.

    from kimik3 import eagle_train
    result, draft = eagle_train.train_draft(target_params, cfg, eagle_train.DraftTrainConfig(steps=300))

Data: the target's own greedy continuations of prompts cut from the corpus (`data="generated"`,
what the draft will be asked to predict when serving), or the corpus text itself
(`data="text"`); either way the labels are the target's next-token distributions (soft
cross-entropy, `eagle.ttt_loss`), never the text's tokens.  The frozen target (forward
only, so the device's serving kernels: Pallas on the GPU) runs once per sequence of the pool, its logits and taps kept on the device; the draft
trains with training-time test (`eagle.ttt_logits`).
Held-out: the same data built from the corpus's held-out blocks; its per-step top-1 agreement
with the target is what greedy acceptance at that draft position will be.

A draft checkpoint (`save_draft` / `load_draft`)::

    <path>/eagle.json   the EagleConfig, the target's config name and its fingerprint
    <path>/params/      orbax tree of the draft's weights

`load_draft` refuses a draft made for another target (config or weights).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from kimik3 import corpus as corpora, eagle, model, ops
from kimik3.config import ModelConfig
from kimik3.train import optimizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
    steps: int = 300
    batch: int = 8
    seq_len: int = 128
    prompt_len: int = 32  # data="generated": corpus tokens before the target's continuation
    pool: int = 64  # data="generated": sequences generated once, then shuffled every epoch
    data: str = "generated"  # "generated" | "text"
    ttt_steps: int = 3
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    eval_batches: int = 2
    seed: int = 0
    corpus: str = "auto"
    max_corpus_bytes: int | None = None
    out: str | None = None  # a directory: the draft checkpoint (out/draft) and out/eagle_train.json
    progress: bool = True

    def __post_init__(self):
        if self.data not in ("generated", "text"):
            raise ValueError(f"DraftTrainConfig.data must be 'generated' or 'text'; got {self.data!r}")
        if not 0 < self.prompt_len < self.seq_len:
            raise ValueError(
                f"DraftTrainConfig: prompt_len must be in (0, seq_len={self.seq_len}); got {self.prompt_len}"
            )
        if self.steps < 1 or self.batch < 1 or self.pool < self.batch or not 0 <= self.warmup_steps < self.steps:
            raise ValueError("DraftTrainConfig: steps, batch >= 1, pool >= batch and warmup_steps in [0, steps)")


def fingerprint(params) -> str:
    """A short hash of the target's embedding and LM head (rounded to bf16, so one target in
    fp32 or bf16 has one fingerprint)."""
    h = hashlib.sha256()
    for name in ("embed_vd", "lm_head_dv"):
        x = np.asarray(jnp.asarray(params[name]).astype(jnp.bfloat16).astype(jnp.float32))
        h.update(x.tobytes())
    return h.hexdigest()[:16]


def save_draft(path, draft, ecfg: eagle.EagleConfig, cfg: ModelConfig, target_params) -> None:
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), draft, force=True)  # a new run replaces the old draft
    meta = {
        "eagle": dataclasses.asdict(ecfg),
        "target": cfg.name,
        "target_config": json.loads(cfg.to_json()),
        "target_fingerprint": fingerprint(target_params),
    }
    with open(os.path.join(path, "eagle.json"), "w") as f:
        json.dump(meta, f, indent=1)
    log.info("saved the EAGLE-3 draft for %s to %s", cfg.name, path)


def load_draft(path, cfg: ModelConfig, target_params):
    """(draft params, EagleConfig) from `path`; ValueError when it was trained for another target."""
    path = os.path.abspath(os.fspath(path))
    meta_path = os.path.join(path, "eagle.json")
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path} is not an EAGLE-3 draft checkpoint (no eagle.json)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta["target_config"] != json.loads(cfg.to_json()):
        raise ValueError(
            f"the draft at {path} was trained for target {meta['target']!r} with another config, "
            f"not for this {cfg.name}"
        )
    if meta["target_fingerprint"] != fingerprint(target_params):
        raise ValueError(
            f"the draft at {path} was trained on other {cfg.name} weights (fingerprint "
            f"{meta['target_fingerprint']}, these are {fingerprint(target_params)})"
        )
    e = meta["eagle"]
    ecfg = eagle.EagleConfig(
        taps=tuple(e["taps"]), ffn_dim=e["ffn_dim"], ttt_steps=e["ttt_steps"], loss_decay=e["loss_decay"]
    )
    with ocp.StandardCheckpointer() as ckptr:
        draft = ckptr.restore(os.path.join(path, "params"))
    return draft, ecfg


@functools.partial(jax.jit, static_argnames=("cfg", "n"))
def _greedy_continue(params, prompts_bp, *, cfg, n):
    """Batched greedy continuation (a contiguous cache, the device's serving kernels): [B, P] -> [B, P + n]."""
    b, p = prompts_bp.shape
    cache = model.init_cache(cfg, b, p + n, jnp.float32)
    logits, cache = model.forward_step_jit(
        params,
        prompts_bp,
        jnp.broadcast_to(jnp.arange(p)[None], (b, p)),
        cache,
        None,
        cfg=cfg,
        expert_path="grouped",
        kernels=ops.resolve("auto"),
    )
    tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)

    def step(carry, _):
        tok, cache = carry
        lg, cache = model.forward_step_jit(
            params,
            tok[:, None],
            cache["lengths"][:, None],
            cache,
            None,
            cfg=cfg,
            expert_path="grouped",
            kernels=ops.resolve("auto"),
        )
        return (jnp.argmax(lg[:, -1], -1).astype(jnp.int32), cache), tok

    _, toks = jax.lax.scan(step, (tok, cache), None, length=n)
    return jnp.concatenate([prompts_bp, toks.T], axis=1)


def build_data(params32, cfg: ModelConfig, tokens: np.ndarray, dc: DraftTrainConfig, n_seqs: int, seed: int):
    """int32 [n_seqs, seq_len] training sequences from corpus tokens (see the module docstring)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, tokens.size - dc.seq_len, size=n_seqs)
    windows = np.stack([tokens[s : s + dc.seq_len] for s in starts]).astype(np.int32)
    if dc.data == "text":
        return windows
    out = []
    for i in range(0, n_seqs, dc.batch):
        prompts = jnp.asarray(windows[i : i + dc.batch, : dc.prompt_len])
        out.append(np.asarray(_greedy_continue(params32, prompts, cfg=cfg, n=dc.seq_len - dc.prompt_len)))
    return np.concatenate(out)[:n_seqs]


# The most bytes of target features (fp32 logits and taps of the whole pool) kept on the device.
FEATURE_CACHE_BYTES = 2 << 30


def _feature_bytes(cfg: ModelConfig, ecfg: eagle.EagleConfig, seqs: np.ndarray) -> int:
    return seqs.size * (cfg.vocab_size + len(ecfg.taps) * cfg.d_model) * 4


def _features(target, seqs: np.ndarray, batch: int):
    """The target's (logits [N, S, V], taps [N, S, taps, D]) for every sequence, `batch` at a time."""
    n = len(seqs)
    padded = np.concatenate([seqs, np.zeros((-n % batch, seqs.shape[1]), seqs.dtype)])  # one program shape
    parts = [target(jnp.asarray(padded[i : i + batch])) for i in range(0, len(padded), batch)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs)[:n], *parts)


def _draft_programs(params32, cfg: ModelConfig, ecfg: eagle.EagleConfig, dc: DraftTrainConfig, opt):
    """The jitted (target, step, evaluate): target(seqs [batch, seq_len]) -> the frozen target's
    (logits, taps) on the device's serving kernels; step(draft, opt_state, seqs, (logits, taps))
    -> (draft, opt_state, loss, metrics), the draft and its optimizer state donated; and
    evaluate(draft, seqs, (logits, taps)) -> the metrics of `eagle.ttt_loss`."""
    embed = params32["embed_vd"]
    positions = jnp.broadcast_to(jnp.arange(dc.seq_len)[None], (dc.batch, dc.seq_len))
    target = jax.jit(
        lambda seqs: model.forward_taps_step(
            params32, seqs, positions, cfg=cfg, layers=ecfg.taps, kernels=ops.resolve("auto")
        )
    )

    def loss(d, seqs, feats):
        logits, taps = feats
        return eagle.ttt_loss(d, cfg, ecfg, embed, taps, seqs, logits)

    def step(d, state, seqs, feats):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(d, seqs, feats)
        updates, state = opt.update(grads, state, d)
        return optax.apply_updates(d, updates), state, value, metrics

    step = jax.jit(step, donate_argnums=(0, 1))
    evaluate = jax.jit(lambda d, s, f: loss(d, s, f)[1])
    return target, step, evaluate


def _held_out(evaluate, draft, held_seqs: np.ndarray, held_feats, batch: int) -> dict:
    """The draft's held-out metrics, each draft position's "acc" (top-1 agreement with the target)
    and "ce", averaged over the held-out batches."""
    ms = [
        evaluate(draft, jnp.asarray(held_seqs[i : i + batch]), jax.tree.map(lambda a: a[i : i + batch], held_feats))
        for i in range(0, len(held_seqs), batch)
    ]
    return {k: np.mean([np.asarray(m[k]) for m in ms], axis=0).tolist() for k in ("acc", "ce")}


def _train_steps(step, draft, opt_state, train_seqs: np.ndarray, feats_of, dc: DraftTrainConfig, cfg: ModelConfig):
    """`dc.steps` steps on batches of `train_seqs` (shuffled every epoch), feats_of(indices) giving
    their target features.  Returns (the draft, the loss and agreement of every 10th step and the
    last, the loop's seconds)."""
    it = iter(
        grain.MapDataset.source(np.arange(len(train_seqs)))
        .shuffle(seed=dc.seed)
        .repeat(None)
        .batch(dc.batch, drop_remainder=True)
        .to_iter_dataset()
    )
    history = []
    t0 = time.perf_counter()
    for i in tqdm(range(1, dc.steps + 1), desc=f"train-eagle {cfg.name}", disable=not dc.progress, unit="step"):
        idx = np.asarray(next(it))
        draft, opt_state, value, metrics = step(draft, opt_state, jnp.asarray(train_seqs[idx]), feats_of(idx))
        if i % 10 == 0 or i == dc.steps:
            history.append(dict(step=i, loss=float(value), acc=np.asarray(metrics["acc"]).tolist()))
    return draft, history, time.perf_counter() - t0


def train_draft(
    target_params, cfg: ModelConfig, dc: DraftTrainConfig, ecfg: eagle.EagleConfig | None = None, draft=None
) -> tuple[dict, dict]:
    """Train a draft for the frozen `target_params`.  Returns (the record written to
    out/eagle_train.json: held-out per-step agreement before and after, losses; the draft)."""
    ecfg = ecfg or eagle.default_config(cfg, ttt_steps=dc.ttt_steps)
    ecfg.check(cfg)
    text = corpora.load(dc.corpus, max_bytes=dc.max_corpus_bytes)
    params32 = model.cast_params(target_params, jnp.float32)
    t_data = time.perf_counter()
    train_seqs = build_data(params32, cfg, text.train, dc, dc.pool, dc.seed)
    held_seqs = build_data(params32, cfg, text.held_out, dc, dc.eval_batches * dc.batch, dc.seed + 1)
    data_s = time.perf_counter() - t_data
    if draft is None:
        draft = eagle.init_draft(jax.random.PRNGKey(dc.seed), cfg, ecfg, target_params)
    opt = optimizer(dc)
    opt_state = opt.init(draft)
    target, step, evaluate = _draft_programs(params32, cfg, ecfg, dc, opt)
    # The frozen target's logits and taps depend only on the sequence: with the pool fixed, they
    # are computed once per sequence (on the device) unless they would not fit in
    # FEATURE_CACHE_BYTES, in which case every step recomputes its batch's.
    pool_feats = (
        _features(target, train_seqs, dc.batch)
        if _feature_bytes(cfg, ecfg, train_seqs) <= FEATURE_CACHE_BYTES
        else None
    )
    held_feats = _features(target, held_seqs, dc.batch)

    def batch_feats(idx):
        if pool_feats is None:
            return target(jnp.asarray(train_seqs[idx]))
        return jax.tree.map(lambda a: a[jnp.asarray(idx)], pool_feats)

    before = _held_out(evaluate, draft, held_seqs, held_feats, dc.batch)
    draft, history, seconds = _train_steps(step, draft, opt_state, train_seqs, batch_feats, dc, cfg)
    after = _held_out(evaluate, draft, held_seqs, held_feats, dc.batch)
    result = dict(
        target=cfg.name,
        eagle=dataclasses.asdict(ecfg),
        train_config=dataclasses.asdict(dc),
        corpus=text.describe(),
        data_seconds=data_s,
        seconds=seconds,
        held_out_before=before,
        held_out_after=after,
        history=history,
        device=jax.devices()[0].device_kind,
    )
    if dc.out:
        os.makedirs(dc.out, exist_ok=True)
        save_draft(os.path.join(dc.out, "draft"), draft, ecfg, cfg, target_params)
        with open(os.path.join(dc.out, "eagle_train.json"), "w") as f:
            json.dump(result, f, indent=1)
    log.info(
        "trained the %s draft for %d steps in %.1f s: held-out top-1 agreement per step %s -> %s",
        cfg.name,
        dc.steps,
        seconds,
        np.round(before["acc"], 3).tolist(),
        np.round(after["acc"], 3).tolist(),
    )
    return result, draft
