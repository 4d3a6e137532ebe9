"""Seeded multi-turn agent workloads (docs/design.md), scaled to taste.

A session is a conversation of `turns` requests; each turn's prompt is the
whole history so far (system prompt, every earlier input and output) plus the
new input (a user message or a tool result), and the turn then generates
`output_tokens`.  Sessions start in bursts.  Token ids are drawn per session
so different sessions share only the common system prompt.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    sessions: int = 8
    turns: tuple[int, int] = (20, 30)  # inclusive range per session
    input_tokens: tuple[int, int] = (2048, 4096)  # new tokens per turn
    output_tokens: tuple[int, int] = (300, 600)
    system_prompt_tokens: int = 1024  # shared by every session
    burst_size: int = 4  # sessions arriving together
    burst_gap_s: float = 30.0
    think_time_s: tuple[float, float] = (1.0, 5.0)  # between a turn's end and the next turn
    vocab: int = 256
    seed: int = 0

    @classmethod
    def scaled(cls, factor: float, **overrides) -> "WorkloadSpec":
        """The docs/design.md shape with token counts divided by `factor` (for CPU runs)."""
        base = cls(**overrides)
        div = lambda r: (max(1, int(r[0] / factor)), max(1, int(r[1] / factor)))
        return dataclasses.replace(
            base,
            input_tokens=div(base.input_tokens),
            output_tokens=div(base.output_tokens),
            system_prompt_tokens=max(1, int(base.system_prompt_tokens / factor)),
        )


@dataclasses.dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    arrival_s: float  # earliest start: the session's burst time plus think times (set by the replay)
    prompt: tuple[int, ...]  # the whole history plus the new input
    output: tuple[int, ...]  # what the model "says" (fixed here, so replays are reproducible)


def generate_sessions(spec: WorkloadSpec) -> list[list[Turn]]:
    """Deterministic sessions: a list of turns per session."""
    rng = np.random.default_rng(spec.seed)
    system = rng.integers(0, spec.vocab, spec.system_prompt_tokens).tolist()
    sessions = []
    for s in range(spec.sessions):
        start = (s // spec.burst_size) * spec.burst_gap_s
        history = list(system)
        turns, t = [], start
        for k in range(int(rng.integers(spec.turns[0], spec.turns[1] + 1))):
            history += rng.integers(0, spec.vocab, int(rng.integers(*spec.input_tokens, endpoint=True))).tolist()
            out = rng.integers(0, spec.vocab, int(rng.integers(*spec.output_tokens, endpoint=True))).tolist()
            turns.append(Turn(s, k, t, tuple(history), tuple(out)))
            history += out
            t += float(rng.uniform(*spec.think_time_s))
        sessions.append(turns)
    return sessions


def interleave(sessions: list[list[Turn]]) -> list[Turn]:
    """All turns in arrival order (a session's turns stay in order)."""
    return sorted((t for s in sessions for t in s), key=lambda t: (t.arrival_s, t.session, t.turn))
