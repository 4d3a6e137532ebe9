"""The decode program and the device buffers it reuses from step to step.

A serving decode step is one XLA program over the whole model (~670 kernels for `small`).
XLA runs it as one CUDA graph (a command buffer), and re-records that graph whenever a
buffer it touches moved: fresh input arrays every step (tokens, block tables, slots,
lengths) and a fresh logits output made every step re-record all of it, which cost more
host time than the GPU spent on the step.  So the decode program here touches only buffers
that stay put:

* the params (never change) and the pools (donated: updated in place);
* a `DecodeIO` per batch bucket (donated: its output aliases it), holding the step's
  inputs *and* outputs::

      {"tokens": int32 [B]        the input token of each row; the step writes the sampled one
       "lengths": int32 [B]       tokens in the cache (the input's position); += active
       "tables": int32 [B, P]     block tables (null pages for padding rows)
       "slots": int32 [B]         KDA state slots (padding rows share the scratch slot)
       "active": int32 [B]        1 for a request's row, 0 for padding
       "temperature": f32 [B], "top_p": f32 [B], "seed": uint32 [B, 2],
       "top_k": int32 [B], "min_p": f32 [B],
       "presence": f32 [B], "frequency": f32 [B]                          sampling per row}

The step samples on the device (`serving.sampling.sample_tokens`) and writes the tokens
into `io["tokens"]` and `lengths + active` into `io["lengths"]`: the next step's inputs,
with no host round trip.  When the host's rows differ from what the buffers already hold
(a new page in a table, a request joining or leaving), `_overwrite` writes them, every entry
(or every entry but the tokens, chained on the device's), into the same buffers (donated,
aliased): two write programs per bucket, compiled at warm-up.  The tokens reach the host through `_read_tokens`,
a copy in its own small program.

Requests with presence / frequency penalties or logprobs run a variant, `decode_program_ext`:
it takes the runner's per-slot output counts int32 [num_slots + 1, V] (donated; each step adds
its input token, always the request's latest output token, to its slot's row, so a row holds
the request's whole output when the penalties read it) and returns the chosen tokens' logprobs
and the top `MAX_LOGPROBS` (fresh outputs each step: the variant pays the graph's re-record the
plain program avoids).  The host writes a slot's row (`DecodeRunner._sync_counts`) when it does
not hold the request's output so far: a new request in the slot, a resume, a handoff.  It is
one program per bucket and greedy flag whatever the rows ask (rows without penalties have zero
coefficients, logprobs are computed for every row): a server compiles it at a client's first
such request.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import model
from kimik3.config import ModelConfig
from serving.sampling import SamplingParams, TokenLogprobs, output_counts, sample_tokens, seed_words, token_logprobs

log = logging.getLogger(__name__)

IO_KEYS = (
    "tokens",
    "lengths",
    "tables",
    "slots",
    "active",
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "presence",
    "frequency",
)


@dataclasses.dataclass
class DecodeRows:
    """A decode batch on the host, padded to its bucket (numpy; the layout of `DecodeIO`)."""

    tokens: np.ndarray
    lengths: np.ndarray
    tables: np.ndarray
    slots: np.ndarray
    active: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    logprobs: tuple = ()  # per request row: how many top logprobs it reports (None: none); host-only

    @classmethod
    def build(
        cls,
        bucket: int,
        tokens,
        tables,
        slots,
        lengths,
        sampling: list[SamplingParams],
        *,
        max_pages: int,
        null_page: int,
        scratch_slot: int,
    ) -> "DecodeRows":
        n, pad = len(tokens), bucket - len(tokens)
        table = np.full((bucket, max_pages), null_page, np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        as_i32 = lambda xs, fill: np.asarray(list(xs) + [fill] * pad, np.int32)
        return cls(
            tokens=as_i32(tokens, 0),
            lengths=as_i32(lengths, 0),
            tables=table,
            slots=as_i32(slots, scratch_slot),
            active=as_i32([1] * n, 0),
            temperature=np.asarray([s.temperature for s in sampling] + [0.0] * pad, np.float32),
            top_p=np.asarray([s.top_p for s in sampling] + [1.0] * pad, np.float32),
            seed=np.asarray([seed_words(s.seed) for s in sampling] + [(0, 0)] * pad, np.uint32),
            top_k=np.asarray([s.top_k for s in sampling] + [0] * pad, np.int32),
            min_p=np.asarray([s.min_p for s in sampling] + [0.0] * pad, np.float32),
            presence=np.asarray([s.presence_penalty for s in sampling] + [0.0] * pad, np.float32),
            frequency=np.asarray([s.frequency_penalty for s in sampling] + [0.0] * pad, np.float32),
            logprobs=tuple(s.logprobs for s in sampling),
        )

    @property
    def greedy(self) -> bool:
        return not bool(np.any(self.temperature > 0))

    @property
    def penalized(self) -> bool:
        return bool(np.any(self.presence != 0) or np.any(self.frequency != 0))

    @property
    def wants_logprobs(self) -> bool:
        return any(k is not None for k in self.logprobs)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in IO_KEYS}

    def same_as(self, other: "DecodeRows | None") -> bool:
        return other is not None and all(np.array_equal(getattr(self, k), getattr(other, k)) for k in IO_KEYS)

    def advanced(self, new_tokens: np.ndarray) -> "DecodeRows":
        """What the buffers hold after a step that sampled `new_tokens`."""
        return dataclasses.replace(
            self,
            tokens=np.where(self.active > 0, new_tokens, self.tokens).astype(np.int32),
            lengths=(self.lengths + self.active).astype(np.int32),
        )


def _decode_body(
    params, pools, io, counts=None, *, cfg: ModelConfig, kernels: str, greedy: bool, logprobs: bool = False
):
    view = model.paged_view(pools, io["tables"], io["slots"], io["lengths"])
    logits, view, _ = model.forward_paged(
        params,
        io["tokens"][:, None],
        io["lengths"][:, None],
        view,
        None,
        cfg=cfg,
        expert_path="grouped",
        kernels=kernels,
        logits_tail=1,
        valid_b=io["active"],  # an idle row of the bucket writes no state and is routed to no expert
    )
    pen = {}
    if counts is not None:  # the input token is the row's latest output token: count it first
        counts = counts.at[io["slots"], io["tokens"]].add(io["active"])
        pen = dict(counts_bv=counts[io["slots"]], presence_b=io["presence"], frequency_b=io["frequency"])
    # the chosen token sits at position lengths + 1 (the input token is at lengths)
    new = sample_tokens(
        logits[:, -1],
        io["temperature"],
        io["top_p"],
        io["seed"],
        io["lengths"] + 1,
        greedy=greedy,
        top_k_b=io["top_k"],
        min_p_b=io["min_p"],
        **pen,
    )
    lp = token_logprobs(logits[:, -1], new) if logprobs else None
    active = io["active"] > 0
    io = dict(io, tokens=jnp.where(active, new, io["tokens"]), lengths=io["lengths"] + io["active"])
    return model.pools_of(view), io, counts, lp


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "greedy"), donate_argnames=("pools", "io"))
def decode_program(params, pools, io, *, cfg: ModelConfig, kernels: str, greedy: bool):
    """One decode token for every row of `io` (`DecodeIO`): the model over the pools, sampling on the
    device.  Returns (pools, io) updated in place: io["tokens"] the sampled tokens, io["lengths"]
    advanced by io["active"]."""
    return _decode_body(params, pools, io, cfg=cfg, kernels=kernels, greedy=greedy)[:2]


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "greedy"), donate_argnames=("pools", "io", "counts"))
def decode_program_ext(params, pools, io, counts, *, cfg: ModelConfig, kernels: str, greedy: bool):
    """`decode_program` with the penalties' per-slot output counts (int32 [slots + 1, V], donated;
    rows without penalties have zero coefficients) and the chosen tokens' logprobs
    (`serving.sampling.token_logprobs`): one variant for penalties, logprobs or both, so a
    server's first such request compiles at most once per bucket and greedy flag.
    Returns (pools, io, counts, (chosen f32 [B], top ids int32 [B, K], top logprobs f32 [B, K]))."""
    return _decode_body(params, pools, io, counts, cfg=cfg, kernels=kernels, greedy=greedy, logprobs=True)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "greedy", "n_steps"), donate_argnames=("pools", "io"))
def multi_decode_program(
    params, pools, io, stop_at_eos_b, eos_id, *, cfg: ModelConfig, kernels: str, greedy: bool, n_steps: int
):
    """`n_steps` decode steps in one program (a decode-only phase: no host between steps).

    The caller has extended every active row's pages for n_steps more tokens and none may reach
    its max_new_tokens before the last step.  A row with stop_at_eos_b (bool [B]) that samples
    `eos_id` stops there: its later tokens are -1 and its length no longer advances (io["active"]
    drops to 0 for it).  Returns (pools, io, tokens int32 [B, n_steps]); row b's tokens equal n_steps
    calls of `decode_program` that stop at its EOS."""

    def step(i, carry):
        pools, io, out = carry
        was_active = io["active"] > 0
        pools, io, _, _ = _decode_body(params, pools, io, cfg=cfg, kernels=kernels, greedy=greedy)
        out = out.at[:, i].set(jnp.where(was_active, io["tokens"], -1))
        ended = was_active & stop_at_eos_b & (io["tokens"] == eos_id)
        return pools, dict(io, active=jnp.where(ended, 0, io["active"])), out

    out = jnp.full((io["tokens"].shape[0], n_steps), -1, jnp.int32)
    return jax.lax.fori_loop(0, n_steps, step, (pools, io, out))


@functools.partial(jax.jit, donate_argnames=("io",))
def _overwrite(io, values):
    """io with the entries in `values` (a subset of its keys, same shapes) replaced; every output
    aliases the donated io, so the buffers stay where the decode program's graph expects them."""
    return dict(io, **{k: jnp.asarray(v, io[k].dtype) for k, v in values.items()})


