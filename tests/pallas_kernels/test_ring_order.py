"""The Hopper kernels' shared-memory rings in order, on this CPU: Mosaic GPU's interpreter runs
each kernel while `recorded` logs every barrier arrive and wait and every shared-memory read and
write (wgmma operands, TMA copies, loads, stores), and `ring_order` checks the log.

The check, for every region of shared memory (a ring slot, a P buffer, a query tile): a fill is
read only after it was written and after a barrier the reader waited for, and a region is written
again only after every earlier read of it by another agent -- that agent released it (arrived on
a barrier the writer then waited for) after its last read.  Both are happens-before over the log:
program order within a warpgroup, an arrive before each wait that observes the phase it counts
toward, and a TMA copy as an agent of its own (it starts where its warpgroup issues it, its load
arrives on its barrier, and its store's reads of shared memory end at the warpgroup's
`wait_smem_to_gmem`).  So a violation is found however the interpreter's threads happened to
interleave, not only when it corrupted a result, and the message names the slot, the read, the
release and the write.

The interpreter reads a wgmma's operands when the wgmma issues (on the GPU they are read until
its accumulator is waited for), and it keeps a `RefUnion`'s members in buffers of their own:
both are outside what the log can show."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import linecache
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import source_info_util
from jax._src.pallas.mosaic_gpu import core as mgpu_core
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as interp_memory

_SMEM = interp_memory.IDX_BY_GPU_MEMORY_SPACE[mgpu_core.MemorySpace.SMEM]


# ---------------------------------------------------------------------------------------------
# The log


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One shared-memory allocation of the interpreter (numbered in the order first touched)."""

    number: int
    shape: tuple
    dtype: str

    def region(self, box) -> str:
        """`box` (one (lo, hi) per axis) of this buffer, named as a slot where it is one index of
        the leading axis."""
        name = f"buffer #{self.number} {list(self.shape)} {self.dtype}"
        (lo, hi), rest = box[0], box[1:]
        if len(self.shape) > 1 and hi == lo + 1:
            whole = all(r == (0, n) for r, n in zip(rest, self.shape[1:]))
            return f"slot {lo} of {name}" + ("" if whole else f" at {[list(r) for r in rest]}")
        return f"{name} at {[list(r) for r in box]}"


@dataclasses.dataclass(frozen=True)
class Tma:
    """A TMA copy as an agent of its own: "load" (global to shared memory) or "store", issued by
    warpgroup `issuer` at `where`."""

    issuer: object
    number: int
    kind: str
    where: str


@dataclasses.dataclass(frozen=True)
class Event:
    """One recorded step of one agent (a warpgroup, or a `Tma` copy): "read" / "write" of `box`
    of `target` (a Buffer); "arrive" / "wait" on `target` (a barrier), `phase` the completion (0
    the first) the arrival counts toward / the wait observed; "fork" / "join": the warpgroup
    `agent` issues the TMA copy `target` / waits for its reads (`wait_smem_to_gmem`).  `where`:
    the kernel's source line."""

    kind: str
    agent: object
    target: object
    box: tuple | None = None
    phase: int | None = None
    where: str = "?"


def _where(source_info) -> str:
    """file:line `code` of the kernel line an interpreter callback runs for."""
    if source_info is None:
        return "?"
    frame = source_info_util.user_frame(source_info.traceback)
    if frame is None:
        return "(inside JAX)"
    code = linecache.getline(frame.file_name, frame.start_line).strip()
    return f"{os.path.basename(frame.file_name)}:{frame.start_line} `{code}`"


def _box(access) -> tuple:
    """An interpreter access's range as (lo, hi) per buffer axis (a strided slice: its span)."""
    return tuple((r, r + 1) if isinstance(r, int) else (int(r.start), int(r.stop)) for r in access.range)


