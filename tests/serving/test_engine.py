"""The engine's greedy tokens equal the oracle's: batched, across turns, from prefix hits."""

import os

import jax
import numpy as np
import pytest

from cache.host_tier import EmbeddedHostKVTier
from kimik3 import tokenizer
from kimik3.generate import generate
from serving import kv_pools
from serving.disagg import DisaggregatedServer
from serving.engine import Engine
from serving.decode_runner import _overwrite
from tests.cache.corrupt import corrupt_entry

PAGE = 16


def _engine(params, cfg, **kw):
    kw = dict(
        dict(
            num_pages=48,
            num_slots=4,
            num_snapshots=12,
            page_tokens=PAGE,
            kda_block_tokens=4 * PAGE,
            max_pages_per_request=16,
            prefill_chunk_tokens=40,
            kernels="reference",
        ),
        **kw,
    )
    return Engine(params, cfg, **kw)


def _oracle(params, cfg, prompt, n):
    return generate(params, cfg, prompt, n).tokens.tolist()


def test_concurrent_requests_equal_the_oracle(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg)
    prompts = [rng.integers(0, 256, n).tolist() for n in (37, 70, 5)]
    reqs = [eng.submit(p, 6) for p in prompts]
    eng.run(max_steps=200)
    for req, p in zip(reqs, prompts):
        assert req.done and req.error is None
        assert req.output == _oracle(tiny_params, tiny_cfg, p, 6)


def test_second_turn_served_from_a_prefix_hit_equals_the_oracle(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg)
    turn1 = tokenizer.apply_chat_template([tokenizer.Message("user", "x" * 60)])
    r1 = eng.submit(turn1, 5)
    eng.run(max_steps=100)
    turn2 = turn1 + r1.output + tokenizer.apply_chat_template([tokenizer.Message("user", "more")])[1:]
    r2 = eng.submit(turn2, 5)
    eng.run(max_steps=100)
    assert r2.cached_tokens >= 4 * PAGE  # the KDA block boundary at 64 tokens at least
    assert r1.output == _oracle(tiny_params, tiny_cfg, turn1, 5)
    assert r2.output == _oracle(tiny_params, tiny_cfg, turn2, 5)


def test_second_turn_from_the_host_tier_after_eviction(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg, num_pages=12, num_snapshots=5, host=EmbeddedHostKVTier(1 << 24))
    turn1 = rng.integers(0, 256, 80).tolist()
    r1 = eng.submit(turn1, 3)
    eng.run(max_steps=100)
    eng.submit(rng.integers(0, 256, 150).tolist(), 2)  # evicts turn 1's pages and snapshots
    eng.run(max_steps=100)
    turn2 = turn1 + r1.output + rng.integers(0, 256, 10).tolist()
    r2 = eng.submit(turn2, 4)
    eng.run(max_steps=100)
    assert r2.cached_tokens_host > 0
    assert r2.output == _oracle(tiny_params, tiny_cfg, turn2, 4)


