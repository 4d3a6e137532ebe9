"""The request sets `kimik3 bench serve` sends (`serving.bench_serve`): seeded, so one seed is one
request set on every run.

* ``random``: prompts of about `input_len` tokens and `output_len` tokens to generate, each drawn
  uniformly from ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (vLLM's random dataset).
  To /v1/completions the prompt is a list of token ids (the server takes them as given: exactly
  the drawn count); to /v1/chat/completions it is text of one printable ASCII character per
  token (one token each under the byte tokenizer, fewer under a BPE; the chat template adds its
  own).  Ids are drawn from printable ASCII bytes (32..126), which every kimik3 tokenizer holds
  as text tokens: the byte tokenizer's bytes, the first ids of a byte-level BPE.
* ``multiturn``: the agent workload's sessions (`serving.workload`: a shared system prompt, each
  turn's prompt the whole history so far plus its new input, the turn's output fixed), token
  counts divided by `scale`.  A session's turns are sent in order, each once the previous has
  finished, so every turn after the first finds its history in the prefix cache.
* ``mt-bench``: the first turns of the MT-Bench questions (a JSON line each, ``turns`` a list of
  strings), in a seeded order, repeated past the file's 80; `output_len` tokens each (vLLM's 256).

A request's `prompt_len` is its prompt's tokens as built here (for text: its UTF-8 bytes); the
benchmark replaces it with the server's count (the usage of the stream's last chunk) where the
server reports one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from serving.workload import WorkloadSpec, generate_sessions, interleave

DATASETS = ("random", "multiturn", "mt-bench")
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
DEFAULT_ENDPOINT = {"random": COMPLETIONS, "multiturn": COMPLETIONS, "mt-bench": CHAT}
TEXT_IDS = (32, 127)  # printable ASCII: a text token of every kimik3 tokenizer, one character each

MT_BENCH_FILE = "mt_bench_questions.jsonl"
_HERE = os.path.dirname(os.path.abspath(__file__))
# the repository's sibling data directory (../shared/data from the checkout), else the packaged copy
SHARED_MT_BENCH = os.path.normpath(os.path.join(_HERE, "..", "..", "shared", "data", MT_BENCH_FILE))
PACKAGED_MT_BENCH = os.path.join(_HERE, "data", MT_BENCH_FILE)


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One request to send.  `prompt`: token ids or text (/v1/completions) or the messages
    (/v1/chat/completions); `output_len`: its max_tokens; `session`: requests of one session are
    sent in list order, each after the one before it finished (`turn` counts them)."""

    prompt: list[int] | str | list[dict]
    prompt_len: int
    output_len: int
    session: int
    turn: int = 0


def default_mt_bench_path() -> str:
    """../shared/data/mt_bench_questions.jsonl next to the checkout when present, else the copy in
    serving/data."""
    return SHARED_MT_BENCH if os.path.isfile(SHARED_MT_BENCH) else PACKAGED_MT_BENCH


def _lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    lo, hi = max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))
    return rng.integers(lo, hi, n, endpoint=True)


def random_requests(
    n: int, input_len: int, output_len: int, *, endpoint: str = COMPLETIONS, range_ratio: float = 0.0, seed: int = 0
) -> list[SampleRequest]:
    """`n` random prompts (the module docstring): ids to /v1/completions, text to chat."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--random-input-len and --random-output-len must be >= 1 (got {input_len}, {output_len})")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must lie in [0, 1) (got {range_ratio})")
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    out = []
    for i, (k, m) in enumerate(zip(ins.tolist(), outs.tolist())):
        ids = rng.integers(*TEXT_IDS, k).tolist()
        prompt = ids if endpoint == COMPLETIONS else [{"role": "user", "content": bytes(ids).decode("ascii")}]
        out.append(SampleRequest(prompt, k, m, session=i))
    return out


def multiturn_requests(
    n: int | None,
    *,
    sessions: int,
    turns: tuple[int, int],
    scale: float,
    endpoint: str = COMPLETIONS,
    max_model_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """The workload's turns (`serving.workload.generate_sessions` of `WorkloadSpec.scaled(scale)`)
    in arrival order, at most `n` (None: all).  A session ends before its first turn whose prompt
    and output exceed `max_model_len` (the later turns only grow).  Token-id prompts: /v1/completions only."""
    if endpoint != COMPLETIONS:
        raise ValueError(f"the multiturn dataset sends token-id prompts: use --endpoint {COMPLETIONS}")
    spec = WorkloadSpec.scaled(scale, sessions=sessions, turns=turns, seed=seed)
    fits = lambda t: max_model_len is None or len(t.prompt) + len(t.output) <= max_model_len
    kept = []
    for session in generate_sessions(spec):
        k = next((i for i, t in enumerate(session) if not fits(t)), len(session))
        kept.append(session[:k])
    ordered = interleave(kept)[:n] if n is not None else interleave(kept)
    if not ordered:
        raise ValueError(
            f"no multiturn turn fits --max-model-len {max_model_len}: raise --multiturn-scale (now {scale:g})"
        )
    return [SampleRequest(list(t.prompt), len(t.prompt), len(t.output), t.session, t.turn) for t in ordered]


def load_mt_bench(path: str) -> list[str]:
    """The first turn of every question in the JSON-lines file at `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"--dataset-path {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {path}: not JSON lines ({e})") from None
    firsts = [r["turns"][0] for r in rows if isinstance(r, dict) and r.get("turns")]
    if not firsts:
        raise ValueError(f"--dataset-path {path}: no question with turns")
    return firsts


def mt_bench_requests(
    n: int, path: str, output_len: int, *, endpoint: str = CHAT, seed: int = 0
) -> list[SampleRequest]:
    """`n` first turns of MT-Bench in a seeded order (all of them once before any repeats)."""
    questions = load_mt_bench(path)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(questions)) for _ in range(-(-n // len(questions)))])[:n]
    out = []
    for i, q in enumerate(order.tolist()):
        text = questions[q]
        prompt = text if endpoint == COMPLETIONS else [{"role": "user", "content": text}]
        out.append(SampleRequest(prompt, len(text.encode()), output_len, session=i))
    return out