class Recorder:
    """The log of one `recorded` block: `events` in the order they happened.  Each shared-memory
    access and each arrive is logged together with the interpreter's own step, under one lock,
    so the log order is the order of the accesses and every arrive precedes the waits it
    releases."""

    def __init__(self):
        self.events: list[Event] = []
        self.lock = threading.RLock()
        self.local = threading.local()  # .tma: the TMA copy the interpreter thread is running, if any
        self._buffers: dict[int, tuple[object, Buffer]] = {}  # id -> (interpreter buffer, kept alive; Buffer)
        self._stores = collections.defaultdict(collections.deque)  # warpgroup -> TMA stores not waited for
        self._numbers = itertools.count()

    def agent(self, thread):
        return getattr(self.local, "tma", None) or thread

    def access(self, memory, kind, key, access, thread, logging_info):
        interp = memory.mem[key]
        entry = self._buffers.setdefault(
            id(interp), (interp, Buffer(len(self._buffers), tuple(interp.logical_shape), str(interp.dtype)))
        )
        where = _where(getattr(logging_info, "source_info", None))
        self.events.append(Event(kind, self.agent(thread), entry[1], _box(access), where=where))

    def fork(self, task) -> Tma:
        kind = "load" if isinstance(task, gpu_callbacks.AsyncCopyGmemToSmemTask) else "store"
        tma = Tma(task.thread, next(self._numbers), kind, _where(task.source_info))
        self.events.append(Event("fork", task.thread, tma, where=tma.where))
        if kind == "store":
            self._stores[task.thread].append(tma)
        return tma

    def join_stores(self, thread, keep: int):
        """`wait_smem_to_gmem(keep)`: all but the `keep` latest TMA stores of `thread` are done."""
        pending = self._stores[thread]
        while len(pending) > keep:
            self.events.append(Event("join", thread, pending.popleft()))


_active: Recorder | None = None


def _patched(cls, name, make):
    original = getattr(cls, name)
    setattr(cls, name, make(original))
    return cls, name, original


def _access_wrapper(kind, value_args):
    """A wrapper of `GPUSharedMemory.get/store/swap_buffer_content` (`value_args`: how many
    arguments come between the access and the thread) that logs each shared-memory access by a
    warpgroup or a TMA copy.  A swap is a ref store (`ref[...] = x`): logged as the write it is,
    as the interpreter's race detector takes it."""

    def make(original):
        def wrapper(self, key, access, *args, **kwargs):
            rec = _active
            thread = args[value_args] if len(args) > value_args else kwargs.get("thread")
            if rec is None or thread is None or key.memory_space_id != _SMEM:
                return original(self, key, access, *args, **kwargs)
            with rec.lock:
                result = original(self, key, access, *args, **kwargs)
                rec.access(self, kind, key, access, thread, kwargs.get("logging_info"))
                return result

        return wrapper

    return make


def _arrive(original):
    def arrive(self, thread, clock=None, logging_info=None):
        rec = _active
        if rec is None or thread is None:
            return original(self, thread, clock, logging_info)
        with rec.lock:
            where = _where(getattr(logging_info, "source_info", None))
            rec.events.append(Event("arrive", rec.agent(thread), self, phase=self.phase, where=where))
            return original(self, thread, clock, logging_info)

    return arrive


def _wait(original):
    def wait(self, thread, logging_info=None):
        result = original(self, thread, logging_info)
        rec = _active
        if rec is not None:
            with rec.lock:
                phase = self.last_observed_phase_by_thread[thread] - 1
                where = _where(getattr(logging_info, "source_info", None))
                rec.events.append(Event("wait", rec.agent(thread), self, phase=phase, where=where))
        return result

    return wait


def _tma_copy(original):
    def run(self, tma_thread_id):
        rec = _active
        if rec is None:
            return original(self, tma_thread_id)
        with rec.lock:
            rec.local.tma = rec.fork(self)
        try:
            return original(self, tma_thread_id)
        finally:
            rec.local.tma = None

    return run


def _wait_stores(original):
    def wait(self, thread, n, wait_read_only):
        result = original(self, thread, n, wait_read_only)
        rec = _active
        if rec is not None:
            with rec.lock:
                rec.join_stores(thread, n)
        return result

    return wait


@contextlib.contextmanager
def recorded():
    """Within the block every Mosaic GPU interpreter run logs into the yielded Recorder: the
    interpreter's memory, barrier and TMA classes are wrapped for the block, at run time (no
    kernel is traced again; nothing of a compiled kernel changes)."""
    global _active
    if _active is not None:
        raise RuntimeError("recorded() blocks do not nest")
    mem, bar = interp_memory.GPUSharedMemory, interp_memory.Barrier
    saved = [
        _patched(mem, "get_buffer_content", _access_wrapper("read", 0)),
        _patched(mem, "store_buffer_content", _access_wrapper("write", 1)),
        _patched(mem, "swap_buffer_content", _access_wrapper("write", 2)),
        _patched(mem, "wait_smem_to_gmem", _wait_stores),
        _patched(bar, "arrive", _arrive),
        _patched(bar, "wait", _wait),
        _patched(gpu_callbacks.AsyncCopyTask, "__call__", _tma_copy),
    ]
    _active = rec = Recorder()
    try:
        yield rec
    finally:
        _active = None
        for cls, name, original in saved:
            setattr(cls, name, original)


