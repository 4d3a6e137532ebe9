"""Speculative decoding with an EAGLE-3 draft head: the reference, and the acceptance rule.

`speculative_generate` is the no-cache reference the engine's speculative path is held
against, as `generate(use_cache=False)` is for plain decoding: fp32, the target recomputed over
the whole sequence at every verification (reference kernels), the draft over every slot at
every drafted token.  A round::

    t0            the token the target chose after the committed tokens c (emitted)
    d_1 .. d_k    drafted on (taps of c, c + [t0]) by the chained head (`kimik3.eagle`)
    verify        one target pass over c + [t0, d_1 .. d_k]: p_0 .. p_k
    accept        d_1 .. d_a (`accept`), and the next round's t0 from p_a (the correction
                  where d_{a+1} was refused, the bonus token when all k were kept)

Greedy (temperature 0) keeps d_i while it is the target's argmax, so the output is exactly
greedy decoding's.  With temperature > 0 it is rejection sampling (Leviathan et al. 2023,
Chen et al. 2023): d_i is kept with probability min(1, p(d_i) / q(d_i)), a refused one is
replaced by a sample of norm(max(p - q, 0)), so every emitted token is distributed as the
target's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import eagle, tokenizer
from kimik3.config import ModelConfig
from kimik3.model import _forward_taps, cast_params

MAX_DRAFT_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class SpecResult:
    tokens: np.ndarray  # int32 [N] generated ids (prompt excluded)
    accepted: tuple[int, ...]  # per verification: drafted tokens kept (0 .. k)
    k: int

    @property
    def acceptance(self) -> float:
        """Kept drafted tokens / drafted tokens."""
        return sum(self.accepted) / max(len(self.accepted) * self.k, 1)

    @property
    def accept_length(self) -> float:
        """Tokens emitted per target pass (kept drafts + the target's own), EAGLE's tau."""
        return float(np.mean([a + 1 for a in self.accepted])) if self.accepted else 0.0


def probs(logits, temperature: float) -> np.ndarray:
    """fp64 softmax(logits / temperature) over the last axis."""
    z = np.asarray(logits, np.float64) / temperature
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def accept(target_logits, draft_tokens, draft_probs=None, *, temperature: float = 0.0, rng=None):
    """The verification rule.  target_logits [k + 1, V]: the target's logits after t0, d_1 .. d_k;
    draft_tokens [k]; draft_probs [k, V] the distributions d_i were drawn from (temperature > 0).
    Returns (a, next_token): d_1 .. d_a are kept, next_token is the target's token after d_a."""
    k = len(draft_tokens)
    if temperature == 0.0:
        choice = np.argmax(np.asarray(target_logits), axis=-1)
        a = 0
        while a < k and int(draft_tokens[a]) == int(choice[a]):
            a += 1
        return a, int(choice[a])
    p = probs(target_logits, temperature)
    q = np.asarray(draft_probs, np.float64)
    for i in range(k):
        d = int(draft_tokens[i])
        if rng.random() * q[i, d] < p[i, d]:  # u < p / q, without dividing by a zero q
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        residual = p[i] if total <= 0 else residual / total
        return i, int(rng.choice(residual.size, p=residual))
    return k, int(rng.choice(p.shape[1], p=p[k]))


@functools.partial(jax.jit, static_argnames=("cfg", "layers"))
def _target_pass(params, buf_1l, *, cfg, layers):
    positions = jnp.arange(buf_1l.shape[1], dtype=jnp.int32)[None]
    logits, taps = _forward_taps(params, buf_1l, positions, cfg=cfg, layers=layers, kernels="reference")
    return logits[0], taps[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _draft_slot(draft, embed_vd, feat_ld, toks_l, n, *, cfg):
    """The draft over slots 0 .. L - 1 (causal: slots past n do not reach n); (hidden, logits) at slot n."""
    pos = jnp.arange(feat_ld.shape[0], dtype=jnp.int32)[None]
    hidden, _ = eagle.draft_layer(draft, cfg, feat_ld[None], embed_vd[toks_l][None], pos)
    h = jax.lax.dynamic_index_in_dim(hidden[0], n, keepdims=False)
    return h, eagle.draft_logits(draft, cfg, h[None, None])[0, 0]


def check_draft(cfg: ModelConfig, ecfg: eagle.EagleConfig, draft, k: int) -> None:
    """Clear errors before any launch: k out of range, a draft made for another target."""
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft tokens k must be in [1, {MAX_DRAFT_TOKENS}]; got {k}")
    ecfg.check(cfg)
    d = cfg.d_model
    want = {"fc_fd": (3 * d, d), "lm_head_dv": (d, cfg.vocab_size)}
    for name, shape in want.items():
        got = tuple(np.shape(draft.get(name))) if name in draft else None
        if got != shape:
            raise ValueError(f"the draft head does not fit target {cfg.name}: {name} is {got}, the target needs "
                             f"{shape} (a draft trained for another target?)")


def speculative_generate(target_params, cfg: ModelConfig, draft, ecfg: eagle.EagleConfig, prompt_tokens,
                         max_new_tokens: int, k: int, *, temperature: float = 0.0, seed: int = 0,
                         stop_at_eos: bool = False) -> SpecResult:
    """Decode `prompt_tokens` with k drafted tokens per target pass (see the module docstring).
    temperature 0: exactly `generate(use_cache=False)`'s tokens."""
    check_draft(cfg, ecfg, draft, k)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    prompt = np.asarray(prompt_tokens, np.int64).reshape(-1)
    if prompt.size == 0 or max_new_tokens < 1:
        raise ValueError("the prompt must hold a token and max_new_tokens must be >= 1")
    if prompt.size + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt ({prompt.size}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                         f"{cfg.max_seq_len}")
    total = prompt.size + max_new_tokens + k + 1  # the committed tokens and one round's drafts
    params32 = cast_params(target_params, jnp.float32)
    draft32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), draft)
    embed = params32["embed_vd"]
    rng = np.random.default_rng(seed)
    pick = (lambda lg: int(np.argmax(lg))) if temperature == 0 else (
        lambda lg: int(rng.choice(lg.shape[-1], p=probs(lg, temperature))))
    buf = np.zeros((1, total), np.int32)
    buf[0, :prompt.size] = prompt
    n = prompt.size  # committed tokens
    logits, taps = _target_pass(params32, jnp.asarray(buf), cfg=cfg, layers=ecfg.taps)
    t0 = pick(np.asarray(logits[n - 1]))
    out, accepted = [], []
    while True:
        out.append(t0)
        buf[0, n] = t0
        n += 1
        if len(out) >= max_new_tokens or (stop_at_eos and t0 == tokenizer.EOS_ID):
            break
        # draft d_1 .. d_k: slot i reads (h_i, x_{i+1}) for i < n - 1, then its own hidden states
        feat = np.zeros((total, cfg.d_model), np.float32)
        feat[:n - 1] = np.asarray(eagle.fuse(draft32, taps[None, :n - 1])[0])
        toks = np.concatenate([buf[0, 1:], np.zeros(1, np.int32)])  # slot i reads x_{i+1}
        drafted, qs = [], []
        for s in range(k):
            slot = n - 2 + s
            h, lg = _draft_slot(draft32, embed, jnp.asarray(feat), jnp.asarray(toks), slot, cfg=cfg)
            lg = np.asarray(lg)
            d = pick(lg)
            drafted.append(d)
            if temperature > 0:
                qs.append(probs(lg, temperature))
            feat[slot + 1] = np.asarray(h)
            toks[slot + 1] = d
        buf[0, n:n + k] = drafted
        logits, taps = _target_pass(params32, jnp.asarray(buf), cfg=cfg, layers=ecfg.taps)
        a, t0 = accept(np.asarray(logits[n - 1:n + k]), drafted, np.stack(qs) if qs else None,
                       temperature=temperature, rng=rng)
        accepted.append(a)
        for d in drafted[:a]:
            out.append(d)
            if len(out) >= max_new_tokens or (stop_at_eos and d == tokenizer.EOS_ID):
                return SpecResult(np.asarray(out, np.int32), tuple(accepted), k)
        buf[0, n:n + k] = 0
        buf[0, n:n + a] = drafted[:a]
        n += a
    return SpecResult(np.asarray(out, np.int32), tuple(accepted), k)
