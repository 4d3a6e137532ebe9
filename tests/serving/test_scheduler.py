"""The scheduler plans steps with no model: admission by capacity and slots, decode rows first,
prefill chunks under the budget with their KDA snapshot exports, preemption by offload or recompute.

A test plays the engine: it executes nothing on a device, it only reports tokens back
(`Scheduler.emit`) the way `Engine.step` does after running a plan."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from cache.host_tier import EmbeddedHostKVTier
from cache.manager import ArrayBlockStore, CacheSpec, PagedKVManager
from serving.request import Request
from serving.scheduler import Scheduler, SchedulerConfig, StepOutput

PAGE = 16
KDA_BLOCK = 4 * PAGE
CHUNK = 64


def make(num_pages=32, num_slots=4, num_snaps=16, host=None, **kw):
    spec = CacheSpec("test/f32", PAGE, KDA_BLOCK)
    mgr = PagedKVManager(
        spec,
        ArrayBlockStore(num_pages, (1, PAGE, 4), np.float32),
        num_pages,
        ArrayBlockStore(num_snaps, (8,), np.float32),
        num_snaps,
        host,
    )
    cfg = dict(
        num_slots=num_slots,
        page_tokens=PAGE,
        prefill_chunk_tokens=CHUNK,
        max_step_tokens=CHUNK + num_slots,
        export_slots=CHUNK // KDA_BLOCK + 2,
        kda_chunk_tokens=16,
    )
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), mgr)


def request(rid, n_prompt, n_new=4, seed=0):
    rng = np.random.default_rng(seed)
    return Request(rid, rng.integers(0, 200, n_prompt).tolist(), n_new)


def play(s, plan, token=7):
    """Report back what running `plan` would: pages committed, snapshots taken, tokens emitted
    (each request's own rank's manager)."""
    for a in plan.admitted:
        a.restored(s.manager_of(a.request))
    for chunk in plan.prefill:
        req, m = chunk.request, s.manager_of(chunk.request)
        m.commit_pages(req.request_id, chunk.end)
        for b in chunk.export:
            m.commit_snapshot(req.request_id, b, np.full(8, b, np.float32))
        if chunk.snapshot_at_end:
            m.commit_snapshot(req.request_id, chunk.end, np.full(8, chunk.end, np.float32))
        if chunk.last:
            req.kv_len = chunk.end
            s.emit(req, token)
    for req in plan.decode:
        req.kv_len += 1
        s.emit(req, token)


def prefill_all(s, req):
    """Plan and play steps until `req` has its first token; returns its chunks."""
    chunks = []
    while not req.output:
        plan = s.schedule()
        chunks += [c for c in plan.prefill if c.request is req]
        play(s, plan)
    return chunks


def test_the_scheduler_imports_no_jax():
    code = "import sys, serving.scheduler; sys.exit('jax' in sys.modules)"
    import subprocess

    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_prompt_is_prefilled_in_chunks_of_any_length_then_decoded():
    s = make()
    req = request("a", 100)
    s.waiting.append(req)
    plan = s.schedule()
    assert [a.request for a in plan.admitted] == [req] and not plan.decode
    assert [(c.start, c.end) for c in plan.prefill] == [(0, 64)]
    play(s, plan)
    spans = []
    while req.planned_len < len(req.context):
        plan = s.schedule()
        spans += [(c.start, c.end) for c in plan.prefill]
        play(s, plan)
    assert spans == [(64, 100)]  # one chunk of what is left (the runner pads it to a compiled length)
    plan = s.schedule()
    assert plan.decode == [req] and not plan.prefill and plan.decode_only


def test_snapshot_boundaries_are_exported_by_the_pass_or_end_the_chunk():
    s = make()
    req = request("a", 150)  # boundaries: the KDA block at 64, 128, and the last full page (144)
    s.waiting.append(req)
    chunks = prefill_all(s, req)
    ends = [(c.start, c.end, c.export, c.snapshot_at_end) for c in chunks]
    # 64 and 128 are chunk ends (snapshotted after the pass); 144 lies inside [128, 150) at a
    # multiple of the KDA chunk (16) from the start: exported by the pass
    assert ends[0] == (0, 64, (), True) and ends[1] == (64, 128, (), True)
    assert ends[2][:2] == (128, 144) or 144 in ends[2][2]
    assert s.manager.lookup(req.context + [1]).tokens == 144


@pytest.mark.parametrize("mode", ["in_pass", "align"])
def test_align_mode_cuts_a_chunk_at_each_boundary_and_keeps_the_same_snapshots(mode):
    s = make(prefill_chunk_tokens=160, max_step_tokens=164, export_slots=4, snapshots=mode)
    req = request("a", 150)  # boundaries 64, 128 and the last full page, 144
    s.waiting.append(req)
    chunks = prefill_all(s, req)
    spans = [(c.start, c.end, c.export, c.snapshot_at_end) for c in chunks]
    if mode == "in_pass":  # one pass exports all three
        assert spans == [(0, 150, (64, 128, 144), False)]
    else:  # vLLM's align: a chunk ends at each boundary, its state kept after the pass
        assert spans == [(0, 64, (), True), (64, 128, (), True), (128, 144, (), True), (144, 150, (), False)]
    assert s.manager.lookup(req.context + [1]).tokens == 144


def test_decode_rows_are_charged_first_and_the_prefill_gets_the_rest():
    s = make(num_slots=4, max_step_tokens=40)
    first = [request(f"d{i}", 16, n_new=50, seed=i) for i in range(3)]
    s.waiting.extend(first)
    for r in first:
        prefill_all(s, r)
    assert all(r.planned_len == 16 and r.output for r in first)
    late = request("p", 100, seed=9)
    s.waiting.append(late)
    plan = s.schedule()
    assert plan.decode == first
    assert [c.tokens for c in plan.prefill] == [40 - 3]  # what the three decode rows leave


def test_a_speculative_decode_row_is_charged_its_verify_passs_tokens():
    s = make(num_slots=4, max_step_tokens=40, lookahead_tokens=3)
    first = [request(f"d{i}", 16, n_new=50, seed=i) for i in range(3)]
    s.waiting.extend(first)
    for r in first:
        prefill_all(s, r)
    s.waiting.append(request("p", 100, seed=9))
    plan = s.schedule()
    assert plan.decode == first
    assert [c.tokens for c in plan.prefill] == [40 - 3 * 4]  # each row verifies t0 and 3 drafts
    assert plan.tokens == 40


def test_a_prefill_cap_while_decoding_bounds_the_chunk():
    s = make(num_slots=4, prefill_tokens_while_decoding=8)
    d = request("d", 10, n_new=50)
    s.waiting.append(d)
    prefill_all(s, d)
    s.waiting.append(request("p", 100, seed=3))
    plan = s.schedule()
    assert len(plan.decode) == 1 and [c.tokens for c in plan.prefill] == [8]


def test_admission_waits_for_a_slot_and_for_pages():
    s = make(num_pages=9, num_slots=2)  # 8 usable pages of 16 tokens
    reqs = [request(f"r{i}", 60, seed=i) for i in range(3)]  # 4 pages each
    s.waiting.extend(reqs)
    plan = s.schedule()
    assert [a.request for a in plan.admitted] == reqs[:2] and s.waiting == [reqs[2]]
    assert not s.free_slots


def test_a_second_turn_is_admitted_with_its_prefix_hit():
    s = make()
    a = request("a", 100, n_new=1)
    s.waiting.append(a)
    while not a.done:
        play(s, s.schedule())
    b = Request("b", a.prompt + a.output + [5] * 20, 2)
    s.waiting.append(b)
    plan = s.schedule()
    assert plan.admitted[0].blocks.hit.tokens == 96 and b.cached_tokens == 96
    assert plan.prefill[0].start == 96


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    s = make(num_pages=9, num_slots=2)
    old, new = request("old", 60, n_new=40), request("new", 60, n_new=40, seed=1)
    s.waiting.append(old)
    play(s, s.schedule())
    s.waiting.append(new)
    preempted = []
    for _ in range(60):
        plan = s.schedule()
        preempted += plan.preempted
        play(s, plan)
        if preempted:
            break
    assert [p.request for p in preempted] == [new] and s.preemptions == 1
    assert s.waiting[0] is new and new.slot == -1 and new.context == new.prompt + new.output
    assert preempted[0].offload_keys is None  # no host tier: it resumes by recompute


def test_with_a_host_tier_a_preemption_names_the_keys_to_offload():
    s = make(num_pages=9, num_slots=2, host=EmbeddedHostKVTier(1 << 20))
    old, new = request("old", 60, n_new=40), request("new", 60, n_new=40, seed=1)
    s.waiting.append(old)
    play(s, s.schedule())
    s.waiting.append(new)
    plan = s.schedule()
    while not plan.preempted:
        play(s, plan)
        plan = s.schedule()
    p = plan.preempted[0]
    assert p.request is new and len(p.offload_keys) == -(-p.cached_len // PAGE) + 1
    assert len(p.page_table) >= -(-p.cached_len // PAGE) and p.slot >= 0


def test_cancel_frees_the_slot_and_blocks():
    s = make()
    req = request("a", 40, n_new=10)
    s.waiting.append(req)
    play(s, s.schedule())
    assert s.cancel("a") and req.error == "cancelled" and "a" not in s.manager.requests
    assert sorted(s.free_slots) == [0, 1, 2, 3] and not s.cancel("a")


@pytest.mark.parametrize("n", [1, 3])
def test_eos_and_max_tokens_end_requests(n):
    s = make()
    reqs = [request(f"r{i}", 20, n_new=n, seed=i) for i in range(2)]
    reqs[1].stop_at_eos = True
    s.waiting.extend(reqs)
    from kimik3 import tokenizer

    for _ in range(10):
        plan = s.schedule()
        play(s, plan, token=tokenizer.EOS_ID)
    assert all(r.done for r in reqs) and len(reqs[0].output) == n and len(reqs[1].output) == 1


def make_ranked(ranks=2, num_pages=9, num_slots=4, num_snaps=8, host=None):
    """One manager per rank (DP decode: each rank owns its pools), their host tier shared."""
    spec = CacheSpec("test/f32", PAGE, KDA_BLOCK)
    mgrs = [
        PagedKVManager(
            spec,
            ArrayBlockStore(num_pages, (1, PAGE, 4), np.float32),
            num_pages,
            ArrayBlockStore(num_snaps, (8,), np.float32),
            num_snaps,
            host,
        )
        for _ in range(ranks)
    ]
    cfg = dict(
        num_slots=num_slots,
        page_tokens=PAGE,
        prefill_chunk_tokens=CHUNK,
        max_step_tokens=CHUNK + num_slots,
        export_slots=CHUNK // KDA_BLOCK + 2,
        kda_chunk_tokens=16,
    )
    return Scheduler(SchedulerConfig(**cfg), mgrs)


def test_ranks_split_the_slots_and_a_request_goes_where_its_prefix_is():
    s = make_ranked()
    assert s.ranks == 2 and s.slots_per_rank == 2 and sorted(s.free_slots) == [0, 1, 2, 3]
    a, b = request("a", 40, seed=1), request("b", 40, seed=2)
    s.waiting += [a, b]
    while a.done is False or b.done is False:
        play(s, s.schedule())
    assert {a.rank, b.rank} == {0, 1}  # the emptier rank each time: one each
    assert sorted(s.free_slots) == [0, 1, 2, 3]
    # b's continuation goes back to b's rank, for its prefix there, though a's rank is as free
    again = Request("b2", b.prompt + [5] * 10, 2)
    s.waiting.append(again)
    play(s, s.schedule())
    assert again.rank == b.rank and again.cached_tokens == 32
    assert s.manager_of(again).requests and not s.managers[a.rank].requests


def test_preemption_frees_room_within_the_short_rank_only():
    """8 usable pages per rank: two 60-token requests on one rank outgrow it; preemption picks the
    newest request of that rank, never one of the other rank."""
    s = make_ranked(num_slots=6)
    reqs = [Request(f"r{i}", np.random.default_rng(i).integers(0, 200, 60).tolist(), 12) for i in range(3)]
    s.waiting += reqs
    # admitted in turn: r0 and r2 share a rank (equal free pages go to the lower rank), r1 is alone
    preempted = []
    for _ in range(200):
        if all(r.done for r in reqs):
            break
        plan = s.schedule()
        preempted += [(p.request.request_id, p.rank) for p in plan.preempted]
        play(s, plan)
    assert all(r.done and r.error is None for r in reqs)
    # each time the newest request of the short rank: r2 (first beside r0 on rank 0, then, resumed
    # on the emptier rank 1, beside r1); r0 and r1, each older than it on its rank, never
    assert preempted[0] == ("r2", 0) and {rid for rid, _ in preempted} == {"r2"}


def test_slots_must_split_evenly_over_the_ranks():
    spec = CacheSpec("test/f32", PAGE, KDA_BLOCK)
    mgrs = [
        PagedKVManager(spec, ArrayBlockStore(9, (1, PAGE, 4), np.float32), 9, ArrayBlockStore(8, (8,), np.float32), 8)
        for _ in range(2)
    ]
    with pytest.raises(ValueError, match="split evenly over the 2 ranks"):
        Scheduler(
            SchedulerConfig(
                num_slots=3,
                page_tokens=PAGE,
                prefill_chunk_tokens=CHUNK,
                max_step_tokens=80,
                export_slots=3,
                kda_chunk_tokens=16,
            ),
            mgrs,
        )


def test_the_scheduler_and_its_records_import_without_jax():
    code = (
        "import sys, serving.scheduler, serving.request\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'torch'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parents[2])


def _token_at(req, i: int) -> int:
    """The token a request's model would give at output position i (a stand-in for logits)."""
    return (sum(map(ord, req.request_id)) * 31 + i) % 200 + 1