# ---------------------------------------------------------------------------------------------
# The check


def _overlap(a, b) -> bool:
    return all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(a, b))


def _inside(a, b) -> bool:
    """Box a within box b."""
    return all(lo2 <= lo1 and hi1 <= hi2 for (lo1, hi1), (lo2, hi2) in zip(a, b))


def _name(agent) -> str:
    if isinstance(agent, Tma):
        return f"the TMA {agent.kind} of {_name(agent.issuer)}"
    wg = f"wg{agent.warpgroup_id}" + (f".warp{agent.warp_id}" if hasattr(agent, "warp_id") else "")
    return wg if agent.block_id == 0 else f"block {agent.block_id} {wg}"


def _by(agent, where) -> str:
    """An agent and where it acted (a TMA copy: where it was issued)."""
    return f"{_name(agent)} issued at {agent.where}" if isinstance(agent, Tma) else f"{_name(agent)} at {where}"


@dataclasses.dataclass
class RingOrder:
    """What `ring_order` found: `violations` (one sentence each) and `refills`: per (buffer shape,
    the write's source line), the writes it checked against an earlier read by another agent --
    where a ring turned over."""

    violations: list[str]
    refills: collections.Counter

    def refilled(self, shape, at: str = "") -> int:
        """The refills of the buffers of `shape` (a ring's, over every CTA) by writes at a source
        line that contains `at`."""
        return sum(n for (s, where), n in self.refills.items() if s == tuple(shape) and at in where)


def ring_order(events) -> RingOrder:
    """Check a recorded log (the module's docstring): each read of a region by an agent that did
    not write it happens after the write, and each write happens after every earlier read and
    write of the region by other agents."""
    clock: dict = collections.defaultdict(collections.Counter)  # agent -> vector clock
    phase_clock: dict = collections.defaultdict(collections.Counter)  # (barrier, phase) -> clock
    arrivals = collections.defaultdict(list)  # (barrier, phase) -> [(agent, its time, event)]
    waits = collections.defaultdict(list)  # agent -> [(its time, barrier, phase)]
    live = collections.defaultdict(list)  # buffer -> [(event, its agent's time)] not yet overwritten
    violations, refills = [], collections.Counter()

    def release(reader, writer, until):
        """The reader's last arrive on a barrier phase the writer waited for before its time
        `until`: (reader's time, event), or None."""
        seen = [
            (t, e)
            for waited, bar, ph in waits[writer]
            if waited <= until
            for a, t, e in arrivals[bar, ph]
            if a == reader
        ]
        return max(seen, key=lambda te: te[0], default=None)

    for ev in events:
        me = ev.agent
        vc = clock[me]
        vc[me] += 1
        now = vc[me]
        if ev.kind == "fork":
            clock[ev.target] = collections.Counter(vc)
        elif ev.kind == "join":
            vc |= clock[ev.target]
        elif ev.kind == "arrive":
            phase_clock[id(ev.target), ev.phase] |= vc
            arrivals[id(ev.target), ev.phase].append((me, now, ev))
        elif ev.kind == "wait":
            vc |= phase_clock[id(ev.target), ev.phase]
            waits[me].append((now, id(ev.target), ev.phase))
        else:
            prior = live[ev.target]
            for old, t in prior:
                if old.agent == me or old.kind == ev.kind == "read" or not _overlap(old.box, ev.box):
                    continue
                ordered = t <= vc[old.agent]
                region = ev.target.region(ev.box)
                if old.kind == "read":  # ev a write
                    refills[ev.target.shape, ev.where] += 1
                    if ordered:
                        continue
                    rel = release(old.agent, me, now)
                    if rel is not None and rel[0] < t:
                        why = f"{_name(old.agent)} released it at {rel[1].where} before that read"
                    elif isinstance(old.agent, Tma):
                        why = f"{_name(me)} did not wait for that TMA store to finish reading it"
                    else:
                        why = f"{_name(me)} waited for no release by {_name(old.agent)} after that read"
                    violations.append(
                        f"{region} written by {_by(me, ev.where)} while the read by {_by(old.agent, old.where)} "
                        f"is not ordered before it: {why}"
                    )
                elif not ordered:
                    violations.append(
                        f"{region} {'read' if ev.kind == 'read' else 'written again'} by {_by(me, ev.where)} "
                        f"without waiting for the write by {_by(old.agent, old.where)}"
                    )
            if ev.kind == "write":  # what it covers is ordered before it: later accesses meet the write
                prior[:] = [(old, t) for old, t in prior if not _inside(old.box, ev.box)]
            prior.append((ev, now))
    return RingOrder(violations, refills)