def refresh_rows(io, held: dict | None, values: dict, keys, place=lambda v: v):
    """io (device buffers, donated) with the entries `keys` of `values` written in, as one group,
    where any of them differs from `held` (what the host knows io holds; None, or None entries:
    unknown).  A whole group, not the entries that differ: one write program per group and
    bucket, warmed up, instead of one per subset compiled while serving.  place: puts the values
    on the device first.  Returns (io, whether it wrote)."""
    if held is not None and all(held.get(k) is not None and np.array_equal(values[k], held[k]) for k in keys):
        return io, False
    return _overwrite(io, place({k: values[k] for k in keys})), True


@jax.jit
def _read_tokens(io):
    return io["tokens"] + 0  # a copy, so the buffer can be donated to the next step while it is read


@functools.partial(jax.jit, donate_argnames=("counts",))
def _write_counts(counts, slot, row):
    return counts.at[slot].set(row)


def decode_logprobs(rows: "DecodeRows", lp) -> list[TokenLogprobs | None]:
    """Per request row of `rows`, its tokens' `TokenLogprobs` from a step's device output (None for
    a row that asked for none)."""
    chosen, ids, lps = (np.asarray(a) for a in lp)
    return [
        None if k is None else TokenLogprobs.from_arrays(chosen[i], ids[i], lps[i], k)
        for i, k in enumerate(rows.logprobs)
    ]


