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

OpenAI's presence and frequency penalties (vLLM's definition) come first, on the raw logits, for
greedy rows too: ``logits - frequency_penalty * count - presence_penalty * (count > 0)``, where
count is how often the token appears in the request's output so far (the prompt does not count).
On the device the counts live per KDA slot (`serving.decode_runner.DecodeRunner`), updated by each
step; the host's path (`choose_token`) counts the output it is given.

Logprobs (`token_logprobs`) are the model's own distribution, ``log_softmax(logits)`` before
penalties, temperature and filters (vLLM's default, "raw_logprobs"): the chosen token's and the
`MAX_LOGPROBS` most probable ones, of which a request keeps its `logprobs` first.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

# JAX is imported where the device functions run: `SamplingParams` is part of the scheduler's
# request records, and the scheduler imports no JAX.

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit; the device computes this many for every logprobs row
# top_k's ceiling: past any vocabulary served here (Kimi-Linear's is 163,840), well inside the int32 the
# device reads it as; a larger value is refused, not clamped (it would mean "all" only by accident)
MAX_TOP_K = 1 << 20
SEED_LIMIT = 2**63  # seeds lie in [0, 2^63): two uint32 words of a threefry key (`seed_words`)
# Each sampling parameter's range as pydantic's bound keywords (ge / gt / le / lt): the one table that
# bounds it where it enters, in the OpenAI requests (`serving.openai_api`) and in the worker's body
# and /adopt query (`serving.worker.schemas`).  `SamplingParams` checks the same ranges.
SAMPLING_BOUNDS: dict[str, dict[str, int | float]] = {
    "temperature": {"ge": 0.0, "le": 2.0},
    "top_p": {"gt": 0.0, "le": 1.0},
    "seed": {"ge": 0, "lt": SEED_LIMIT},
    "top_k": {"ge": -1, "le": MAX_TOP_K},
    "min_p": {"ge": 0.0, "le": 1.0},
    "presence_penalty": {"ge": -2.0, "le": 2.0},
    "frequency_penalty": {"ge": -2.0, "le": 2.0},
    "logprobs": {"ge": 0, "le": MAX_LOGPROBS},
}


def _real(v) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    seed: int = 0
    top_k: int = 0  # the k most probable tokens; 0 (or vLLM's -1): all
    min_p: float = 0.0  # tokens at least min_p times the most probable one's probability; 0: all
    presence_penalty: float = 0.0  # subtracted once from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k most probable

    def __post_init__(self):
        """ValueError naming the first field out of range: every value that passes converts to the
        device's dtypes (f32, int32, two uint32 seed words) without overflow."""
        if not (_real(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must lie in [0, 2]; got {self.temperature!r}")
        if not (_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1]; got {self.top_p!r}")
        if not (_integer(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2^63); got {self.seed!r}")
        if not (_integer(self.top_k) and -1 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be an integer in [-1, {MAX_TOP_K}] (0 or -1: off); got {self.top_k!r}")
        if not (_real(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must lie in [0, 1]; got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_real(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must lie in [-2, 2]; got {v!r}")
        if self.logprobs is not None and not (_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}]; got {self.logprobs!r}")

    @property
    def filtered(self) -> bool:
        """Whether top-k or min-p cut the distribution (beyond temperature and top-p)."""
        return self.top_k > 0 or self.min_p > 0

    @property
    def penalized(self) -> bool:
        """Whether presence or frequency penalties change the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def seed_words(seed: int) -> tuple[int, int]:
    """A 63-bit seed as the two uint32 words of its threefry key (high, low)."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def penalize(logits_bv, counts_bv, presence_b, frequency_b):
    """Logits f32 [B, V] with OpenAI's penalties: counts_bv int32 [B, V], each token's occurrences in
    the row's output so far; presence_b, frequency_b f32 [B]."""
    import jax.numpy as jnp  # device side: the router and the scheduler import this module without JAX

    counts = counts_bv.astype(jnp.float32)
    return logits_bv - frequency_b[:, None] * counts - presence_b[:, None] * (counts > 0)


def token_logprobs(logits_bv, tokens_b):
    """The model's logprobs (`log_softmax` of the raw logits f32 [B, V]): (of tokens_b f32 [B],
    top ids int32 [B, MAX_LOGPROBS], their logprobs f32 [B, MAX_LOGPROBS], most probable first)."""
    # device side, as in `penalize`
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logp.shape[-1]))
    chosen = jnp.take_along_axis(logp, tokens_b[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return chosen, top_ids.astype(jnp.int32), top_lp


def sample_tokens(
    logits_bv,
    temperature_b,
    top_p_b,
    seed_b2,
    position_b,
    *,
    greedy: bool,
    top_k_b=None,
    min_p_b=None,
    counts_bv=None,
    presence_b=None,
    frequency_b=None,
):
    """Next tokens int32 [B] from logits [B, V] (fp32), on the device.

    temperature_b f32 [B] (0: greedy row), top_p_b f32 [B], seed_b2 uint32 [B, 2] (`seed_words`),
    position_b int32 [B]: the absolute position of the token being chosen; top_k_b int32 [B]
    (<= 0: off) and min_p_b f32 [B] (0: off), or None: off for every row; counts_bv int32 [B, V]
    with presence_b / frequency_b f32 [B] (`penalize`), or None: no penalties.  greedy (static):
    every row is greedy, so the step is one argmax (no sort, no random bits)."""
    # device side, as in `penalize`
    import jax
    import jax.numpy as jnp

    logits = logits_bv.astype(jnp.float32)
    if counts_bv is not None:
        logits = penalize(logits, counts_bv, presence_b, frequency_b)
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
    import jax  # device side, as in `penalize`

    return jax.jit(sample_tokens, static_argnames=("greedy",))


@functools.cache
def _logprobs_one():
    import jax  # device side, as in `penalize`

    return jax.jit(token_logprobs)


def output_counts(output, vocab_size: int) -> np.ndarray:
    """int32 [vocab_size]: each token's occurrences in `output` (the penalties' counts)."""
    return np.bincount(np.asarray(output, np.int64), minlength=vocab_size)[:vocab_size].astype(np.int32)


def choose_token(logits_v: np.ndarray, params: SamplingParams, position: int, output=()) -> int:
    """The next token from fp32 logits [V] for the token at absolute `position`, after the
    request's `output` so far (its penalties' counts): `sample_tokens` for one row (what the
    serving step computes on the device)."""
    logits_v = np.asarray(logits_v, np.float32)
    if params.greedy and not params.penalized:
        return int(np.argmax(logits_v))
    pen = {}
    if params.penalized:
        pen = dict(
            counts_bv=output_counts(output, logits_v.shape[-1])[None],
            presence_b=np.asarray([params.presence_penalty], np.float32),
            frequency_b=np.asarray([params.frequency_penalty], np.float32),
        )
    out = _sample_one()(
        logits_v[None],
        np.asarray([params.temperature], np.float32),
        np.asarray([params.top_p], np.float32),
        np.asarray([seed_words(params.seed)], np.uint32),
        np.asarray([position], np.int32),
        greedy=params.greedy,
        top_k_b=np.asarray([params.top_k], np.int32),
        min_p_b=np.asarray([params.min_p], np.float32),
        **pen,
    )
    return int(out[0])


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The logprob of one chosen token and the `k` most probable ones (id, logprob), most probable first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_arrays(cls, chosen: float, top_ids, top_lp, k: int) -> "TokenLogprobs":
        return cls(float(chosen), tuple((int(i), float(lp)) for i, lp in zip(top_ids[:k], top_lp[:k])))

    def as_json(self) -> dict:
        return {"logprob": self.logprob, "top_logprobs": [list(t) for t in self.top]}

    @classmethod
    def from_json(cls, d: dict) -> "TokenLogprobs":
        top = d.get("top_logprobs") or []
        if not isinstance(d.get("logprob"), (int, float)) or not all(
            isinstance(t, (list, tuple)) and len(t) == 2 for t in top
        ):
            raise ValueError(f"not a token's logprobs: {str(d)[:120]}")
        return cls(float(d["logprob"]), tuple((int(i), float(lp)) for i, lp in top))


def logprobs_of(logits_v: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """`token_logprobs` for one row on the host (the prefill's first token, a sharded step's)."""
    chosen, ids, lps = _logprobs_one()(np.asarray(logits_v, np.float32)[None], np.asarray([token], np.int32))
    return TokenLogprobs.from_arrays(np.asarray(chosen)[0], np.asarray(ids)[0], np.asarray(lps)[0], k)