def _assert_in_order(rec: Recorder, **rings) -> RingOrder:
    """ring_order of the recorded log: no violation, and each of `rings` (name = buffer shape, or
    (shape, a piece of its writes' source line)) refilled after reads at least once."""
    order = ring_order(rec.events)
    assert not order.violations, "\n".join(order.violations[:5])
    for name, ring in rings.items():
        shape, at = ring if isinstance(ring[0], tuple) else (ring, "")
        assert order.refilled(shape, at) > 0, f"the {name} ring {shape} never turned over: {dict(order.refills)}"
    return order


# ---------------------------------------------------------------------------------------------
# The check itself, on logs written by hand: a producer wg2, a consumer wg0, one slot


def _wg(i):
    return interp_memory.Warpgroup(0, 0, 0, i)


class _Ring:
    """A hand-written log of a one-slot ring: `fill`, `consume` and `refill` steps."""

    def __init__(self):
        self.buf, self.full, self.free = Buffer(0, (1, 8), "bfloat16"), object(), object()
        self.events, self.phases = [], collections.Counter()
        self.producer, self.consumer = _wg(2), _wg(0)

    def step(self, kind, agent, target=None, where="?"):
        if kind in ("read", "write"):
            self.events.append(Event(kind, agent, self.buf, ((0, 1), (0, 8)), where=where))
        else:
            key = (kind, id(agent), id(target))
            self.events.append(Event(kind, agent, target, phase=self.phases[key], where=where))
            self.phases[key] += 1

    def fill(self):
        self.step("write", self.producer, where="fill")
        self.step("arrive", self.producer, self.full)

    def consume(self, release_first=False):
        self.step("wait", self.consumer, self.full)
        if release_first:
            self.step("arrive", self.consumer, self.free, where="early release")
        self.step("read", self.consumer, where="read")
        if not release_first:
            self.step("arrive", self.consumer, self.free, where="release")

    def refill(self, wait=True):
        if wait:
            self.step("wait", self.producer, self.free)
        self.fill()


def test_a_slot_released_after_its_last_read_and_refilled_after_its_release_passes():
    ring = _Ring()
    ring.fill()
    ring.consume()
    ring.refill()
    ring.consume()
    order = ring_order(ring.events)
    assert order.violations == [] and order.refilled((1, 8)) == 1


def test_a_slot_released_before_its_last_read_is_named_with_its_release():
    ring = _Ring()
    ring.fill()
    ring.consume(release_first=True)
    ring.refill()
    (v,) = ring_order(ring.events).violations
    assert v.startswith("slot 0 of buffer #0 [1, 8] bfloat16 written by wg2 at fill while the read by wg0 at read")
    assert v.endswith("wg0 released it at early release before that read")


def test_a_slot_written_before_its_release_is_named():
    ring = _Ring()
    ring.fill()
    ring.consume()
    ring.refill(wait=False)
    (v,) = ring_order(ring.events).violations
    assert v.endswith("wg2 waited for no release by wg0 after that read")


def test_a_slot_read_before_its_fill_arrived_is_named():
    ring = _Ring()
    ring.step("write", ring.producer, where="fill")
    ring.step("read", ring.consumer, where="read")
    (v,) = ring_order(ring.events).violations
    assert v == "slot 0 of buffer #0 [1, 8] bfloat16 read by wg0 at read without waiting for the write by wg2 at fill"


