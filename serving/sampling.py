"""Token choice from logits: greedy, or temperature / min-p / top-k / top-p sampling that is reproducible.

A sampled token depends only on (logits, sampling parameters, seed, position):
the random draw for the token at absolute position p uses the key
``fold_in(key(seed), p)``.  So a request that is preempted and resumed, handed
from a prefill to a decode engine, or failed over to another worker mid-stream
continues with the tokens it would have produced uninterrupted.

The choice runs on the device, inside the serving step (`sample_tokens`): a step
returns B int32 tokens, not B x V fp32 logits, and the next step can take them
without the host.  `choose_token` is the same function for one row on the host.
The filters apply in vLLM's order on the temperature-scaled distribution: min-p
(tokens under min_p times the top probability go), then top-k (the k most probable,
every token tied with the k-th kept), then top-p on what is left, renormalized (the
smallest set reaching top_p of it, every token tied with its edge kept); the draw is
Gumbel-max over the kept tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

# JAX is imported where the device functions run: `SamplingParams` is part of the scheduler's
# request records, and the scheduler imports no JAX.


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    seed: int = 0
    top_k: int = 0  # the k most probable tokens; 0 (or vLLM's -1): all
    min_p: float = 0.0  # tokens at least min_p times the most probable one's probability; 0: all

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must lie in [0, 2]; got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1]; got {self.top_p!r}")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer in [0, 2^63); got {self.seed!r}")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1):
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1: off); got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must lie in [0, 1]; got {self.min_p!r}")

    @property
    def filtered(self) -> bool:
        """Whether top-k or min-p cut the distribution (beyond temperature and top-p)."""
        return self.top_k > 0 or self.min_p > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def seed_words(seed: int) -> tuple[int, int]:
    """A 63-bit seed as the two uint32 words of its threefry key (high, low)."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def sample_tokens(logits_bv, temperature_b, top_p_b, seed_b2, position_b, *, greedy: bool, top_k_b=None,
                  min_p_b=None):
    """Next tokens int32 [B] from logits [B, V] (fp32), on the device.

    temperature_b f32 [B] (0: greedy row), top_p_b f32 [B], seed_b2 uint32 [B, 2] (`seed_words`),
    position_b int32 [B]: the absolute position of the token being chosen; top_k_b int32 [B]
    (<= 0: off) and min_p_b f32 [B] (0: off), or None: off for every row.  greedy (static):
    every row is greedy, so the step is one argmax (no sort, no random bits)."""
    import jax
    import jax.numpy as jnp

    logits = logits_bv.astype(jnp.float32)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return argmax
    temp = jnp.where(temperature_b > 0, temperature_b, 1.0)[:, None]
    z = logits / temp
    p = jax.nn.softmax(z, axis=-1)
    p_desc = -jnp.sort(-p, axis=-1)
    # min-p and top-k each keep the tokens at or above a threshold: a prefix of p_desc (ties included)
    floor = jnp.zeros(p.shape[:1] + (1,), jnp.float32)
    filtered = jnp.zeros(p.shape[:1], bool)
    if min_p_b is not None:  # relative to the top probability
        floor = jnp.maximum(floor, min_p_b[:, None] * p_desc[:, :1])
        filtered |= min_p_b > 0
    if top_k_b is not None:  # every token tied with the k-th
        kth = jnp.take_along_axis(p_desc, (jnp.clip(top_k_b, 1, p.shape[-1]) - 1)[:, None], axis=-1)
        floor = jnp.maximum(floor, jnp.where((top_k_b > 0)[:, None], kth, 0.0))
        filtered |= top_k_b > 0
    keep = p >= floor
    # top-p on what the filters left, renormalized (rows no filter touched: p as it is, bit for bit)
    mass = jnp.sum(jnp.where(keep, p, 0.0), axis=-1, keepdims=True)
    cut = lambda x: jnp.where(filtered[:, None], jnp.where(x >= floor, x, 0.0) / mass, x)
    q, q_desc = cut(p), cut(p_desc)
    before = jnp.cumsum(q_desc, axis=-1) - q_desc  # mass of the tokens ahead of each one
    kept = jnp.sum(before < top_p_b[:, None], axis=-1)  # >= 1: the top token is always kept
    edge = jnp.take_along_axis(q_desc, (kept - 1)[:, None], axis=-1)  # the nucleus's smallest probability
    keep &= q >= edge

    def gumbel(words, position):
        key = jax.random.fold_in(jax.random.wrap_key_data(words, impl="threefry2x32"), position)
        return jax.random.gumbel(key, logits.shape[-1:], jnp.float32)

    noise = jax.vmap(gumbel)(seed_b2.astype(jnp.uint32), position_b.astype(jnp.int32))
    drawn = jnp.argmax(jnp.where(keep, z + noise, -jnp.inf), axis=-1).astype(jnp.int32)
    return jnp.where(temperature_b > 0, drawn, argmax)


@functools.cache
def _sample_one():
    import jax

    return jax.jit(sample_tokens, static_argnames=("greedy",))


def choose_token(logits_v: np.ndarray, params: SamplingParams, position: int) -> int:
    """The next token from fp32 logits [V] for the token at absolute `position`: `sample_tokens`
    for one row (what the serving step computes on the device)."""
    if params.greedy:
        return int(np.argmax(logits_v))
    out = _sample_one()(np.asarray(logits_v, np.float32)[None], np.asarray([params.temperature], np.float32),
                        np.asarray([params.top_p], np.float32), np.asarray([seed_words(params.seed)], np.uint32),
                        np.asarray([position], np.int32), greedy=False,
                        top_k_b=np.asarray([params.top_k], np.int32), min_p_b=np.asarray([params.min_p], np.float32))
    return int(out[0])
