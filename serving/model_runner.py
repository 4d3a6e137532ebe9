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
       "temperature": f32 [B], "top_p": f32 [B], "seed": uint32 [B, 2]   sampling per row}

The step samples on the device (`serving.sampling.sample_tokens`) and writes the tokens
into `io["tokens"]` and `lengths + active` into `io["lengths"]`: the next step's inputs,
with no host round trip.  When the host's rows differ from what the buffers already hold
(a new page in a table, a request joining or leaving), `_overwrite` writes the new values
into the same buffers (donated, aliased).  The tokens reach the host through `_read_tokens`,
a copy in its own small program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import model
from kimik3.config import ModelConfig
from serving.sampling import SamplingParams, sample_tokens, seed_words

IO_KEYS = ("tokens", "lengths", "tables", "slots", "active", "temperature", "top_p", "seed")


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

    @classmethod
    def build(cls, bucket: int, tokens, tables, slots, lengths, sampling: list[SamplingParams], *,
              max_pages: int, null_page: int, scratch_slot: int) -> "DecodeRows":
        n, pad = len(tokens), bucket - len(tokens)
        table = np.full((bucket, max_pages), null_page, np.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        as_i32 = lambda xs, fill: np.asarray(list(xs) + [fill] * pad, np.int32)
        return cls(tokens=as_i32(tokens, 0), lengths=as_i32(lengths, 0), tables=table,
                   slots=as_i32(slots, scratch_slot), active=as_i32([1] * n, 0),
                   temperature=np.asarray([s.temperature for s in sampling] + [0.0] * pad, np.float32),
                   top_p=np.asarray([s.top_p for s in sampling] + [1.0] * pad, np.float32),
                   seed=np.asarray([seed_words(s.seed) for s in sampling] + [(0, 0)] * pad, np.uint32))

    @property
    def greedy(self) -> bool:
        return not bool(np.any(self.temperature > 0))

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in IO_KEYS}

    def same_as(self, other: "DecodeRows | None") -> bool:
        return other is not None and all(np.array_equal(getattr(self, k), getattr(other, k)) for k in IO_KEYS)

    def advanced(self, new_tokens: np.ndarray) -> "DecodeRows":
        """What the buffers hold after a step that sampled `new_tokens`."""
        return dataclasses.replace(self, tokens=np.where(self.active > 0, new_tokens, self.tokens).astype(np.int32),
                                   lengths=(self.lengths + self.active).astype(np.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "greedy"), donate_argnames=("pools", "io"))
def decode_program(params, pools, io, *, cfg: ModelConfig, kernels: str, greedy: bool):
    """One decode token for every row of `io` (`DecodeIO`): the model over the pools, sampling on the
    device.  Returns (pools, io) updated in place: io["tokens"] the sampled tokens, io["lengths"]
    advanced by io["active"]."""
    view = model.paged_view(pools, io["tables"], io["slots"], io["lengths"])
    logits, view = model._forward_impl(params, io["tokens"][:, None], io["lengths"][:, None], view, None, cfg=cfg,
                                       expert_path="grouped", kernels=kernels, logits_tail=1)
    # the chosen token sits at position lengths + 1 (the input token is at lengths)
    new = sample_tokens(logits[:, -1], io["temperature"], io["top_p"], io["seed"], io["lengths"] + 1, greedy=greedy)
    active = io["active"] > 0
    io = dict(io, tokens=jnp.where(active, new, io["tokens"]), lengths=io["lengths"] + io["active"])
    return {"layers": view["layers"]}, io


@functools.partial(jax.jit, donate_argnames=("io",))
def _overwrite(io, values):
    """io with the entries in `values` (a subset of its keys, same shapes) replaced; every output
    aliases the donated io, so the buffers stay where the decode program's graph expects them."""
    return dict(io, **{k: jnp.asarray(v, io[k].dtype) for k, v in values.items()})


@jax.jit
def _read_tokens(io):
    return io["tokens"] + 0  # a copy, so the buffer can be donated to the next step while it is read


class DecodeRunner:
    """The decode steps of one engine: a `DecodeIO` per bucket, kept on the device between steps.

    ``pools, tokens = runner.dispatch(params, pools, rows)`` enqueues `decode_program` on `rows`
    (`DecodeRows`), writing into the bucket's buffers only the entries that differ from what
    they hold (the previous step advanced them on the device).  ``tokens_on_device=True``
    chains a step on the previous one's sampled tokens before the host has read them (async
    scheduling: `rows.tokens` is ignored); ``settle`` then records them once read."""

    def __init__(self, cfg: ModelConfig, kernels: str):
        self.cfg, self.kernels = cfg, kernels
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
        changed = {k: getattr(rows, k) for k in keys
                   if held is None or getattr(held, k) is None or not np.array_equal(getattr(rows, k), getattr(held, k))}
        if changed:
            self.overwrites += 1
            io = _overwrite(io, changed)
        return io

    def dispatch(self, params, pools, rows: DecodeRows, *, tokens_on_device: bool = False):
        """Enqueue a step; returns (pools, tokens on the device [bucket], dispatch id) without waiting."""
        bucket = len(rows.tokens)
        io = self._buffers(rows, tokens_on_device)
        pools, io = decode_program(params, pools, io, cfg=self.cfg, kernels=self.kernels, greedy=rows.greedy)
        self._io[bucket] = io
        self._holds[bucket] = dataclasses.replace(rows, tokens=None, lengths=(rows.lengths + rows.active)
                                                  .astype(np.int32))
        self._dispatched += 1
        self._last[bucket] = self._dispatched
        return pools, _read_tokens(io), self._dispatched

    def settle(self, rows: DecodeRows, tokens: np.ndarray, dispatch_id: int) -> None:
        """The tokens of dispatch `dispatch_id` over `rows`, read: what its bucket's buffers hold,
        unless a later step was chained on them since."""
        bucket = len(rows.tokens)
        if self._last.get(bucket) == dispatch_id:
            self._holds[bucket] = rows.advanced(tokens)

    def programs(self) -> int:
        return decode_program._cache_size()

    def compile(self, params, pools, rows: DecodeRows):
        """Compile (ahead of time) the program for `rows`' bucket; it neither runs nor donates."""
        return decode_program.lower(params, pools, rows.as_dict(), cfg=self.cfg, kernels=self.kernels,
                                    greedy=rows.greedy).compile()