def test_a_tma_copy_is_an_agent_of_its_own():
    """A warpgroup's own TMA load is ordered before its read only by the copy's barrier, and its
    TMA store's read before its next write only by `wait_smem_to_gmem`."""
    wg, buf, box, bar = _wg(0), Buffer(0, (1, 8), "bfloat16"), ((0, 1), (0, 8)), object()
    load, store = Tma(wg, 0, "load", "load"), Tma(wg, 1, "store", "store")
    fill = [Event("fork", wg, load), Event("write", load, buf, box, where="tma"), Event("arrive", load, bar, phase=0)]
    read = [Event("read", wg, buf, box, where="read")]
    assert ring_order(fill + [Event("wait", wg, bar, phase=0)] + read).violations == []
    (v,) = ring_order(fill + read).violations
    assert v.endswith("read by wg0 at read without waiting for the write by the TMA load of wg0 issued at load")
    emptied = [Event("fork", wg, store), Event("read", store, buf, box, where="out")]
    rewrite = [Event("write", wg, buf, box, where="next")]
    assert ring_order(emptied + [Event("join", wg, store)] + rewrite).violations == []
    (v,) = ring_order(emptied + rewrite).violations
    assert v.endswith("wg0 did not wait for that TMA store to finish reading it")


# ---------------------------------------------------------------------------------------------
# Every kernel on the ring, recorded in the interpreter


@pytest.mark.parametrize("p_slots, steps", [(1, 2), (2, 3)])
def test_every_decode_slot_is_released_after_its_last_read(rng, p_slots, steps):
    """`mla_decode_hopper`, one split of 7 key tiles: the key ring (the three column parts, 32
    keys a slot) and the P slots turn over several times, warpgroup 0 refilling a P slot only
    after warpgroup 1's P @ V read it, the producer a key slot only after both read it."""
    from tests.pallas_kernels.test_mla_hopper import _check_decode, _paged_decode_inputs

    inputs = _paged_decode_inputs(rng, 1, 2, 3, [200])
    with recorded() as rec:
        _check_decode(inputs, n_splits=1, block_kv=32, steps=steps, p_slots=p_slots)
    _assert_in_order(rec, keys=(steps, 32, 64), p=(p_slots, 64, 32))


def test_every_decode_slot_is_released_after_its_last_read_in_cta_pairs(rng):
    """cluster 2: each key tile multicast into both CTAs of a pair, a slot loaded again only
    after the four compute warpgroups of the pair released it (a cluster barrier)."""
    from tests.pallas_kernels.test_mla_hopper import _check_decode, _paged_decode_inputs

    inputs = _paged_decode_inputs(rng, 1, 1, 128, [200], n_pages=8, pages_per_seq=4)
    with recorded() as rec:
        _check_decode(inputs, n_splits=1, block_kv=64, steps=2, cluster=2)
    _assert_in_order(rec, keys=(2, 64, 64), p=(2, 64, 64))


