"""Speculative decoding with an EAGLE-3 draft head: the reference, its cached twin, and the acceptance rule.

`speculative_generate` (use_cache=False) is the no-cache reference the engine's speculative
path is held against, as `generate(use_cache=False)` is for plain decoding: fp32, the target recomputed over
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

`use_cache=True` keeps the target's state in a contiguous cache instead (`model.init_cache`):
the verify pass runs only the k + 1 new tokens and returns the KDA layers' state after each of
them (the pass's KDA runs at chunk 1, so every position is an export); the accepted prefix is
committed by taking each KDA layer's state and conv rows after a + 1 tokens and advancing the
lengths by a + 1.  MLA needs no rollback: latent rows past the lengths are never attended (they
lie after every later query and are overwritten by the next pass).  What the engine's
speculative step does with its state slots and pages, on a cache one can read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import eagle, tokenizer
from kimik3.config import ModelConfig
from kimik3.caches import KDAState, LayerCaches
from kimik3.model import forward_caches, forward_taps_step, cast_params, init_cache

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
    logits, taps = forward_taps_step(params, buf_1l, positions, cfg=cfg, layers=layers, kernels="reference")
    return logits[0], taps[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _draft_slot(draft, embed_vd, feat_ld, toks_l, n, *, cfg):
    """The draft over slots 0 .. L - 1 (causal: slots past n do not reach n); (hidden, logits) at slot n."""
    pos = jnp.arange(feat_ld.shape[0], dtype=jnp.int32)[None]
    hidden, _ = eagle.draft_layer(draft, cfg, feat_ld[None], embed_vd[toks_l][None], pos)
    h = jax.lax.dynamic_index_in_dim(hidden[0], n, keepdims=False)
    return h, eagle.draft_logits(draft, cfg, h[None, None])[0, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "layers", "per_token"))
def _cached_pass(params, tokens_bt, cache, *, cfg, layers, per_token):
    """The target over tokens [B, T] continuing a contiguous cache (reference kernels): (logits
    [B, T, V], taps [B, T, len(layers), D], the cache after all T, and with per_token each KDA
    layer's `KDAState` (state [B, T, ...], conv [B, T, ...]) after 1 .. T tokens, else None)."""
    b, t = tokens_bt.shape
    positions = cache["lengths"][:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    at = jnp.arange(1, t + 1, dtype=jnp.int32) if per_token else None
    # chunk 1: the chunked KDA form at one token a chunk is the recurrence, and exports every position
    run_cfg = dataclasses.replace(cfg, kda_chunk_size=1) if per_token else cfg
    logits, caches, exports, taps = forward_caches(
        params,
        tokens_bt,
        positions,
        LayerCaches(tuple(cache["layers"])),
        None,
        cfg=run_cfg,
        expert_path="grouped",
        kernels="reference",
        taps=layers,
        export_at=at,
    )
    return logits, taps, {"lengths": cache["lengths"] + t, "layers": caches.layers}, exports


@functools.partial(jax.jit, static_argnames=("cfg",))
def commit(cache_before, cache_after, exports, keep_b, *, cfg):
    """The contiguous cache after only the first keep_b [B] (in 1 .. T) of a per-token pass's T
    tokens: KDA state and conv rows from the exports, lengths advanced by keep_b, MLA rows as
    the pass wrote them (those past the new lengths are never read)."""
    pick = lambda x: jax.vmap(lambda xb, n: xb[n - 1])(x, keep_b)
    per_kda_layer = iter(exports)
    layers = []
    for c, kind in zip(cache_after["layers"], cfg.mixer_kinds):
        if kind == "kda":
            e = next(per_kda_layer)
            c = KDAState(pick(e.state), pick(e.conv).astype(c.conv.dtype))
        layers.append(c)
    return {"lengths": cache_before["lengths"] + keep_b, "layers": tuple(layers)}


class _NoCacheTarget:
    """The reference's target: every pass recomputes the whole sequence."""

    def __init__(self, params32, cfg, layers, prompt, total):
        self.params, self.cfg, self.layers, self.capacity = params32, cfg, layers, total
        self.buf = np.zeros((1, total), np.int32)
        self.buf[0, : prompt.size] = prompt
        self.logits, self.taps = _target_pass(params32, jnp.asarray(self.buf), cfg=cfg, layers=layers)

    def prefill_logits(self, n):
        return np.asarray(self.logits[n - 1])

    def taps_buffer(self):
        """[capacity, taps, D]: the taps of every position (those past the committed ones unused)."""
        return self.taps

    def verify(self, n, tokens):
        """Logits after each of tokens (placed at n ..), as [len(tokens), V]."""
        self.buf[0, n : n + len(tokens)] = tokens
        self.logits, self.taps = _target_pass(self.params, jnp.asarray(self.buf), cfg=self.cfg, layers=self.layers)
        return np.asarray(self.logits[n : n + len(tokens)])

    def keep(self, n, count):
        self.buf[0, n + count :] = 0


class _CachedTarget:
    """The target on a contiguous cache: passes over the new tokens only (see the module docstring)."""

    def __init__(self, params32, cfg, layers, prompt, total):
        self.params, self.cfg, self.layers = params32, cfg, layers
        self.capacity = min(total, cfg.max_seq_len)
        self.cache = init_cache(cfg, 1, self.capacity, jnp.float32)
        logits, taps, self.cache, _ = _cached_pass(
            params32, jnp.asarray(prompt[None], jnp.int32), self.cache, cfg=cfg, layers=layers, per_token=False
        )
        self.taps = np.zeros((total,) + taps.shape[2:], np.float32)
        self.taps[: prompt.size] = np.asarray(taps[0])
        self.last = np.asarray(logits[0, -1])

    def prefill_logits(self, n):
        return self.last

    def taps_buffer(self):
        return jnp.asarray(self.taps)

    def verify(self, n, tokens):
        toks = jnp.asarray(np.asarray(tokens, np.int32)[None])
        logits, taps, self._after, self._exports = _cached_pass(
            self.params, toks, self.cache, cfg=self.cfg, layers=self.layers, per_token=True
        )
        self._pending = np.asarray(taps[0])
        return np.asarray(logits[0])

    def keep(self, n, count):
        self.cache = commit(self.cache, self._after, self._exports, jnp.asarray([count], jnp.int32), cfg=self.cfg)
        self.taps[n : n + count] = self._pending[:count]


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
            raise ValueError(
                f"the draft head does not fit target {cfg.name}: {name} is {got}, the target needs "
                f"{shape} (a draft trained for another target?)"
            )


def speculative_generate(
    target_params,
    cfg: ModelConfig,
    draft,
    ecfg: eagle.EagleConfig,
    prompt_tokens,
    max_new_tokens: int,
    k: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_at_eos: bool = False,
    use_cache: bool = False,
) -> SpecResult:
    """Decode `prompt_tokens` with k drafted tokens per target pass (see the module docstring).
    temperature 0: exactly `generate(use_cache=False)`'s tokens, with or without the cache."""
    check_draft(cfg, ecfg, draft, k)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    prompt = np.asarray(prompt_tokens, np.int64).reshape(-1)
    if prompt.size == 0 or max_new_tokens < 1:
        raise ValueError("the prompt must hold a token and max_new_tokens must be >= 1")
    if prompt.size + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({prompt.size}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len {cfg.max_seq_len}"
        )
    total = prompt.size + max_new_tokens + k + 1  # the committed tokens and one round's drafts
    params32 = cast_params(target_params, jnp.float32)
    draft32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), draft)
    embed = params32["embed_vd"]
    rng = np.random.default_rng(seed)
    pick = (
        (lambda lg: int(np.argmax(lg)))
        if temperature == 0
        else (lambda lg: int(rng.choice(lg.shape[-1], p=probs(lg, temperature))))
    )
    target = (_CachedTarget if use_cache else _NoCacheTarget)(params32, cfg, ecfg.taps, prompt, total)
    committed = np.zeros(total, np.int32)
    committed[: prompt.size] = prompt
    n = prompt.size  # committed tokens
    t0 = pick(target.prefill_logits(n))
    out, accepted = [], []
    while True:
        out.append(t0)
        committed[n] = t0
        if len(out) >= max_new_tokens or (stop_at_eos and t0 == tokenizer.EOS_ID):
            break
        # draft d_1 .. d_k: slot i reads (h_i, x_{i+1}) for i < n, then its own hidden states
        feat = np.zeros((total, cfg.d_model), np.float32)
        # fused at every position, one shape for every round (the FC is per position), kept up to n
        feat[:n] = np.asarray(eagle.fuse(draft32, target.taps_buffer()[None])[0])[:n]
        toks = np.concatenate([committed[1:], np.zeros(1, np.int32)])  # slot i reads x_{i+1}
        drafted, qs = [], []
        for s in range(min(k, target.capacity - n - 1)):  # near the cache's end, fewer drafts
            slot = n - 1 + s
            h, lg = _draft_slot(draft32, embed, jnp.asarray(feat), jnp.asarray(toks), slot, cfg=cfg)
            lg = np.asarray(lg)
            d = pick(lg)
            drafted.append(d)
            if temperature > 0:
                qs.append(probs(lg, temperature))
            feat[slot + 1] = np.asarray(h)
            toks[slot + 1] = d
        logits = target.verify(n, [t0] + drafted)  # [k + 1, V]: after t0, d_1 .. d_k
        a, t0 = accept(logits, drafted, np.stack(qs) if qs else None, temperature=temperature, rng=rng)
        accepted.append(a)
        target.keep(n, a + 1)  # t0 and d_1 .. d_a are committed
        n += 1
        for d in drafted[:a]:
            out.append(d)
            committed[n] = d
            n += 1
            if len(out) >= max_new_tokens or (stop_at_eos and d == tokenizer.EOS_ID):
                return SpecResult(np.asarray(out, np.int32), tuple(accepted), k)
    return SpecResult(np.asarray(out, np.int32), tuple(accepted), k)
