"""The model runner: every jitted program an engine runs (prefill chunks padded to a few lengths,
the decode program on persistent buffers (`serving.decode_runner`), the sharded steps on meshes)
and the warm-up that compiles them."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import fused, model, ops, stacked
from kimik3.quant import formats as qformats
from kimik3.config import ModelConfig

from serving.decode_runner import DecodeRows, DecodeRunner

log = logging.getLogger(__name__)


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
        from sharding.decode import PagedDecode  # sharding loads only where a mesh is given
        from sharding.paged import PagedStep  # sharding loads only where a mesh is given

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
        from sharding.paged import helper_programs  # sharding loads only where a mesh is given

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
        from sharding import rank_pools  # sharding loads only where a mesh is given

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