class FakeExecutor:
    """`serving.executor.StepExecutor`'s contract without a device: a plan's KV is 'written' (pages
    committed, snapshots published), a prompt's last chunk yields its first token, and a
    decode-only plan's tokens stay 'on the device' until the next plan reads them (chained on
    them, or settled first)."""

    def __init__(self, s: Scheduler):
        self.s, self._flight = s, None

    @property
    def in_flight(self):
        return None if self._flight is None else [r for r, _ in self._flight]

    def settle(self) -> StepOutput:
        out, self._flight = StepOutput(tokens=[(r, t, False, None) for r, t in self._flight or ()]), None
        return out

    def execute(self, plan) -> StepOutput:
        out = StepOutput()
        if plan.chained:  # the in-flight step's token is not emitted yet: this one comes after it
            previous, self._flight = self._flight, [(r, _token_at(r, len(r.output) + 1)) for r in plan.decode]
            for r in plan.decode:
                r.kv_len += 1
            out.tokens += [(r, t, False, None) for r, t in previous]
            return out
        for a in plan.admitted:
            a.restored(self.s.manager_of(a.request))
        flight = [(r, _token_at(r, len(r.output))) for r in plan.decode]
        for r in plan.decode:
            r.kv_len += 1
        for chunk in plan.prefill:
            req, m = chunk.request, self.s.manager_of(chunk.request)
            m.commit_pages(req.request_id, chunk.end)
            for b in chunk.export:
                m.commit_snapshot(req.request_id, b, np.full(8, b, np.float32))
            if chunk.snapshot_at_end:
                m.commit_snapshot(req.request_id, chunk.end, np.full(8, chunk.end, np.float32))
            if chunk.last:
                req.kv_len = chunk.end
                out.tokens.append((req, _token_at(req, len(req.output)), True, None))
        if plan.decode_only:
            self._flight = flight
        else:
            out.tokens += [(r, t, bool(plan.prefill), None) for r, t in flight]
        return out