class DecodeRunner:
    """The decode steps of one engine: a `DecodeIO` per bucket, kept on the device between steps.

    ``pools, tokens, id, logprobs = runner.dispatch(params, pools, rows)`` enqueues `decode_program` on `rows`
    (`DecodeRows`), writing into the bucket's buffers, when any entry differs from what they
    hold (the previous step advanced them on the device), the whole group of entries.  ``tokens_on_device=True``
    chains a step on the previous one's sampled tokens before the host has read them (async
    scheduling: `rows.tokens` is ignored); ``settle`` then records them once read."""

    def __init__(self, cfg: ModelConfig, kernels: str, num_slots: int | None = None):
        """num_slots: the KDA slots (the penalties' counts have a row per slot and the scratch slot)."""
        self.cfg, self.kernels, self.num_slots = cfg, kernels, num_slots
        self._counts = None  # int32 [num_slots + 1, V] on the device, made at the first penalized step
        self._counted: dict[int, tuple] = {}  # slot -> (owner, output tokens its row counts)
        self.count_writes = 0  # count rows written from the host (a slot's first penalized step)
        self._io: dict[int, dict] = {}
        # what each bucket's buffers hold, as the host knows it (tokens None: not read yet)
        self._holds: dict[int, DecodeRows | None] = {}
        self._dispatched = 0
        self._last: dict[int, int] = {}  # bucket -> id of its latest dispatch
        self.overwrites = 0  # steps whose rows had to be (partly) written into the buffers

    def _buffers(self, rows: DecodeRows, tokens_on_device: bool) -> dict:
        bucket = len(rows.tokens)
        io, held = self._io.pop(bucket, None), self._holds.get(bucket)
        if tokens_on_device and (io is None or held is None):
            raise RuntimeError(f"no earlier step of bucket {bucket} to chain on")
        if io is None:
            self.overwrites += 1
            return jax.device_put(rows.as_dict())
        keys = IO_KEYS[1:] if tokens_on_device else IO_KEYS
        io, wrote = refresh_rows(io, None if held is None else held.as_dict(), rows.as_dict(), keys)
        self.overwrites += wrote
        return io

    def warm_overwrites(self, rows: DecodeRows) -> None:
        """Compile (and run) the two writes `_buffers` makes into a bucket's buffers, every entry
        and every entry but the tokens, leaving them holding `rows` (after a dispatch of its bucket)."""
        bucket = len(rows.tokens)
        io = _overwrite(self._io.pop(bucket), {k: getattr(rows, k) for k in IO_KEYS[1:]})
        self._io[bucket] = _overwrite(io, rows.as_dict())
        self._holds[bucket] = rows
        jax.block_until_ready(self._io[bucket])

    def _sync_counts(self, rows: DecodeRows, histories) -> None:
        """Make the penalties' count row of each request row's slot hold its output before the
        step's input token: histories[i] = (owner, how many, a function returning those tokens),
        `owner` any object identifying the request (its record), or None (or missing) for a row
        without penalties.  A row already holding them (the owner's earlier steps counted them) is
        left as it is, and the tokens are not asked for; the rows of other slots of the batch lose
        their record (the step adds its input token to them too)."""
        if self.num_slots is None:
            raise ValueError("penalties and logprobs need the runner's num_slots")
        if self._counts is None:
            self._counts = jnp.zeros((self.num_slots + 1, self.cfg.vocab_size), jnp.int32)
            self._counted = {}
        for i, slot in enumerate(rows.slots[: len(rows.logprobs)].tolist()):
            entry = histories[i] if i < len(histories) else None
            if entry is None:
                self._counted.pop(slot, None)
                continue
            owner, n, tokens = entry
            held = self._counted.get(slot)
            if held is None or held[0] is not owner or held[1] != n:
                self._counts = _write_counts(
                    self._counts, jnp.int32(slot), output_counts(tokens(), self.cfg.vocab_size)
                )
                self.count_writes += 1
            self._counted[slot] = (owner, n + 1)  # what the row holds after the step

    def dispatch(self, params, pools, rows: DecodeRows, *, tokens_on_device: bool = False, histories=None):
        """Enqueue a step; returns (pools, tokens on the device [bucket], dispatch id, logprobs or None)
        without waiting.  Rows with penalties need `histories` (`_sync_counts`); rows with logprobs
        get them as the device's (chosen, top ids, top logprobs) (`decode_logprobs`)."""
        bucket = len(rows.tokens)
        io = self._buffers(rows, tokens_on_device)
        lp = None
        if rows.penalized or rows.wants_logprobs:
            if rows.penalized and histories is None:
                raise ValueError("rows with penalties need their outputs so far (histories)")
            self._sync_counts(rows, histories or [])
            counts, self._counts = self._counts, None
            pools, io, self._counts, lp = decode_program_ext(
                params, pools, io, counts, cfg=self.cfg, kernels=self.kernels, greedy=rows.greedy
            )
        else:
            pools, io = decode_program(params, pools, io, cfg=self.cfg, kernels=self.kernels, greedy=rows.greedy)
        self._io[bucket] = io
        self._holds[bucket] = dataclasses.replace(
            rows, tokens=None, lengths=(rows.lengths + rows.active).astype(np.int32)
        )
        self._dispatched += 1
        self._last[bucket] = self._dispatched
        return pools, _read_tokens(io), self._dispatched, lp

    def dispatch_multi(self, params, pools, rows: DecodeRows, n_steps: int, stop_at_eos, eos_id: int):
        """`multi_decode_program` over `rows` (written into the bucket's buffers as `dispatch` does,
        tokens from the host); returns (pools, tokens on the device [bucket, n_steps]).  The
        buffers' contents are unknown to the host afterwards (rows may have stopped at EOS): the
        next dispatch writes them whole."""
        if rows.penalized or rows.wants_logprobs:
            raise ValueError("multi-step decode takes rows without penalties or logprobs")
        bucket = len(rows.tokens)
        io = self._buffers(rows, False)
        pools, io, tokens = multi_decode_program(
            params,
            pools,
            io,
            jnp.asarray(stop_at_eos, bool),
            jnp.int32(eos_id),
            cfg=self.cfg,
            kernels=self.kernels,
            greedy=rows.greedy,
            n_steps=n_steps,
        )
        self._io[bucket], self._holds[bucket] = io, None
        self._dispatched += 1
        self._last[bucket] = self._dispatched
        return pools, tokens

    def settle(self, rows: DecodeRows, tokens: np.ndarray, dispatch_id: int) -> None:
        """The tokens of dispatch `dispatch_id` over `rows`, read: what its bucket's buffers hold,
        unless a later step was chained on them since."""
        bucket = len(rows.tokens)
        if self._last.get(bucket) == dispatch_id:
            self._holds[bucket] = rows.advanced(tokens)

    def programs(self) -> int:
        # _overwrite is shared with the speculative rounds' rows (`serving.spec_decode`)
        return (
            decode_program._cache_size()
            + decode_program_ext._cache_size()
            + multi_decode_program._cache_size()
            + _overwrite._cache_size()
            + _write_counts._cache_size()
        )

    def lower(self, params, pools, rows: DecodeRows):
        """Lower (ahead of time) the program for `rows`' bucket (`.compile()` it next); it neither
        runs nor donates."""
        return decode_program.lower(
            params, pools, rows.as_dict(), cfg=self.cfg, kernels=self.kernels, greedy=rows.greedy
        )