def test_bad_requests_are_refused_and_cancellation_frees_kv(tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg)
    with pytest.raises(ValueError, match="empty"):
        eng.submit([], 3)
    with pytest.raises(ValueError, match="context limit"):
        eng.submit([1] * 250, 10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.submit([1, 2], 0)
    free_before = eng.manager.page_pool.num_free
    req = eng.submit(list(range(50)), 20)
    eng.step()
    assert eng.cancel(req.request_id) and req.error == "cancelled"
    assert eng.manager.page_pool.num_free == free_before and not eng.manager.requests
    other = eng.submit(list(range(30)), 3)
    eng.run(max_steps=50)
    assert other.output == _oracle(tiny_params, tiny_cfg, list(range(30)), 3)


def _free_blocks(eng) -> list[tuple[int, int]]:
    """(free pages, free snapshots) of each rank's pools; a cached block with no reference is free
    (the next allocation may evict it)."""
    return [(m.page_pool.num_free, m.snap_pool.num_free) for m in eng.managers]


def _assert_nothing_held(eng, free0) -> None:
    """Every page, snapshot and slot is back: the free counts are `free0` again, exactly."""
    assert _free_blocks(eng) == free0 and all(not m.requests for m in eng.managers)
    assert sorted(eng.scheduler.free_slots) == list(range(eng.config.num_slots))
    for m in eng.managers:
        m.page_pool.check_invariants()
        m.snap_pool.check_invariants()


def test_a_request_cancelled_at_any_step_returns_every_page_snapshot_and_slot(rng, tiny_cfg, tiny_params):
    """A 100-token prompt in 40-token chunks, cancelled after 0 to 6 steps: while waiting, between
    prefill chunks, after its first token, and with a decode step in flight.  The pools' free
    counts come back to exactly where they started each time."""
    eng = _engine(tiny_params, tiny_cfg)
    free0 = _free_blocks(eng)
    phases = set()
    for steps in range(7):
        req = eng.submit(rng.integers(0, 256, 100).tolist(), 20)
        for _ in range(steps):
            eng.step()
        if req in eng.waiting:
            phases.add("waiting")
        elif req.planned_len < len(req.context):
            phases.add("prefilling")
        else:
            phases.add("decoding, a step in flight" if eng.executor.in_flight is not None else "decoding")
        assert eng.cancel(req.request_id) and req.error == "cancelled"
        eng.run(max_steps=5)  # reads the step in flight, if any: the cancelled request drops its token
        _assert_nothing_held(eng, free0)
        assert len(req.output) < 20
    assert phases >= {"waiting", "prefilling", "decoding, a step in flight"}, phases


@pytest.mark.parametrize(
    "handoff, concurrent", [("direct", False), ("store", False), ("direct", True), ("store", True)]
)
def test_prefill_decode_disaggregation_equals_the_oracle(rng, tiny_cfg, tiny_params, handoff, concurrent):
    """Serial stepping, and concurrent (each engine in its own thread, as separate instances)."""
    from serving.disagg import DisaggregatedServer

    host = EmbeddedHostKVTier(1 << 24) if handoff == "store" else None
    prefill = _engine(tiny_params, tiny_cfg, role="prefill", host=host)
    decode = _engine(tiny_params, tiny_cfg, role="decode", host=host)
    server = DisaggregatedServer(prefill, decode, handoff, concurrent=concurrent)
    prompts = [rng.integers(0, 256, n).tolist() for n in (70, 33)]
    reqs = [server.submit(p, 5) for p in prompts]
    done = server.run(max_steps=300 if not concurrent else 100_000)
    assert not server._threads  # run() stops them
    for r, p in zip(reqs, prompts):
        assert done[r.request_id].output == _oracle(tiny_params, tiny_cfg, p, 5)
    if handoff == "store":
        assert any(done[r.request_id].cached_tokens_host > 0 for r in reqs)
    assert not prefill.manager.requests and not decode.manager.requests  # all KV released


def test_demo_runs_every_mode_and_reports_metrics(tmp_path):
    import json

    from harness import demo

    # five sessions at once on 20 pages: finished turns are evicted while the others run, so the
    # host tier serves the next turns' prefixes (the demo shows the tiers' benefit)
    text = demo.main(demo.DemoSpec(sessions=5, turns=(2, 2), num_pages=20), str(tmp_path))
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    from harness import demo_store

    if os.environ.get("KIMIK3_REQUIRE_MOONCAKE"):
        assert demo_store.available()
    modes = demo.MODES + ((demo_store.MODE,) if demo_store.available() else ())
    for mode in modes:
        assert f"| {mode} | 10 |" in text  # every turn finished, P/D handoffs that waited for capacity too
    host_share = lambda mode: float(rows[mode].rsplit("+", 1)[1].split("%")[0])
    assert host_share("colocated+host") > 0 and host_share("pd-store") > 0 and host_share("colocated") == 0
    if demo_store.available():  # P/D through a Mooncake store (a child process on loopback) hits the same
        assert rows[demo_store.MODE].rsplit("|", 2)[1] == rows["pd-store"].rsplit("|", 2)[1]
    # the JSON report holds every figure of the table, per setup, with the config and the backend
    report = json.loads((tmp_path / demo.REPORT_JSON).read_text())
    assert (report["config"], report["backend"], report["weights"]) == ("tiny", jax.default_backend(), "random weights")
    assert list(report["setups"]) == list(modes) and (tmp_path / demo.PLOT_PNG).exists()
    for mode, fig in report["setups"].items():
        ms = lambda d, q: f"{d[q]:.1f}" if d[q] is not None else "nan"
        cells = [c.strip() for c in rows[mode].strip("|").split("|")]
        assert cells[1:] == [
            str(fig["requests"]),
            f"{fig['output_tok_s']:.1f}",
            " / ".join(ms(fig["ttft_ms"], q) for q in ("p50", "p90", "p99")),
            " / ".join(ms(fig["tpot_ms"], q) for q in ("p50", "p90", "p99")),
            f"{ms(fig['tpot_decode_only_ms'], 'p50')} / {ms(fig['tpot_mixed_ms'], 'p50')}",
            f"{ms(fig['queue_ms'], 'p50')} / {ms(fig['queue_ms'], 'p99')}",
            "{total:.1%} ({device:.1%} + {host:.1%})".format(**fig["prefix_hit_share"]),
        ]
        # the warm-up built every program the setups run, moves and helpers included: none while measuring
        assert fig["xla_programs_built_while_measuring"] == 0
        # one summary line per setup; each engine's steps by kind, in a row of the steps table
        per_setup = text.split("\nper setup:", 1)[1].split("\nevery figure", 1)[0].splitlines()
        summary = next(line for line in per_setup if line.startswith(f"  {mode} "))
        assert f"TTFT p50 / p99 {ms(fig['ttft_ms'], 'p50'):>6} / {ms(fig['ttft_ms'], 'p99'):>6} ms" in summary
        assert f"prefix hits {fig['prefix_hit_share']['total']:.1%}" in summary and len(summary) < 130
        steps = text.split(demo.STEP_LEGEND, 1)[1]
        for engine, kinds in fig["engine_steps"].items():
            label = mode if engine == "engine" else f"{mode} {engine}"
            row = next(line for line in steps.splitlines() if line.startswith(f"  {label} "))
            for k in kinds.values():
                assert f"{k['steps']} x {k['host_ms']:.2f}+{k['wait_ms']:.2f} ms" in row
    assert demo.PD_NOTE in text  # the P/D rows' TPOT is said to be serial stepping's, under the table
    header = text.split("\n\n", 1)[0].splitlines()  # what ran where, start-up and memory: short lines
    assert header[0] == f"kimik3 demo: config tiny on {jax.default_backend()}, random weights"
    assert max(map(len, header)) <= 120
    # the figures `benchmarks.serving_bench.demo_figures` reads from a demo's output
    from benchmarks.serving_bench import demo_figures

    fig = demo_figures(text)
    for key in ("warmup_s", "peak_rss_gib", "tpot_p50_ms", "tpot_decode_only_p50_ms", "tpot_mixed_p50_ms"):
        assert isinstance(fig.get(key), float), (key, fig)
    assert "warm-up compiles" in fig["rss_phases_gib"]
    assert fig["warmup_s"] == round(report["startup_s"]["warm-up total"], 1)


def test_the_demo_plot_is_titled_on_log_axes_and_says_what_to_install(tmp_path, monkeypatch):
    import sys

    from harness import demo
    from serving.metrics import RequestRecord

    records = {"a": [RequestRecord(0.0, [0.01, 0.02, 0.05], 10, 0, 0), RequestRecord(0.0, [1.0, 1.5], 10, 0, 0)]}
    spec = demo.DemoSpec(checkpoint="runs/mini/quantized", manifest="fp8_attn")
    assert demo.weights_label(spec) == "checkpoint runs/mini/quantized as fp8_attn"
    import matplotlib.pyplot as plt

    saved = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    demo.plot_latency(records, str(tmp_path / "p.png"), "kimik3 demo: config tiny on cpu, random weights")
    (fig,) = saved
    assert fig.get_suptitle() == "kimik3 demo: config tiny on cpu, random weights"
    assert [ax.get_xscale() for ax in fig.axes] == ["log", "log"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    with pytest.raises(ImportError, match="kimik3\\[plot\\]"):
        demo.plot_latency(records, str(tmp_path / "p.png"), "t")


def test_a_freshly_started_engine_finds_the_kv_in_mooncake(rng, tiny_cfg, tiny_params, mooncake_services):
    from cache.mooncake_tier import MooncakeHostKVTier

    ns = f"tiny/fresh-{rng.integers(1 << 30)}"  # this test's own key space in the session store
    tier_a = MooncakeHostKVTier(mooncake_services.master_addr, mooncake_services.metadata_url)
    eng_a = _engine(tiny_params, tiny_cfg, host=tier_a, publish_to_host=True, namespace=ns)
    turn1 = rng.integers(0, 256, 90).tolist()
    r1 = eng_a.submit(turn1, 3)
    eng_a.run(max_steps=100)
    tier_a.close()
    del eng_a  # the first engine is gone; only the store remembers
    tier_b = MooncakeHostKVTier(mooncake_services.master_addr, mooncake_services.metadata_url)
    eng_b = _engine(tiny_params, tiny_cfg, host=tier_b, namespace=ns)
    turn2 = turn1 + r1.output + rng.integers(0, 256, 7).tolist()
    r2 = eng_b.submit(turn2, 4)
    eng_b.run(max_steps=100)
    tier_b.close()
    assert r2.cached_tokens_host >= 4 * PAGE
    assert r2.output == _oracle(tiny_params, tiny_cfg, turn2, 4)


def test_admission_refuses_what_does_not_fit_and_admits_it_later(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg, num_pages=8)  # 7 usable pages of 16 tokens
    prompts = [rng.integers(0, 256, 90).tolist() for _ in range(2)]  # 6 pages each with their outputs
    a, b = (eng.submit(p, 4) for p in prompts)
    eng.step()
    assert [r.request_id for r in eng.running] == [a.request_id] and eng.waiting == [b]
    eng.run(max_steps=200)
    assert a.output == _oracle(tiny_params, tiny_cfg, prompts[0], 4)
    assert b.output == _oracle(tiny_params, tiny_cfg, prompts[1], 4)
    assert b.admitted_s >= a.token_times_s[-1]  # b was admitted once a had freed its pages


def test_preemption_and_resume_give_the_oracles_tokens(rng, tiny_cfg, tiny_params):
    """A preempted request resumes by recompute with the oracle's tokens; once both finish, every
    page and snapshot the preemption and the recompute took is free."""
    eng = _engine(tiny_params, tiny_cfg, num_pages=9)  # 8 usable pages: both fit at first, not while growing
    free0 = _free_blocks(eng)
    prompts = [rng.integers(0, 256, 60).tolist() for _ in range(2)]
    reqs = [eng.submit(p, 40) for p in prompts]  # each grows from 4 to 7 pages
    eng.run(max_steps=400)
    assert eng.preemptions >= 1
    for r, p in zip(reqs, prompts):
        assert r.error is None and r.output == _oracle(tiny_params, tiny_cfg, p, 40)
    _assert_nothing_held(eng, free0)


def test_memory_budget_sizing_and_capacity_report(tiny_cfg, tiny_params):
    page = Engine.bytes_per_page(tiny_cfg, PAGE, np.float32)
    state = Engine.bytes_per_state(tiny_cfg, np.float32)
    eng = Engine.from_memory_budget(
        tiny_params,
        tiny_cfg,
        budget_bytes=40 * page + 25 * state,
        page_tokens=PAGE,
        num_slots=4,
        snapshots_per_slot=4,
        max_pages_per_request=16,
        kernels="reference",
    )
    cap = eng.capacity()
    assert cap["pages"] + 1 == eng.manager.page_pool.num_blocks and cap["kv_tokens"] == cap["pages"] * PAGE
    # What the device holds, counted from the arrays themselves (not the formula that sized them):
    # the budget, less at most one page's remainder.
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(eng.kv.pools)) + eng.snapshots.data.nbytes
    assert 40 * page + 25 * state - page < held <= 40 * page + 25 * state
    assert cap["pool_bytes"] <= 40 * page + 25 * state + page and cap["checkpoint_block_bytes_per_request"] == state
    with pytest.raises(ValueError, match="budget"):
        Engine.from_memory_budget(tiny_params, tiny_cfg, budget_bytes=state, page_tokens=PAGE)


def test_streaming_yields_the_oracle_tokens_in_order(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg)
    prompt = rng.integers(0, 256, 30).tolist()
    assert list(eng.stream(prompt, 5)) == _oracle(tiny_params, tiny_cfg, prompt, 5)


def test_step_token_budget_packs_several_prefills_and_is_never_exceeded(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg, prefill_chunk_tokens=32, max_step_tokens=80)
    prompts = [rng.integers(0, 256, n).tolist() for n in (20, 45, 9)]
    reqs = [eng.submit(p, 4) for p in prompts]
    eng.step()
    # One step prefills from all three requests: 16 (to its first page's snapshot) + 32 (its
    # chunk cap) + 9 tokens, each chunk padded to a compiled length.
    assert [r.planned_len for r in reqs] == [16, 32, 9]
    eng.run(max_steps=200)
    assert max(eng.step_tokens) <= 80
    for req, p in zip(reqs, prompts):
        assert req.output == _oracle(tiny_params, tiny_cfg, p, 4)


def test_a_small_budget_still_gives_the_oracles_tokens(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg, max_step_tokens=6)
    prompts = [rng.integers(0, 256, n).tolist() for n in (23, 11)]
    reqs = [eng.submit(p, 5) for p in prompts]
    eng.run(max_steps=400)
    assert max(eng.step_tokens) <= 6
    for req, p in zip(reqs, prompts):
        assert req.output == _oracle(tiny_params, tiny_cfg, p, 5)
    with pytest.raises(ValueError, match="max_step_tokens"):
        _engine(tiny_params, tiny_cfg, max_step_tokens=4)


def test_load_report_finished_queue_and_a_request_larger_than_the_pool(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg, num_pages=8)  # 7 usable pages of 16 tokens
    with pytest.raises(ValueError, match="context limit of 112 tokens"):
        eng.submit(rng.integers(0, 256, 110).tolist(), 3)  # passes max_pages (16) but never fits the pool
    req = eng.submit(rng.integers(0, 256, 40).tolist(), 3)
    eng.step()
    load = eng.load()
    assert load["running"] == 1 and load["waiting"] == 0 and load["total_pages"] == 7
    assert load["free_pages"] == 7 - 3 and 0 < load["kv_use"] < 1
    eng.run(max_steps=50)
    assert eng.pop_finished() == [req] and eng.pop_finished() == []


def _preempting_engine(params, cfg, host):
    """8 usable pages; two 60-token prompts that grow from 4 to 7 pages each: one must be preempted."""
    eng = _engine(params, cfg, num_pages=9, host=host)
    prompts = [np.random.default_rng(7).integers(0, 256, 60).tolist() for _ in range(2)]
    prompts[1][0] = (prompts[1][0] + 1) % 256  # no shared prefix
    return eng, prompts, [eng.submit(p, 40) for p in prompts]


def _offloads(host) -> list[str]:
    """The host tier's entries of preempted requests' KV."""
    return [k for k in host._data if "/preempt/" in k]


def test_preemption_offloads_to_the_host_tier_and_resumes_without_recompute(tiny_cfg, tiny_params):
    """A preempted request's KV goes to the host tier and comes back without recompute, with the
    oracle's tokens; once both requests finish, every page and snapshot is free again and the host
    tier holds none of the offloads."""
    host = EmbeddedHostKVTier(1 << 24)
    eng, prompts, reqs = _preempting_engine(tiny_params, tiny_cfg, host)
    free0 = _free_blocks(eng)  # submitted, nothing taken yet
    eng.run(max_steps=400)
    assert eng.preemptions >= 1 and eng.offloaded_resumes == eng.preemptions
    assert eng.recomputed_tokens == 0
    for r, p in zip(reqs, prompts):
        assert r.error is None and r.output == _oracle(tiny_params, tiny_cfg, p, 40)
    _assert_nothing_held(eng, free0)
    assert _offloads(host) == []


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offloaded"])
def test_a_request_cancelled_while_preempted_leaves_nothing_held(tiny_cfg, tiny_params, offload):
    """Preempted (its KV offloaded to the host tier, or to be recomputed) and then cancelled while
    it waits to resume: the other request finishes, and every page, snapshot, slot and offload
    entry is back."""
    host = EmbeddedHostKVTier(1 << 24) if offload else None
    eng, _, reqs = _preempting_engine(tiny_params, tiny_cfg, host)
    free0 = _free_blocks(eng)  # submitted, nothing taken yet
    for _ in range(400):
        eng.step()
        if eng.preemptions:
            break
    (victim,) = eng.waiting
    assert (victim.offload_keys is not None) == offload and victim.output
    assert eng.cancel(victim.request_id) and victim.error == "cancelled"
    eng.run(max_steps=400)
    (other,) = [r for r in reqs if r is not victim]
    assert other.error is None and len(other.output) == 40
    _assert_nothing_held(eng, free0)
    assert host is None or _offloads(host) == []


def test_a_corrupt_offload_entry_falls_back_to_recompute_with_the_same_tokens(tiny_cfg, tiny_params):
    host = EmbeddedHostKVTier(1 << 24)
    eng, prompts, reqs = _preempting_engine(tiny_params, tiny_cfg, host)
    for _ in range(400):
        eng.step()
        if eng.preemptions:
            break
    victim = eng.waiting[0]
    corrupt_entry(host, victim.offload_keys[-1])  # its KDA state entry
    eng.run(max_steps=400)
    assert host.stats.corrupt >= 1 and eng.recomputed_tokens > 0
    for r, p in zip(reqs, prompts):
        assert r.error is None and r.output == _oracle(tiny_params, tiny_cfg, p, 40)


def test_sampled_tokens_survive_preemption_and_pd_handoff_unchanged(tiny_cfg, tiny_params):
    from serving.sampling import SamplingParams

    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    plain = _engine(tiny_params, tiny_cfg)
    prompts = [np.random.default_rng(7).integers(0, 256, 60).tolist() for _ in range(2)]
    prompts[1][0] = (prompts[1][0] + 1) % 256
    want = [plain.submit(p, 40, sampling=sp) for p in prompts]
    plain.run(max_steps=400)
    assert want[0].output != _oracle(tiny_params, tiny_cfg, prompts[0], 40)  # it did sample
    tight = _engine(tiny_params, tiny_cfg, num_pages=9)  # preempts one of them (recompute path)
    got = [tight.submit(p, 40, sampling=sp) for p in prompts]
    tight.run(max_steps=400)
    assert tight.preemptions >= 1 and [r.output for r in got] == [r.output for r in want]
    server = DisaggregatedServer(
        _engine(tiny_params, tiny_cfg, role="prefill"), _engine(tiny_params, tiny_cfg, role="decode"), handoff="direct"
    )
    pd = [server.submit(p, 40, sampling=sp) for p in prompts]
    server.run(max_steps=400)
    assert [server.requests[r.request_id].output for r in pd] == [r.output for r in want]
    with pytest.raises(ValueError, match="SamplingParams"):
        plain.submit(prompts[0], 3, sampling={"temperature": 0.5})


def test_top_k_1_and_min_p_1_sample_the_greedy_tokens_in_the_decode_step(tiny_cfg, tiny_params):
    """The filters reach the device step (and the host's first token): at temperature 1 they leave
    only the top token, so the output is the oracle's."""
    from serving.sampling import SamplingParams

    eng = _engine(tiny_params, tiny_cfg)
    prompt = np.random.default_rng(8).integers(0, 256, 40).tolist()
    reqs = [
        eng.submit(prompt, 12, sampling=SamplingParams(temperature=1.0, seed=3, **kw))
        for kw in (dict(top_k=1), dict(min_p=1.0), {})
    ]
    eng.run(max_steps=200)
    want = _oracle(tiny_params, tiny_cfg, prompt, 12)
    assert reqs[0].output == reqs[1].output == want != reqs[2].output


def test_parallel_warmup_compiles_every_shape_serving_then_uses(rng, tiny_cfg, tiny_params):
    """Warm-up compiles each prefill length and decode bucket once, on threads, and the snapshot
    of a chunk's export; serving afterwards compiles nothing and still gives the oracle's tokens.
    (num_pages 44 and num_snapshots 11 are unique to this test, so its programs are new even when
    other tests ran in this process.)"""
    eng = _engine(tiny_params, tiny_cfg, num_pages=44, num_slots=3, num_snapshots=11, prefill_chunk_tokens=96)
    # one prefill program per chunk length, one decode program (greedy) per bucket
    programs = {("prefill", t) for t, _ in eng._prefill_lengths()} | {
        ("decode", eng._decode_bucket(n)) for n in range(1, 4)
    }
    # and the rows' write programs (two per bucket; shared with other engines of the same
    # shapes, so counted apart): serving then compiles neither kind
    writes = _overwrite._cache_size()
    assert eng.warmup(threads=4) - (_overwrite._cache_size() - writes) == len(programs)
    prompts = [rng.integers(0, 256, n).tolist() for n in (29, 11, 100)]  # 100: a chunk [0, 96) exports at 64
    reqs = [eng.submit(p, 5) for p in prompts]
    exports = kv_pools._save_export._cache_size()  # a chunk's export snapshot (11 blocks: this test's)
    eng.run(max_steps=200)
    assert eng.compiles == 0 and kv_pools._save_export._cache_size() == exports
    # the page and snapshot moves of any count of blocks (offloads, host-tier loads, handoffs)
    moves = [f._cache_size() for f in (kv_pools._read_pages, kv_pools._write_pages, kv_pools._take_rows)]
    for n in (1, 3, 5, 7):
        eng.kv.pages.write(list(range(1, n + 1)), eng.kv.pages.read(list(range(1, n + 1))))
        eng.kv.snapshots.write(list(range(1, n + 1)), eng.kv.snapshots.read(list(range(1, n + 1))))
    assert [f._cache_size() for f in (kv_pools._read_pages, kv_pools._write_pages, kv_pools._take_rows)] == moves
    for req, p in zip(reqs, prompts):
        assert req.output == _oracle(tiny_params, tiny_cfg, p, 5)


def test_a_sampled_warmup_serves_sampled_requests_without_compiling(rng, tiny_cfg, tiny_params):
    """A server's warm-up (`sampled=True`, as workers warm: API clients sample at temperature 1 by
    default) compiles the decode step's sampling variant too, so a sampled batch compiles nothing.
    (num_pages 46: programs of its own.)"""
    from serving.sampling import SamplingParams

    eng = _engine(tiny_params, tiny_cfg, num_pages=46, num_slots=2, prefill_chunk_tokens=24)
    eng.warmup(threads=2, sampled=True)
    reqs = [
        eng.submit(rng.integers(0, 256, n).tolist(), 5, sampling=SamplingParams(temperature=1.0, seed=n, top_k=5))
        for n in (13, 30)
    ]
    eng.run(max_steps=200)
    assert eng.compiles == 0 and all(len(r.output) == 5 for r in reqs)


def test_snapshots_exported_inside_a_chunk_serve_hits_that_equal_the_oracle(rng, tiny_cfg, tiny_params):
    """With 256-token chunks the first chunk runs 224 tokens (to the last full page's snapshot)
    and the KDA-block boundaries at 64, 128 and 192 lie inside it: the chunk's one pass exports
    their states (no chunk ends there).  A second
    request sharing 100 tokens hits that snapshot and decodes the oracle's tokens, and the
    snapshot equals the one an engine whose chunks end at 64 takes from the slot."""
    kw = dict(num_pages=64, kda_block_tokens=4 * PAGE, prefill_chunk_tokens=256)
    eng = _engine(tiny_params, tiny_cfg, **kw)
    first = rng.integers(0, 256, 230).tolist()
    r1 = eng.submit(first, 4)
    calls = []
    forward = eng.runner.forward  # prefill chunks (decode runs its own program)
    eng.runner.forward = lambda kv, tokens, *a, **k: calls.append(tokens.shape) or forward(kv, tokens, *a, **k)
    eng.run(max_steps=100)
    assert calls[:2] == [(1, 224), (1, 6)]  # [0, 224) exports 64, 128, 192; the last 6 tokens (padded)
    second = first[:100] + rng.integers(0, 256, 20).tolist()
    r2 = eng.submit(second, 4)
    eng.run(max_steps=100)
    assert r2.cached_tokens == 64
    assert r1.output == _oracle(tiny_params, tiny_cfg, first, 4)
    assert r2.output == _oracle(tiny_params, tiny_cfg, second, 4)

    split = _engine(tiny_params, tiny_cfg, **dict(kw, prefill_chunk_tokens=64))
    split.submit(first, 1)
    split.run(max_steps=100)
    snapshot = lambda e: np.asarray(
        e.snapshots.data[e.manager.snap_pool.lookup(e.manager.hashes(first)[64 // PAGE - 1])]
    )
    np.testing.assert_allclose(snapshot(eng), snapshot(split), atol=1e-5, rtol=1e-5)


def test_prefix_hit_through_the_pallas_kernels_equals_the_oracle(rng, tiny_cfg, tiny_params, monkeypatch):
    """The GPU path (interpret mode): prefill chunks continuing a cache run `mla_prefill_chunk`
    with the prefix length traced (the engine's jitted step); a second turn from a prefix hit
    keeps the oracle's tokens."""
    from pallas_kernels import mla

    chunk_prefixes = []
    real = mla.mla_prefill_chunk
    monkeypatch.setattr(mla, "mla_prefill_chunk", lambda *a, **kw: chunk_prefixes.append(a[3].lens) or real(*a, **kw))
    eng = _engine(tiny_params, tiny_cfg, kernels="pallas", prefill_chunk_tokens=64)  # one chunk a turn
    turn1 = rng.integers(0, 256, 4 * PAGE).tolist()
    r1 = eng.submit(turn1, 2)
    eng.run(max_steps=100)
    turn2 = turn1 + r1.output + rng.integers(0, 256, 14).tolist()
    r2 = eng.submit(turn2, 2)
    eng.run(max_steps=100)
    assert r2.cached_tokens == 4 * PAGE and chunk_prefixes  # turn 2: 16 new tokens after a 64-token hit
    assert r1.output == _oracle(tiny_params, tiny_cfg, turn1, 2)
    assert r2.output == _oracle(tiny_params, tiny_cfg, turn2, 2)


def test_a_decode_only_phase_chains_steps_on_the_device_buffers(rng, tiny_cfg, tiny_params):
    """Once only decode rows run, each step is dispatched on the previous step's device tokens
    (before the host reads them) and the decode buffers are rewritten only when a table gains a
    page or the batch changes: what keeps XLA's CUDA graph of the step from re-recording.  The
    tokens still equal the oracle's, also for the request that stops early."""
    eng = _engine(tiny_params, tiny_cfg)
    prompts = [rng.integers(0, 256, n).tolist() for n in (20, 20)]
    reqs = [eng.submit(p, n) for p, n in zip(prompts, (40, 25))]
    chained, chain = [], eng.scheduler.chain_plan
    eng.scheduler.chain_plan = lambda f: (lambda plan: plan and chained.append(1) or plan)(chain(f))
    eng.run(max_steps=200)
    decode_steps = 40 - 1
    assert len(chained) >= decode_steps - 6
    # first write, a page boundary every 16 tokens per row, the batch shrinking at 25 tokens
    assert eng.runner.decode.overwrites <= 8
    for req, p, n in zip(reqs, prompts, (40, 25)):
        assert req.output == _oracle(tiny_params, tiny_cfg, p, n)


def test_only_a_prompts_last_chunk_waits_for_its_logits(rng, tiny_cfg, tiny_params):
    """A 70-token prompt in chunks of at most 40 tokens (ending at snapshot boundaries): the
    earlier chunks' logits are never read, so the host does not wait for their calls (the device
    computes them while the host goes on); the last chunk's are read (and waited for) to choose
    the first token, which is the oracle's."""
    eng = _engine(tiny_params, tiny_cfg)
    outs, waited = [], []
    forward, wait = eng.runner.forward, eng.executor.wait_for
    eng.runner.forward = lambda *a, **k: outs.append(forward(*a, **k)) or outs[-1]
    eng.executor.wait_for = lambda arrays: waited.append(arrays) or wait(arrays)
    prompt = rng.integers(0, 256, 70).tolist()
    req = eng.submit(prompt, 6)
    eng.run(max_steps=50)
    assert all(isinstance(out[0], jax.Array) for out in outs)  # handed back on the device, not read
    assert len(outs) >= 2 and [any(w is out[0] for w in waited) for out in outs] == [False] * (len(outs) - 1) + [True]
    assert req.output == _oracle(tiny_params, tiny_cfg, prompt, 6)


def test_requests_waiting_for_a_slot_do_not_stop_the_chain(rng, tiny_cfg, tiny_params):
    """Five requests on four slots: while the fifth waits with every slot taken (it cannot be
    admitted), the decode steps still chain; it is admitted when a shorter one ends, and every
    request gets the oracle's tokens.  (The chain test's engine, prompt length and lengths: its
    programs and oracles.)"""
    eng = _engine(tiny_params, tiny_cfg)
    prompts = [rng.integers(0, 256, 20).tolist() for _ in range(5)]
    lengths = (40, 25, 25, 25, 25)
    chained, chain = [], eng.scheduler.chain_plan
    eng.scheduler.chain_plan = lambda f: (lambda plan: plan and chained.append(len(eng.waiting)) or plan)(chain(f))
    reqs = [eng.submit(p, n) for p, n in zip(prompts, lengths)]
    eng.run(max_steps=200)
    assert sum(1 for w in chained if w) >= 25 - 6  # chained with the fifth request waiting
    # the engine's step profile counts what ran: every chained step, and a wait on each one's tokens
    steps = eng.profile.as_dict()
    assert steps["chained"]["steps"] == len(chained) and steps["chained"]["wait_ms"] > 0
    assert sum(v["steps"] for v in steps.values()) == eng.profile.steps.total() and "prefill" in steps
    for req, p, n in zip(reqs, prompts, lengths):
        assert req.error is None and req.output == _oracle(tiny_params, tiny_cfg, p, n)


def test_hit_snapshots_are_held_until_restored_when_admissions_load_from_the_host(rng, tiny_cfg, tiny_params):
    """Three second turns admitted in one step, one of them hitting a snapshot the host tier
    loads back: a hit's snapshot block is not reused (by that load) before its slot is restored
    from it, so every turn equals the oracle."""
    eng = _engine(
        tiny_params, tiny_cfg, num_pages=64, num_snapshots=5, prefill_chunk_tokens=64, host=EmbeddedHostKVTier(1 << 26)
    )
    prompts = {k: rng.integers(0, 200, 33).tolist() for k in ("a", "b", "c")}
    for k in ("c", "a", "b"):  # c's snapshot is evicted to the host tier by the later ones
        eng.submit(prompts[k], 1, request_id=k)
        eng.run(50)
    turns = {k: eng.submit(p + [5] * 8, 4, request_id=f"{k}2") for k, p in prompts.items()}
    eng.run(100)
    for k, req in turns.items():
        assert req.cached_tokens == 32
        assert req.output == _oracle(tiny_params, tiny_cfg, prompts[k] + [5] * 8, 4)


def test_a_request_resumed_from_an_offload_is_not_preempted_before_its_kv_is_back(tiny_cfg, tiny_params):
    """Tight pages and a host tier: preempted requests come back from their offloaded KV and may
    be short of pages again at once; they wait a step instead of being preempted before their KV
    is installed.  Every request finishes with the tokens of an engine that never preempts."""
    rng = np.random.default_rng(1)  # a workload found to preempt requests right after their resume
    num_pages = int(rng.integers(6, 14))
    work = []
    for _ in range(int(rng.integers(2, 5))):
        prompt = rng.integers(0, 200, int(rng.integers(10, 40))).tolist()
        work.append((prompt, int(rng.integers(10, 60))))
    tight = _engine(
        tiny_params,
        tiny_cfg,
        num_pages=num_pages,
        num_snapshots=16,
        prefill_chunk_tokens=64,
        max_pages_per_request=None,
        host=EmbeddedHostKVTier(1 << 26),
    )
    roomy = _engine(tiny_params, tiny_cfg, num_pages=64, num_snapshots=16, prefill_chunk_tokens=64)
    got = [tight.submit(p, n) for p, n in work]
    want = [roomy.submit(p, n) for p, n in work]
    tight.run(max_steps=400)
    roomy.run(max_steps=400)
    assert tight.preemptions >= 1 and tight.offloaded_resumes >= 1
    assert [r.error for r in got] == [None] * len(work)
    assert [r.output for r in got] == [r.output for r in want]


# "all" (one stacked copy for decode too) is the non-default layout: slow, for the 20-minute suite
@pytest.mark.parametrize("scan", ["prefill", pytest.param("all", marks=pytest.mark.slow)])
def test_scanned_periods_serve_the_oracles_tokens_from_a_prefix_hit(rng, scan):
    """12 layers (two periods scanned in the prefill programs, `kimik3.stacked`): batched decode,
    chunked prefill and a second turn restored from a KDA snapshot and shared pages give the
    unrolled oracle's tokens."""
    import dataclasses

    from kimik3 import config, model, stacked
    from tests.conftest import perturb_identity_leaves

    cfg = dataclasses.replace(config.tiny(), n_layers=12)
    params = perturb_identity_leaves(model.init_params(cfg, jax.random.PRNGKey(4), "float32"), seed=9)
    with pytest.raises(ValueError, match="scan_layers"):
        _engine(params, cfg, scan_layers="sometimes")
    eng = _engine(params, cfg, scan_layers=scan)
    # prefill programs read the stacked periods; decode programs the unrolled layers unless "all"
    assert stacked.is_stacked(eng.runner.prefill_params) and stacked.is_stacked(eng.params) == (scan == "all")
    turn1 = tokenizer.apply_chat_template([tokenizer.Message("user", "y" * 70)])
    reqs = [eng.submit(turn1, 5), eng.submit(rng.integers(0, 256, 23).tolist(), 5)]
    eng.run(max_steps=100)
    turn2 = turn1 + reqs[0].output + tokenizer.apply_chat_template([tokenizer.Message("user", "z")])[1:]
    r2 = eng.submit(turn2, 4)
    eng.run(max_steps=100)
    assert r2.cached_tokens > 0
    for r in reqs + [r2]:
        assert r.error is None and r.output == _oracle(params, cfg, r.prompt, len(r.output))


def test_tenants_hit_only_their_own_prefix_cache(rng, tiny_cfg, tiny_params):
    """A prompt cached under one tenant's salt is no hit for another tenant (nor for the shared,
    unsalted cache), and the same tenant hits it; tokens are the oracle's either way."""
    eng = _engine(tiny_params, tiny_cfg)
    prompt = rng.integers(0, 256, 5 * PAGE).tolist()
    first = eng.submit(prompt, 3, cache_salt="tenant-a")
    eng.run(max_steps=100)
    others = [eng.submit(prompt, 3, cache_salt="tenant-b"), eng.submit(prompt, 3)]
    eng.run(max_steps=100)
    again = eng.submit(prompt, 3, cache_salt="tenant-a")
    eng.run(max_steps=100)
    assert first.cached_tokens == 0 and all(r.cached_tokens == 0 for r in others)
    assert again.cached_tokens >= 4 * PAGE
    want = _oracle(tiny_params, tiny_cfg, prompt, 3)
    assert all(r.output == want for r in [first, *others, again])
    for bad in ("", "x" * 300, 7):
        with pytest.raises(ValueError, match="cache_salt"):
            eng.submit(prompt, 3, cache_salt=bad)


def test_concurrent_pd_serves_late_arrivals_and_surfaces_an_engine_failure(rng, tiny_cfg, tiny_params):
    """Concurrent P/D: requests submitted while both engines' threads run (the client submits
    between `step` calls, as the demo does) equal the oracle; an exception in an engine's thread
    reaches the client's next call, names the engine thread, and stops both threads."""
    server = DisaggregatedServer(
        _engine(tiny_params, tiny_cfg, role="prefill"), _engine(tiny_params, tiny_cfg, role="decode"), concurrent=True
    )
    prompts = [rng.integers(0, 256, n).tolist() for n in (50, 20, 37)]
    reqs = [server.submit(prompts[0], 6)]
    with server:
        server.step()  # threads running from here
        reqs += [server.submit(p, 6) for p in prompts[1:]]
        for _ in range(100_000):
            if all(server.done(r.request_id) for r in reqs):
                break
            server.step()
    assert not server._threads
    for r, p in zip(reqs, prompts):
        assert server.requests[r.request_id].output == _oracle(tiny_params, tiny_cfg, p, 6)

    def broken():
        raise OSError("device lost")

    server.decode.step = broken
    server.submit(prompts[1], 3)
    with pytest.raises(RuntimeError, match="P/D engine thread failed.*device lost"):
        for _ in range(100_000):
            server.step()
    assert not server._threads


def test_concurrent_pd_with_each_engine_on_its_own_device(rng, tiny_cfg, tiny_params):
    """P/D on two devices in one process: each engine built with its params on its
    device and stepping under it; the handoff crosses devices through host memory; tokens equal
    the oracle's, and each engine's pools stay on its device."""
    import jax

    devices = jax.devices()[:2]
    engines = []
    for role, device in zip(("prefill", "decode"), devices):
        with jax.default_device(device):
            engines.append(_engine(jax.device_put(tiny_params, device), tiny_cfg, role=role))
    server = DisaggregatedServer(*engines, concurrent=True, devices=devices)
    prompts = [rng.integers(0, 256, n).tolist() for n in (45, 70)]
    reqs = [server.submit(p, 5) for p in prompts]
    done = server.run(max_steps=100_000)
    for r, p in zip(reqs, prompts):
        assert done[r.request_id].output == _oracle(tiny_params, tiny_cfg, p, 5)
    for engine, device in zip(engines, devices):
        assert {d for leaf in jax.tree.leaves(engine.kv.pools) for d in leaf.devices()} == {device}


def test_forged_store_pages_under_a_live_prompt_change_no_output(rng, tiny_cfg, tiny_params, mooncake_services):
    """A plain Mooncake client (the same library, no secret) overwrites every entry an engine
    published; a fresh engine serving the next turn gets the oracle's tokens, recomputing instead
    of reading the forgeries, and its tier counts them."""
    from cache.mooncake_tier import MooncakeHostKVTier
    from cache.store_forgery import forge_entries

    ns = f"tiny/forged-{rng.integers(1 << 30)}"
    tier_a = MooncakeHostKVTier(mooncake_services.master_addr, mooncake_services.metadata_url)
    eng_a = _engine(tiny_params, tiny_cfg, host=tier_a, publish_to_host=True, namespace=ns)
    turn1 = rng.integers(0, 256, 90).tolist()
    r1 = eng_a.submit(turn1, 3)
    eng_a.run(max_steps=100)
    tier_a.close()
    del eng_a
    forged = [k for k in forge_entries(mooncake_services, seed=1) if ns in k]
    assert forged, "the store held none of the engine's entries"
    tier_b = MooncakeHostKVTier(mooncake_services.master_addr, mooncake_services.metadata_url)
    eng_b = _engine(tiny_params, tiny_cfg, host=tier_b, namespace=ns)
    turn2 = turn1 + r1.output + rng.integers(0, 256, 7).tolist()
    r2 = eng_b.submit(turn2, 4)
    eng_b.run(max_steps=100)
    auth_failures = tier_b.stats.auth_failures
    tier_b.close()
    assert r2.output == _oracle(tiny_params, tiny_cfg, turn2, 4)
    assert r2.cached_tokens_host == 0 and auth_failures > 0


def test_every_step_is_one_plan_one_execution_and_one_update(rng, tiny_cfg, tiny_params):
    """Each step asks the scheduler for a plan (a chained one in a decode-only phase, else a fresh
    one after the in-flight tokens are applied), has the executor run it, and applies its output;
    no token reaches a request outside `update_from_output`."""
    eng = _engine(tiny_params, tiny_cfg)
    calls, outside, updating = [], [], [False]
    emit, update = eng.scheduler.emit, eng.scheduler.update_from_output

    def watched_update(out):
        calls.append("update")
        updating[0] = True
        try:
            update(out)
        finally:
            updating[0] = False

    def watched_emit(req, token, *a, **kw):
        if not updating[0]:
            outside.append(req.request_id)
        emit(req, token, *a, **kw)

    for obj, name in ((eng.scheduler, "chain_plan"), (eng.scheduler, "schedule"), (eng.executor, "execute")):
        fn = getattr(obj, name)
        setattr(obj, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    eng.scheduler.update_from_output, eng.scheduler.emit = watched_update, watched_emit
    prompts = [rng.integers(0, 256, n).tolist() for n in (20, 45, 9)]
    reqs = [eng.submit(p, n) for p, n in zip(prompts, (12, 5, 20))]
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    eng.settle()
    text = " ".join(calls)
    assert calls.count("execute") == steps and not outside
    # a step: chain_plan, then (when it declines) the in-flight tokens applied and a fresh plan
    per_step = [s for s in text.split("chain_plan ") if s]
    assert all(s.strip() in ("execute update", "update schedule execute update") for s in per_step[:-1])
    assert text.count("chain_plan execute") > 5  # the decode-only phase chains
    for req, p, n in zip(reqs, prompts, (12, 5, 20)):
        assert req.output == _oracle(tiny_params, tiny_cfg, p, n)