@pytest.mark.parametrize("num_pages", [64, 14])
def test_plan_execute_update_serves_every_request_against_a_fake_executor(num_pages):
    """The engine's loop (`Engine.step`) over a device-free executor: a chained plan while only
    decode rows run, else the in-flight tokens applied and a fresh plan.  Every request gets its
    tokens in order, chained steps happen, and every page, snapshot and slot comes back; with 14
    pages requests are preempted and recomputed on the way."""
    s = make(num_pages=num_pages)
    ex = FakeExecutor(s)
    reqs = [
        request(f"r{i}", n, n_new)
        for i, (n, n_new) in enumerate([(40, 30), (70, 12), (20, 25), (90, 8), (33, 40), (5, 3)])
    ]
    s.waiting.extend(reqs)
    kinds = []
    for _ in range(500):
        if not (s.waiting or s.running):
            break
        plan = s.chain_plan(ex.in_flight)
        if plan is None:
            s.update_from_output(ex.settle())
            plan = s.schedule()
        s.update_from_output(ex.execute(plan))
        kinds.append("chained" if plan.chained else "planned")
    s.update_from_output(ex.settle())
    assert not (s.waiting or s.running)
    for r in reqs:
        assert r.error is None and r.output == [_token_at(r, i) for i in range(r.max_new_tokens)], r.request_id
    assert "chained" in kinds
    assert (s.preemptions > 0) == (num_pages == 14)
    assert s.manager.page_pool.num_free == num_pages - 1 and not s.manager.requests
    assert sorted(s.free_slots) == list(range(4))