@pytest.mark.parametrize("persistent", [False, True])
def test_every_prefill_slot_is_released_after_its_last_read(rng, persistent):
    """`mla_prefill_hopper`, two sequences of two heads, 64-key blocks through two slots (a CTA
    per tile, or two persistent CTAs whose ring runs on from tile to tile): a K or V slot is
    loaded again only after both compute warpgroups read it (or drained it)."""
    from pallas_kernels.mla_hopper import mla_prefill_hopper
    from tests.pallas_kernels.test_mla_hopper import _check, _inputs

    q, k, v, cu = _inputs(rng, [200, 60], 2, 128, 64)
    with recorded() as rec:
        o, lse = mla_prefill_hopper(
            q, k, v, cu_seqlens=cu, scale=0.1, block_kv=64, steps=2, persistent=persistent, sms=2
        )
    _check(o, lse, q, k, v, cu, 0.1)
    _assert_in_order(rec, keys=(2, 64, 128), values=(2, 64, 64))


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_every_grouped_gemm_slot_is_released_after_its_last_read(layout):
    """`moe_hopper.grouped_matmul` (3 persistent CTAs, 128 x 256 items, K in 4 steps through 2
    slots): the warp-specialized pipeline's row and weight slots, and each consumer's epilogue:
    "padded", four 64 x 64 tiles an item through two slots, a slot written again only after the
    TMA store two tiles back read it; "ragged", items of a few rows, its rows buffer written
    again only after the last item's stores read it."""
    from pallas_kernels import moe, moe_hopper
    from tests.pallas_kernels.test_moe_hopper import _f32, _operands

    x, w, sizes = _operands(0, 300, 256, 256, 4)
    tiling = moe_hopper.HopperTiling(tile_m=128, tile_n=128, steps=2, grid_width=2)
    with recorded() as rec:
        got = moe_hopper.grouped_matmul(x, w, sizes, layout=layout, block_m=128, tiling=tiling, sms=3, interpret=True)
    ref = moe.grouped_matmul_ref(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    np.testing.assert_allclose(_f32(got), np.asarray(ref), rtol=2**-7, atol=1e-6)
    epilogue = ((2, 2, 64, 64), "tiles_out[wg, slot] =") if layout == "padded" else ((2, 128, 64), "rows_out[wg")
    _assert_in_order(rec, rows=((2, 128, 64), "(inside JAX)"), weights=(2, 64, 256), epilogue=epilogue)


@pytest.mark.parametrize("warp_specialized", [True, False])
def test_every_mxfp4_gemm_slot_is_released_after_its_last_read(warp_specialized):
    """`moe_mxfp4_hopper`, K in 4 steps through 2 slots of activations, codes and scales:
    warp-specialized (a producer, two consumers on their column halves), or one warpgroup whose
    TMA loads refill a slot after its own reads of it (overlap: the activations released a step
    late)."""
    from pallas_kernels import moe_mxfp4_hopper as hopper
    from pallas_kernels import mxfp4
    from tests.pallas_kernels.test_moe_mxfp4_hopper import _packed

    rng = np.random.default_rng(7)
    g, k, n, m = 4, 256, 256, 40
    w = _packed(rng, g, k, n)
    bits = np.clip(np.asarray(w.scales).view(np.uint8), 118, 134)
    w = mxfp4.PackedMXFP4(w.values, jnp.asarray(bits).view(jnp.float8_e8m0fnu))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    sizes = jnp.asarray([10, 0, 20, 7], jnp.int32)
    kw = dict(block_m=16, block_n=64, block_k=64, steps=2, code_tile=64, decode="arith")
    with recorded() as rec:
        got = hopper.grouped_matmul(
            x,
            hopper.to_hopper(w, "arith"),
            sizes,
            warp_specialized=warp_specialized,
            overlap=not warp_specialized,
            interpret=True,
            **kw,
        )
    wd = mxfp4.dequantize(w.values, w.scales).astype(jnp.float32)
    ref = jax.lax.ragged_dot(x.astype(jnp.float32), wd, sizes, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), rtol=2**-7, atol=1e-3)
    cols = 128 if warp_specialized else 64  # a CTA's codes: both consumers' halves, or its one block
    _assert_in_order(rec, rows=(2, 16, 64), codes=(2, cols, 64), scales=(2, 2, cols))


def test_a_decode_that_releases_its_p_slot_before_reading_it_fails_the_check(rng, tmp_path):
    """The decode kernel with warpgroup 1's release of the P slot moved ahead of its P @ V (the
    edit tests/gpu makes): the check names the slot, the read and the release, on every run (one
    P slot, so every step's P overwrites the last)."""
    import importlib.util
    import sys

    from tests.gpu.test_hopper_kernels import mutant_source
    from tests.pallas_kernels.test_mla_hopper import _paged_decode_inputs

    path = tmp_path / "mla_decode_hopper_early_release.py"
    path.write_text(mutant_source())
    spec = importlib.util.spec_from_file_location(path.stem, path)
    early = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = early  # a dataclass (DecodeCta) resolves its annotations through it
    try:
        spec.loader.exec_module(early)
    finally:
        del sys.modules[spec.name]
    inputs = _paged_decode_inputs(rng, 1, 2, 3, [200])
    with recorded() as rec:
        early.mla_decode_hopper(*inputs, scale=0.1, n_splits=1, block_kv=32, steps=2, p_slots=1)
    violations = ring_order(rec.events).violations
    named = re.compile(
        r"slot 0 of buffer #\d+ \[1, 64, 32\] bfloat16 written by wg0 at .*`p_smem\.at\[pslot\]\[\.\.\.\] = .* "
        r"while the read by wg1 at .*`plgpu\.wgmma\(acc_ref, p_smem.* is not ordered before it: wg1 released "
        r"it at mla_decode_hopper_early_release\.py:\d+ `plgpu\.barrier_arrive\(p_free\.at\[pslot\]\)` before that read"
    )
    assert violations and all(named.fullmatch(v) for v in violations), violations[:3]
