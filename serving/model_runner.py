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

from kimik3 import fused, model, ops, stacked
from kimik3.quant import formats as qformats
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


def prefill_buckets(limit: int, smallest: int = 64) -> list[int]:
    """The lengths unsharded prefill chunks of at most `limit` tokens are padded to: `smallest`
    (one KDA chunk: shorter spans cost it anyway) times powers of 4, and `limit` itself.  Each
    is a whole-model compile and one call per chunk; padding wastes at most 3/4 of a chunk's
    tokens (256-token chunks: 2 programs, where exact power-of-two pieces took 9 programs and up
    to 8 calls per chunk)."""
    out = [min(smallest, limit)]
    while out[-1] < limit:
        out.append(min(out[-1] * 4, limit))
    return out


def _available_bytes() -> int | None:
    """MemAvailable of this host (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def compile_threads(
    jobs: int, *, cpu_count: int | None = None, available_bytes: int | None = -1, bytes_per_compile: int | None = None
) -> int:
    """Threads for a warm-up's concurrent compiles: at most one per job, half the cores, and no more
    than the host's available memory holds at `bytes_per_compile` each ($KIMIK3_COMPILE_GIB, default
    1.5 GiB: whole-model compiles of `small` on 8 threads peaked at 12.4 GiB of host RSS).
    available_bytes: -1 reads the host's; None: no memory bound."""
    import os

    cpus = cpu_count or os.cpu_count() or 2
    n = max(1, min(jobs, cpus // 2))
    if available_bytes == -1:
        available_bytes = _available_bytes()
    if bytes_per_compile is None:
        bytes_per_compile = int(float(os.environ.get("KIMIK3_COMPILE_GIB", "1.5")) * (1 << 30))
    if available_bytes is not None and bytes_per_compile > 0:
        n = min(n, max(1, available_bytes // bytes_per_compile))
    return n


SCAN_CHOICES = ("prefill", "all", "none")  # which unsharded programs scan the periods (`kimik3.stacked`)


# each row's argmax at its last position, where the rows are (a decode mesh's step: split over ranks)
_greedy_last = jax.jit(lambda logits_btv: jnp.argmax(logits_btv[:, -1], axis=-1).astype(jnp.int32))


class ModelRunner:
    """Every jitted program one engine runs, and the shapes it runs them at.

    * prefill chunks: `kimik3.model.paged_step` (pools donated) padded to a few lengths
      (`prefill_buckets`), or the prefill mesh's sharded step (`sharding.paged.PagedStep`) at
      tp * 2^k, exact;
    * decode: `decode_program` on persistent buffers (`DecodeRunner`), or the decode mesh's
      step over the ranks' own pools (`sharding.decode.PagedDecode`, `decode_ranks`), at
      power-of-two buckets of at least `MIN_DECODE_BUCKET` rows (per rank on a mesh);
    * `warmup`: compiles all of them ahead of time, concurrently.

    The pools live in a `serving.kv_pools.KVPools` (one per rank on a decode mesh, each on its
    rank's device); every call threads `kv.pools` through.  Unsharded chunks run where their
    pools are, on a copy of the params placed there once (`params_on`)."""

    def __init__(
        self,
        params,
        cfg: ModelConfig,
        *,
        kernels: str,
        role: str,
        mesh,
        dispatch: str,
        num_slots: int,
        page_tokens: int,
        prefill_chunk_tokens: int,
        max_step_tokens: int,
        export_slots: int,
        scan_layers: str = "prefill",
        taps: tuple[int, ...] = (),
        prefill_batch: int = 1,
    ):
        """taps: layers whose residual stream the unsharded prefill chunks return too (an EAGLE-3
        draft's input, `serving.spec_decode`, whose rounds then replace the decode program)."""
        self.cfg, self.kernels, self.role, self.num_slots, self.taps = cfg, kernels, role, num_slots, tuple(taps)
        self.prefill_chunk_tokens, self.export_slots = prefill_chunk_tokens, export_slots
        self.prefill_batch = prefill_batch  # requests per sharded prefill call, at most (powers of two)
        if mesh is not None and qformats.tree_formats(params):
            raise ValueError(
                f"sharded steps take unquantized params; these hold {qformats.tree_formats(params)} "
                f"weights (a quantized manifest serves unsharded engines)"
            )
        if mesh is not None and (fused.is_fused(params) or stacked.is_stacked(params)):
            raise ValueError(
                "sharded steps take the checkpoint layout of the params, not kimik3.fused's or kimik3.stacked's"
            )
        self.prefill_step, self.decode_step = self._mesh_steps(mesh, dispatch, num_slots, page_tokens, max_step_tokens)
        self.mesh_params = {s.mode: s.place_params(params) for s in (self.prefill_step, self.decode_step) if s}
        # The unsharded programs read the serving layout: one GEMM per shared input (`kimik3.fused`).
        # scan_layers "prefill": decode programs read the layers unrolled (inside a scan each
        # period's weights are sliced out of the stack by a copy, every expert's too, which cost a
        # weight-bound B32 step +1.3 ms on the H200), prefill programs a second copy with the
        # periods stacked (`kimik3.stacked`: a compute-bound chunk hides the slice copies, and each
        # prefill shape compiles about half the blocks).  "all": one stacked copy for both.
        if scan_layers not in SCAN_CHOICES:
            raise ValueError(f"scan_layers must be one of {SCAN_CHOICES}; got {scan_layers!r}")
        # MXFP4 experts move into the Hopper kernel's layout once, here, where `KIMIK3_MOE_MXFP4`
        # names that kernel (`ops.hopper_mxfp4_experts`; the prefill copy stacks the moved ones)
        self.params = (
            params
            if mesh is not None
            else ops.hopper_mxfp4_experts(stacked.serving_layout(params, cfg, scan=scan_layers == "all"), cfg.dtype)
        )
        self.prefill_params = (
            stacked.stack_periods(self.params, cfg) if scan_layers != "none" and mesh is None else self.params
        )
        self.decode = DecodeRunner(cfg, kernels, num_slots)
        self._placed = {}  # device -> the unsharded prefill params there (`params_on`)

    def _mesh_steps(self, mesh, dispatch, num_slots, page_tokens, max_step_tokens):
        """(prefill step, decode step) from the `mesh` argument; ValueError for one that does not fit."""
        from sharding.decode import PagedDecode
        from sharding.paged import PagedStep

        if mesh is None:
            return None, None
        if self.role == "both":
            if not (isinstance(mesh, (tuple, list)) and len(mesh) == 2):
                raise ValueError(
                    "role 'both' takes mesh=(prefill_mesh, decode_mesh) (either may be None); "
                    f"got {type(mesh).__name__}"
                )
            pm, dm = mesh
        elif isinstance(mesh, (tuple, list)):
            raise ValueError(f"role {self.role!r} takes one mesh (its {self.role} mesh), not a pair")
        else:
            pm, dm = (mesh, None) if self.role == "prefill" else (None, mesh)
        pre = None if pm is None else PagedStep(self.cfg, pm, "prefill", dispatch=dispatch, kernels=self.kernels)
        dec = None if dm is None else PagedDecode(self.cfg, dm, dispatch=dispatch, kernels=self.kernels)
        if dec is not None and num_slots % dec.size:
            raise ValueError(
                f"num_slots ({num_slots}) must split evenly over dp={dec.size} (each rank owns "
                f"its requests' slots and pages)"
            )
        if pre is not None:
            tp = pre.size
            if page_tokens % tp:
                raise ValueError(
                    f"tp={tp} must divide page_tokens={page_tokens} (prefix hits and KDA "
                    f"snapshot boundaries are page multiples; sharded chunks are tp multiples)"
                )
            if self.prefill_chunk_tokens < tp:
                raise ValueError(f"prefill_chunk_tokens={self.prefill_chunk_tokens} is below tp={tp}")
            if max_step_tokens - num_slots < tp:
                raise ValueError(
                    f"max_step_tokens ({max_step_tokens}) must leave tp={tp} prefill tokens "
                    f"beside a decode row for each of the {num_slots} slots"
                )
        for s in (pre, dec):
            if s is not None:
                log.info(
                    "engine (%s): %s steps on %s=%d ep=%d over devices %s",
                    self.role,
                    s.mode,
                    s.shape.group_axis,
                    s.size,
                    s.shape.ep,
                    [d.id for d in s.mesh.devices.flat],
                )
        return pre, dec

    # ---- shapes ------------------------------------------------------------------------------------
    def step_static(self) -> dict:
        """The unsharded prefill step's static arguments (warm-up compiles exactly these): logits
        for the last position only, which is all a step samples from."""
        return dict(
            cfg=self.cfg,
            expert_path="grouped",
            kernels=self.kernels,
            logits_tail=1,
            **({"taps": self.taps} if self.taps else {}),
        )

    def export_at(self, chunk_tokens: int, offsets=()) -> list[int] | None:
        """The export positions an unsharded prefill chunk of `chunk_tokens` (its compiled
        length) passes (`offsets` padded with -1 to `export_slots`), or None for chunks shorter
        than one KDA chunk (those never export)."""
        if chunk_tokens < self.cfg.kda_chunk_size:
            return None
        return list(offsets) + [-1] * (self.export_slots - len(offsets))

    def chunk_args(self, chunk_tokens: int, rows: int, real: int, offsets=()) -> dict:
        """The traced arguments beside the view of an unsharded prefill chunk's
        `kimik3.model.paged_step` (warm-up compiles exactly these): export_at int32
        [export_slots] (`export_at`) or None, and valid_b int32 [rows], `real` tokens in each of
        the chunk's rows.  Host arrays: a jax array or a list would key another program."""
        at = self.export_at(chunk_tokens, offsets)
        return dict(export_at=None if at is None else np.asarray(at, np.int32), valid_b=np.full(rows, real, np.int32))

    def prefill_lengths(self) -> list[tuple[int, object]]:
        """Every prefill chunk length this engine compiles, with the step that runs it (None: the
        unsharded model, padded up to the length: `prefill_buckets`; a mesh: tp * 2^k, exact)."""
        c, pre = self.prefill_chunk_tokens, self.prefill_step
        if pre is None:
            return [(t, None) for t in prefill_buckets(c)]
        tp = pre.size
        return [(t, None) for t in (prefill_buckets(tp - 1) if tp > 1 else [])] + [
            (tp << i, pre) for i in range((c // tp).bit_length())
        ]

    def prefill_bucket(self, n: int) -> int:
        """The compiled length an unsharded chunk of n tokens runs at (padded)."""
        return next(t for t, step in self.prefill_lengths() if step is None and t >= n)

    # Decode batches below this many rows run at it (or at the slots' power of two, if fewer): a
    # decode step reads its weights whatever its rows, so padding rows cost little (their MoE
    # rows may read a few more experts), and each bucket is a whole-model compile.
    MIN_DECODE_BUCKET = 8

    def decode_bucket(self, n: int) -> int:
        """Rows of a decode batch of n requests: the next power of two, at least MIN_DECODE_BUCKET
        (or the slots' power of two).  On a decode mesh n is the most requests one rank holds:
        every rank runs that many rows (its floor is the slots' floor over dp), so the batch is
        dp times it (`rank_rows`)."""
        floor = min(self.MIN_DECODE_BUCKET, 1 << (self.num_slots - 1).bit_length())
        if self.decode_step is None:
            return max(floor, 1 << (n - 1).bit_length())
        return self.decode_step.size * self.rank_rows(n)

    def rank_rows(self, n: int) -> int:
        """Rows per rank of a decode-mesh batch whose fullest rank holds n requests."""
        floor = min(self.MIN_DECODE_BUCKET, 1 << (self.num_slots - 1).bit_length())
        return max(1, floor // self.decode_step.size, 1 << (n - 1).bit_length())

    def params_on(self, device):
        """The unsharded prefill params on `device` (placed there at the first chunk a rank on it
        runs: a DP engine's ranks prefill on their own devices, where their pools are)."""
        leaf = jax.tree_util.tree_leaves(self.prefill_params)[0]
        committed = isinstance(leaf, jax.Array) and leaf.committed
        home = next(iter(leaf.devices())) if committed else jax.devices()[0]  # uncommitted: follows the pools
        if device == home:
            return self.prefill_params
        if device not in self._placed:
            self._placed[device] = jax.device_put(self.prefill_params, device)
        return self._placed[device]

    def programs(self) -> int:
        """Compiled step programs so far (the unsharded model, the decode program, the sharded steps)."""
        from sharding.paged import helper_programs

        steps = [s for s in (self.prefill_step, self.decode_step) if s]
        return (
            model.forward_step_jit._cache_size()
            + model.paged_step._cache_size()
            + sum(s.programs() for s in steps)
            + (helper_programs() if steps else 0)
            + self.decode.programs()
        )

    # ---- calls -------------------------------------------------------------------------------------
    def forward(self, kv, tokens, tables, slots, lengths, *, step=None, images=None, export_offsets=None):
        """Run [B, T] tokens on rows (tables [B, max_pages], slots [B], lengths [B]) over `kv`'s pools;
        returns the last token's logits [B, 1, V] on the device (not waited for: a caller reads
        only the logits it needs, so the host goes on while the device computes the others) and, for the unsharded model, the KDA
        exports at `export_offsets` (token counts of this call: per KDA layer a
        `kimik3.caches.KDAState` [B, E, ...], `kimik3.model.forward_paged`) or None;
        with `taps` (the unsharded model only) a third output, the residual stream after each of
        them [B, T_padded, len(taps), D] on the device.
        step: `prefill_step` or `decode_step` (a mesh, exact lengths), or None (the unsharded
        model, padded to `prefill_bucket(T)`)."""
        # Inputs were checked at submit; generated ids (a random model may emit <|image|>) are
        # not prompts, so the steps call the jitted cores directly.
        if step is not None:
            if self.taps:
                raise ValueError("taps are not available from a sharded step")
            logits, kv.pools = step(self.mesh_params[step.mode], kv.pools, tokens, tables, slots, lengths)
            return logits[:, -1:], None
        b, n = tokens.shape
        bucket = self.prefill_bucket(n)  # padded: a few compiled lengths serve every chunk
        tokens = np.pad(np.asarray(tokens, np.int32), ((0, 0), (0, bucket - n)))
        view = model.paged_view(kv.pools, tables, slots, lengths)
        positions = view["lengths"][:, None] + np.arange(bucket, dtype=np.int32)[None]  # host: no eager op
        # uncommitted inputs follow the pools to their device; the params are placed there once
        device = next(iter(jax.tree_util.tree_leaves(kv.pools)[0].devices()))
        params = self.params_on(device)
        if images is not None and params is not self.prefill_params:  # a DP rank's chunk: its ViT rows too
            images = jax.device_put(images, device)
        chunk = self.chunk_args(bucket, b, n, export_offsets or ())
        logits, view, exports, *tapped = model.paged_step(
            params, tokens, positions, view, images, **chunk, **self.step_static()
        )
        kv.pools = model.pools_of(view)
        return (logits, exports, *tapped)

    def decode_ranks(self, kvs, tokens, tables, slots, lengths, *, logits: bool = True):
        """One decode-mesh step over this process's ranks' pools (`kvs` in rank order; rows
        r*b .. r*b + b - 1 of the arrays are its r-th rank's, with ids in that rank's pools):
        (each of those rows' greedy token int32 [len(kvs) * b], taken on the devices; with
        `logits`, their last token's logits f32 [len(kvs) * b, V], else None), as numpy.  Only
        the tokens leave the devices unless a row needs its logits (sampling, penalties,
        logprobs).  The ranks' pools are viewed as one array for the step and handed back written
        in place (`sharding.rank_pools`: nothing moves between devices).  In a process group
        every process calls this at once."""
        from sharding import rank_pools

        step, mesh = self.decode_step, self.decode_step.mesh
        pools = rank_pools.assemble([kv.pools for kv in kvs], mesh)
        for kv in kvs:
            kv.pools = None  # donated to the step
        rows = [rank_pools.rows_in(np.asarray(x, np.int32), mesh) for x in (tokens, tables, slots, lengths)]
        out, pools = step.run(self.mesh_params["decode"], pools, *rows)
        for kv, own in zip(kvs, rank_pools.split(pools, mesh)):
            kv.pools = own
        greedy = rank_pools.rows_out(_greedy_last(out), mesh)
        return greedy, rank_pools.rows_out(out, mesh)[:, -1].astype(np.float32) if logits else None

    def warmup(self, kvs, *, max_pages: int, null_page: int, threads: int | None = None, sampled: bool = False) -> int:
        """Compile every step shape (`prefill_lengths`; decode buckets for 1 .. num_slots requests,
        per rank on a decode mesh) and run each once on scratch rows (the scratch slot and null
        pages; a chunk's exports are snapshotted into the null snapshot block, so that program is
        not compiled while serving either).  kvs: the pools (a `KVPools`, or one per rank: each
        rank's prefill shapes compile for its device).

        threads: unsharded shapes compile ahead of time concurrently on this many threads
        (default `compile_threads`: one per shape, at most half the CPU cores, bounded by the
        host's available memory): XLA's compile of a whole-model
        step is mostly single-threaded, so the ~20 shapes of a serving engine take minutes one
        by one.  The runs that follow (one by one: each donates the pools) then find their
        executables compiled.  The decode program compiles in its greedy variant, and with
        `sampled` in its sampling one too (an OpenAI client's default temperature is 1: a server
        warms both; else a batch with a sampled row compiles it on first use).  Returns the number
        of new programs."""
        import concurrent.futures

        before = self.programs()
        kvs = list(kvs) if isinstance(kvs, (list, tuple)) else [kvs]
        kv = kvs[0]
        scratch = kv.scratch_slot
        batches = [1 << i for i in range(self.prefill_batch.bit_length()) if 1 << i <= self.prefill_batch]
        if self.prefill_batch & (self.prefill_batch - 1):  # a partial batch pads to the next power of two
            batches.append(1 << self.prefill_batch.bit_length())
        shapes = [(b, t, step) for t, step in self.prefill_lengths() for b in (batches if step is not None else [1])]
        buckets = sorted({self.decode_bucket(n) for n in range(1, scratch + 1)})

        def rows(b):
            return [[null_page] * max_pages] * b, [scratch] * b, [0] * b

        def step_args(kv, shape):
            b, t = shape
            view = model.paged_view(kv.pools, *rows(b))
            # host arrays, as `forward` passes them (a jax array there would key another program)
            positions = np.tile(np.arange(t, dtype=np.int32)[None], (b, 1))
            params = self.params_on(next(iter(jax.tree_util.tree_leaves(kv.pools)[0].devices())))
            return params, np.zeros((b, t), np.int32), positions, view, None

        def step_kwargs(shape):  # `forward`'s keyword arguments, the traced and the static ones
            b, t = shape
            return dict(self.chunk_args(t, b, t), **self.step_static())

        def decode_rows(b, sampling: bool = False):  # padding only: writes land in the scratch slot and the null page
            rows = DecodeRows.build(
                b, [], [], [], [], [], max_pages=max_pages, null_page=null_page, scratch_slot=scratch
            )
            return dataclasses.replace(rows, temperature=np.ones(b, np.float32)) if sampling else rows

        variants = (False, True) if sampled else (False,)

        for b, t, step in shapes:
            for one in kvs if step is not None else ():  # writes land in the scratch slot and the null page only
                logits, one.pools = step(self.mesh_params[step.mode], one.pools, jnp.zeros((b, t), jnp.int32), *rows(b))
                jax.block_until_ready(logits)
        if self.decode_step is not None:  # every rank runs b / dp padding rows
            for b in buckets:
                for want in (False, True):  # the greedy fast path, and the logits for rows that sample
                    self.decode_ranks(kvs, np.zeros((b, 1), np.int32), *rows(b), logits=want)
        unsharded = sorted({(b, t) for b, t, step in shapes if step is None})
        decode = buckets if self.decode_step is None and not self.taps else []  # speculative rounds: their own
        # the longest chunks first: their programs' compiles are the longest, so they start first
        lowerings = [
            functools.partial(lambda one, s: model.paged_step.lower(*step_args(one, s), **step_kwargs(s)), one, s)
            for one in kvs
            for s in sorted(unsharded, key=lambda s: (-s[1], -s[0]))
        ]
        lowerings += [
            functools.partial(lambda b, v: self.decode.lower(self.params, kv.pools, decode_rows(b, v)), b, v)
            for b in decode
            for v in variants
        ]
        workers = threads or compile_threads(len(lowerings))
        # Tracing and lowering are Python, under the GIL (a Mosaic GPU kernel's lowering alone is
        # seconds: RESULTS.md, serving); XLA's compile is not.  So this thread lowers
        # the programs one after another and hands each to a compile thread at once: the compiles
        # run under the next lowerings, where lowering on the compile threads too made each wait
        # for its share of every other lowering.  Neither runs nor donates anything.
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiles = [pool.submit(lower().compile) for lower in lowerings]
            for done in compiles:
                done.result()
        for one in kvs:
            for shape in unsharded:
                logits, view, exports, *_ = model.paged_step(*step_args(one, shape), **step_kwargs(shape))
                one.pools = model.pools_of(view)
                if exports is not None:  # and the snapshot of a chunk's export, into the
                    one.save_export(exports, 0, null_page)  # null block (never handed out)
                jax.block_until_ready((logits, one.snapshots.data))
        for b in decode:
            for v in variants:
                kv.pools, tokens, _, _ = self.decode.dispatch(self.params, kv.pools, decode_rows(b, v))
                jax.block_until_ready(tokens)
            self.decode.warm_overwrites(decode_rows(b))
        return self.programs() - before
