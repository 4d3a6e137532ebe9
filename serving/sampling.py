"""Token choice from logits: greedy, or temperature / top-p sampling that is reproducible.

A sampled token depends only on (logits, temperature, top_p, seed, position):
the random draw for the token at absolute position p uses a generator seeded
with ``(seed, p)``.  So a request that is preempted and resumed, handed from a
prefill to a decode engine, or failed over to another worker mid-stream
continues with the tokens it would have produced uninterrupted.
"""

from __future__ import annotations

import dataclasses

import numpy as np


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


def choose_token(logits_v: np.ndarray, params: SamplingParams, position: int) -> int:
    """The next token from fp32 logits [V] for the token at absolute `position`."""
    if params.greedy:
        return int(np.argmax(logits_v))
    z = np.asarray(logits_v, np.float64) / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < params.top_p  # tokens before which mass < top_p
        mask = np.zeros_like(p, bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    rng = np.random.default_rng([params.seed, position])
    return int(rng.choice(p.size, p=p))
