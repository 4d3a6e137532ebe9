"""The model suite's pieces that a CPU run of its ci preset does not reach (tests/benchmarks/test_run.py
runs that): two phases of rows (ours, then the twin filling them in), the check configs, the engine's
prefill chunks, the synthetic pools and the bytes a decode step moves at Kimi-Linear's shapes."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from benchmarks import kimi_linear as kl
from benchmarks import registry
from kimik3 import config, ops
from sharding import plan


CASES = (("tiny", "bf16", 1, 40), ("tiny", "bf16", 1, 100), ("tiny", "bf16", 4, 40))


def _ctx(**options):
    bench = registry.by_name()["kl_decode"]
    bench = dataclasses.replace(bench, shapes=dict(bench.shapes, ci=CASES))
    return registry.Context(bench, shapes="ci", options=options)


def _setting(ctx, end=math.inf):
    s = kl._setting(ctx)
    s.end = end
    return s


def _fake_runs(figures, check_ok=True, twin_check_ok=True):
    """arch_runs yielding a check and then, per run, figures[(role, B)] (ms, or a skip reason)."""

    def runs_of(cfg, manifest, runs, deadline):
        twin = cfg.mixer_kinds.count("kda") == 0
        yield "check", {"max_err": 0.0, "tol": 0.25, "ok": twin_check_ok if twin else check_ok}
        for run in runs:
            fig = figures[("twin" if twin else "ours", run[2])]
            yield run, {"skip": fig} if isinstance(fig, str) else {"ms": fig, "work": {"bytes": 1e6}, "extra": {}}

    return runs_of


def test_rows_come_out_with_ours_and_again_completed_by_the_twin():
    ctx = _ctx()
    figures = {("ours", 1): 1.0, ("ours", 4): 2.0, ("twin", 1): 3.0, ("twin", 4): "skipped: too big"}
    seen, peers = [], []
    for row in kl._two_phase(ctx, _setting(ctx), _fake_runs(figures)):
        seen.append(row)
        peers.append(row["peer_ms"])  # as the runner writes it at this yield
    first, second = seen[:3], seen[3:]
    assert [r["ours_ms"] for r in first] == [1.0, 1.0, 2.0] and peers == [None, None, None, 3.0, 3.0, None]
    assert [id(r) for r in second] == [id(r) for r in first]  # the same rows, yielded again
    done, _, too_big = second
    assert done["peer_ms"] == 3.0 and done["ratio"] == pytest.approx(1 / 3)
    assert done["extra"]["speedup_vs_twin"] == pytest.approx(3.0) and done["peer"] == "tiny_mla (all-MLA twin)"
    assert too_big["peer_ms"] is None and too_big["extra"]["peer_error"] == "skipped: too big"
    assert too_big["status"] == "ok" and done["extra"]["peer_check"]["ok"]


def test_a_twin_left_on_the_device_by_the_previous_benchmark_goes_first(monkeypatch):
    ctx = _ctx()
    s = _setting(ctx)
    monkeypatch.setitem(kl._HELD, "key", (config.all_mla(config.tiny()), "bf16", s.seed))
    order = []

    def runs_of(cfg, manifest, runs, deadline):
        order.append(cfg.name)
        yield from _fake_runs({("ours", 1): 1.0, ("ours", 4): 2.0, ("twin", 1): 4.0, ("twin", 4): 4.0})(
            cfg, manifest, runs, deadline
        )

    seen = [(row["ours_ms"], row["peer_ms"], row["status"]) for row in kl._two_phase(ctx, s, runs_of)]
    assert order == ["tiny_mla", "tiny"]
    assert seen[:3] == [(None, 4.0, "ok")] * 3  # the twin's figures first
    assert seen[3:] == [(1.0, 4.0, "ok"), (1.0, 4.0, "ok"), (2.0, 4.0, "ok")]


def test_a_failed_check_is_a_failed_row_and_nothing_is_timed():
    ctx = _ctx()
    figures = {("ours", b): "not timed: the check failed" for b in (1, 4)}
    rows = list(kl._two_phase(ctx, _setting(ctx), _fake_runs(figures, check_ok=False)))
    assert [r["status"] for r in rows] == ["failed"] * 3 and all(r["ours_ms"] is None for r in rows)
    twin_fails = {("ours", 1): 1.0, ("ours", 4): 1.0, ("twin", 1): 9.0, ("twin", 4): 9.0}
    rows = list(kl._two_phase(ctx, _setting(ctx), _fake_runs(twin_fails, twin_check_ok=False)))
    assert all(r["peer_ms"] is None and "check failed" in r["extra"]["peer_error"] for r in rows[3:])


def test_a_spent_budget_skips_the_twin_and_says_so():
    ctx = _ctx()
    figures = {("ours", 1): 1.0, ("ours", 4): 1.0}
    rows = list(kl._two_phase(ctx, _setting(ctx, end=0.0), _fake_runs(figures)))
    assert rows[0]["status"] == "skipped" and "budget" in rows[0]["extra"]["error"]  # past the end: ours too


def test_the_check_config_is_the_config_itself_when_small_else_the_same_variant_cut_down():
    tiny = config.tiny()
    assert kl.check_config(tiny) is tiny
    for cfg in (config.kimi_linear(), config.kimi_linear_mla()):
        small = kl.check_config(cfg)
        assert small.n_layers == 3 and small.n_routed_experts == 32 and small.vocab_size == 32768
        assert small.mixer_kinds == (("kda", "kda", "mla") if "kda" in cfg.mixer_kinds else ("mla",) * 3)
        keep = ("kda_gate", "mla_output_gate", "q_lora_rank", "moe_latent", "ffn_activation", "d_model", "mla_heads")
        assert all(getattr(small, f) == getattr(cfg, f) for f in keep)
        assert small.n_active_experts == 8 and kl.sizing.param_count(small) < 2e9


def test_prefill_chunks_export_at_the_engines_boundaries():
    # 128-token pages, 1536-token KDA blocks, 4096-token chunks: a 10000-token prompt
    chunks = kl._chunks(10000, 4096, 128, 1536, 4)
    assert [(a, b) for a, b, _ in chunks] == [(0, 4096), (4096, 8192), (8192, 10000)]
    assert chunks[0][2] == [1536, 3072]
    assert chunks[1][2] == [4608 - 4096, 6144 - 4096, 7680 - 4096]
    assert chunks[2][2] == [9216 - 8192, 9984 - 8192]  # a block boundary and the last full page


def test_synthetic_pools_are_deterministic_small_and_not_zero():
    cfg = config.tiny()
    kw = dict(cfg=cfg, num_pages=5, num_slots=3, page_tokens=16, dtype="float32", seed=0)
    a, b = kl.synthetic_pools(**kw), kl.synthetic_pools(**kw)
    pages = np.asarray(a["mla"]["pages"])
    np.testing.assert_array_equal(pages, np.asarray(b["mla"]["pages"]))
    assert 0.45 < np.abs(pages).max() <= 0.5 and abs(pages.mean()) < 0.02 and len(np.unique(pages)) > pages.size // 2
    assert np.abs(np.asarray(a["kda"]["state"])).max() <= 0.05
    assert not np.array_equal(pages[0], pages[1])  # no two pages alike
    other = np.asarray(kl.synthetic_pools(**dict(kw, seed=1))["mla"]["pages"])
    assert not np.array_equal(pages, other)


def test_a_decode_step_of_kimi_linear_moves_its_weights_kv_and_state():
    cfg, twin = config.kimi_linear(), config.kimi_linear_mla()
    ours, other = (kl.decode_work(c, "kimi_k3_mxfp4", 1, 1 << 20, "bfloat16") for c in (cfg, twin))
    assert ours["kv"] == (1 << 20) * 8064 and other["kv"] == (1 << 20) * 31104
    assert ours["state"] == 2 * plan.cache_bytes_per_request(cfg, 1)[1] and other["state"] == 0
    assert 3e9 < ours["weights"] < 5e9  # the non-expert weights (less the embedding) and 8 experts a layer
    assert ours["cache_bytes_per_token"] == pytest.approx(8064 + 43.4e6 / (1 << 20), rel=1e-3)
    # at 1M tokens the twin reads 2.9x the bytes (the weights read are about the same): the TPOT
    # ratio a step at the memory bound allows
    assert 2.8 < other["bytes"] / ours["bytes"] < 3.0


def test_prefill_flops_grow_quadratically_with_the_mla_layers():
    cfg, twin = config.kimi_linear(), config.kimi_linear_mla()
    t = 1 << 19
    attn = lambda c: c.mixer_kinds.count("mla") * c.mla_heads * 320 * float(t) ** 2
    assert kl.prefill_flops(twin, t, 4096) - kl.prefill_flops(cfg, t, 4096) == pytest.approx(
        attn(twin) - attn(cfg), rel=0.02
    )
    assert kl.prefill_flops(twin, t, 4096) > 5e16  # the twin at 512K: minutes on one GPU


def test_the_device_memory_is_unknown_on_the_cpu_and_everything_fits():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    assert kl.device_free_bytes() is None and kl._fits(10**15, None)
    assert not kl._fits(10**9, 10**9) and kl._fits(10**9, 10**9 + plan.RESERVE_BYTES)
    assert ops.resolve("auto") == "reference"
