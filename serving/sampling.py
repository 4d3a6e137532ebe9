"""Token choice from logits: greedy, or temperature / top-p sampling that is reproducible.

A sampled token depends only on (logits, temperature, top_p, seed, position):
the random draw for the token at absolute position p uses the key
``fold_in(key(seed), p)``.  So a request that is preempted and resumed, handed
from a prefill to a decode engine, or failed over to another worker mid-stream
continues with the tokens it would have produced uninterrupted.

The choice runs on the device, inside the serving step (`sample_tokens`): a step
returns B int32 tokens, not B x V fp32 logits, and the next step can take them
without the host.  `choose_token` is the same function for one row on the host.
Nucleus sampling draws by Gumbel-max over the tokens whose probability is at
least the nucleus edge's (so every token tied with the edge is kept).
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

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must lie in [0, 2]; got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1]; got {self.top_p!r}")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer in [0, 2^63); got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def seed_words(seed: int) -> tuple[int, int]:
    """A 63-bit seed as the two uint32 words of its threefry key (high, low)."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def sample_tokens(logits_bv, temperature_b, top_p_b, seed_b2, position_b, *, greedy: bool):
    """Next tokens int32 [B] from logits [B, V] (fp32), on the device.

    temperature_b f32 [B] (0: greedy row), top_p_b f32 [B], seed_b2 uint32 [B, 2] (`seed_words`),
    position_b int32 [B]: the absolute position of the token being chosen.  greedy (static):
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
    before = jnp.cumsum(p_desc, axis=-1) - p_desc  # mass of the tokens ahead of each one
    kept = jnp.sum(before < top_p_b[:, None], axis=-1)  # >= 1: the top token is always kept
    edge = jnp.take_along_axis(p_desc, (kept - 1)[:, None], axis=-1)  # the nucleus's smallest probability

    def gumbel(words, position):
        key = jax.random.fold_in(jax.random.wrap_key_data(words, impl="threefry2x32"), position)
        return jax.random.gumbel(key, logits.shape[-1:], jnp.float32)

    noise = jax.vmap(gumbel)(seed_b2.astype(jnp.uint32), position_b.astype(jnp.int32))
    drawn = jnp.argmax(jnp.where(p >= edge, z + noise, -jnp.inf), axis=-1).astype(jnp.int32)
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
                        np.asarray([position], np.int32), greedy=False)
    return int(out[0])
