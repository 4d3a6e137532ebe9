"""Benchmark scripts run end to end on `tiny` on the CPU: a script that breaks is caught here,
not on the GPU machine, where a run costs device time (a missing --out folder once cost one).
Only that they run and write what they promise is checked; their numbers mean nothing here.
Most are `slow` (the suite's 20 minutes): run ``KIMIK3_SLOW=1 ./run.sh test tests/benchmarks``
before a device call that runs them."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, tmp_path, timeout=600, **env_extra):
    # the run's compilation cache (tests/conftest.py) comes with os.environ; scripts that time
    # compiles (compile_time.py, init_time.py) turn it off themselves
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **env_extra)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow  # KIMIK3_SLOW=1: 21-24 s, one of the suite's slowest (the suite must stay under 20 min on 2 cores)
def test_serving_bench_writes_its_sections_and_the_step_hlo(tmp_path):
    out = tmp_path / "bench"  # does not exist yet: the script makes it
    _run(["benchmarks/serving_bench.py", "--config", "tiny", "--quick", "--modes", "", "--loads", "2",
          "--decode-batches", "2", "--dump-step-hlo", "--out", str(out)], tmp_path)
    rows = json.load(open(out / "serving_bench.json"))
    step = [r for r in rows if r["section"] == "decode step vs roofline"]
    assert step and step[0]["case"].startswith("B2") and step[0]["launches"] > 0
    assert step[0]["async_overwrites"] == 0  # the async loop chains on the device's own buffers
    assert (out / "decode_step_B2.hlo.txt").stat().st_size > 0


@pytest.mark.slow  # KIMIK3_SLOW=1: one of the suite's slowest (the suite must stay under 20 min on 2 cores)
@pytest.mark.parametrize("script", [["benchmarks/prefill_probe.py", "--config", "tiny"],
                                    ["benchmarks/compile_time.py", "--config", "tiny", "--repeats", "1"],
                                    ["benchmarks/bf16_drift.py", "--config", "tiny", "--tokens", "16"]])
def test_probe_scripts_run(script, tmp_path):
    assert _run(script, tmp_path).strip()


@pytest.mark.slow  # KIMIK3_SLOW=1: one of the suite's slowest (the suite must stay under 20 min on 2 cores)
def test_the_trained_bf16_check_writes_a_figure_per_position(tmp_path):
    out = tmp_path / "bf16"
    _run(["benchmarks/bf16_trained.py", "--config", "tiny", "--train-steps", "2", "--train-batch", "2",
          "--train-seq-len", "32", "--corpus", "licenses", "--prompts", "2", "--prompt-bytes", "16",
          "--positions", "3", "--out", str(out)], tmp_path)
    result = json.load(open(out / "bf16_trained.json"))
    assert len(result["mean_abs_err_per_position"]) == 3 and len(result["prompts"]) == 2
    assert result["training"]["steps_done"] == 2


@pytest.mark.slow  # KIMIK3_SLOW=1: one of the suite's slowest (the suite must stay under 20 min on 2 cores)
@pytest.mark.parametrize("script", [["benchmarks/init_time.py", "--config", "tiny", "--variants", "init_params"],
                                    ["benchmarks/host_rss.py", "--config", "tiny", "--no-engine", "--trim"],
                                    ["benchmarks/mla_fp32_dots.py", "--algorithms", "ieee"]])
def test_json_line_scripts_run_without_an_error_row(script, tmp_path):
    rows = [json.loads(line) for line in _run(script, tmp_path).splitlines() if line.startswith("{")]
    assert rows and not [r for r in rows if "error" in r]


@pytest.mark.slow  # KIMIK3_SLOW=1: one of the suite's slowest (the suite must stay under 20 min on 2 cores)
def test_the_moe_tiling_sweep_checks_each_tiling_against_the_default(tmp_path):
    out = tmp_path / "moe"
    _run(["benchmarks/moe_tune.py", "--quick", "--layers", "2", "--out", str(out)], tmp_path)
    rows = [r for r in json.load(open(out / "moe_tune.json")) if r["section"] == "tiling"]
    assert {r["gemm"] for r in rows} == {"gate/up", "down"}
    assert all(r["max_err"] <= 1e-2 and r["ms_per_layer"] > 0 for r in rows), rows  # bf16 sums, any tiling


@pytest.mark.slow  # KIMIK3_SLOW=1: one of the suite's slowest (the suite must stay under 20 min on 2 cores)
def test_the_kda_decode_sweep_checks_each_variant_against_the_default(tmp_path):
    out = tmp_path / "kda"
    _run(["benchmarks/kda_decode_tune.py", "--quick", "--layers", "1", "--heads", "2", "--head-dim", "16",
          "--out", str(out)], tmp_path)
    rows = [r for r in json.load(open(out / "kda_decode_tune.json")) if r["section"] == "kda decode"]
    assert len(rows) == 3 and all("error" not in r and r["us_per_layer"] > 0 for r in rows), rows
    assert all(r["rel_err"] < 1e-5 for r in rows if "rel_err" in r)


@pytest.mark.slow  # KIMIK3_SLOW=1: one of the suite's slowest (the suite must stay under 20 min on 2 cores)
def test_the_decode_ab_driver_reports_each_variant(tmp_path):
    out = tmp_path / "ab"
    _run(["benchmarks/decode_ab.py", "--config", "tiny", "--quick", "--decode-batches", "2", "--variants", "base",
          "--out", str(out)], tmp_path)
    (row,) = json.load(open(out / "decode_ab.json"))
    assert row["status"] == "ok" and row["B2 launches"] > 0 and row["B2 replay_ms"] > 0


@pytest.mark.slow  # KIMIK3_SLOW=1: one of the suite's slowest (the suite must stay under 20 min on 2 cores)
def test_the_serving_report_writes_issue_15s_figures(tmp_path):
    """The report the GPU run makes, on `tiny`: its bench part here; its demo part reads the demo's
    own text, which `tests/serving/test_engine.py`'s demo test parses with `demo_figures` (a
    cold and a warm tiny demo would add two minutes to the suite)."""
    out = tmp_path / "report"
    _run(["benchmarks/serving_small_report.py", "--config", "tiny", "--out", str(out), "--commit", "test",
          "--skip-demo"], tmp_path)
    report = json.load(open(out / "serving_small.json"))
    for key in ("decode_step_ms_b1", "decode_step_ms_b32", "roofline_ms_b32", "launches_per_step_b32"):
        assert isinstance(report.get(key), (int, float)), key
    assert report["commit"] == "test"


@pytest.mark.slow  # KIMIK3_SLOW=1: one of the suite's slowest (the suite must stay under 20 min on 2 cores)
def test_the_fault_drill_runs_its_three_phases(tmp_path):
    out = tmp_path / "drill"
    _run(["benchmarks/fault_drill.py", "--requests", "1", "--cooldown-s", "1", "--out", str(out)], tmp_path)
    rows = json.load(open(out / "fault_drill.json"))
    assert [r["phase"] for r in rows] == ["normal", "master killed (breaker open)", "after restart + cooldown"]
    # (whether a phase saw "degraded" depends on the launcher's restart racing the request: the
    # breaker's behaviour is checked deterministically in tests/cache/test_guarded_tier.py)


@pytest.mark.slow  # KIMIK3_SLOW=1: interpret mode of the Hopper kernels (the suite must stay under 20 min on 2 cores)
def test_the_moe_bench_runs_both_sections_on_every_kernel_of_ours(tmp_path):
    out = tmp_path / "moe"
    _run(["benchmarks/moe.py", "--quick", "--out", str(out)], tmp_path)
    rows = json.load(open(out / "moe_bench.json"))
    gemm = [r for r in rows if r["section"] == "grouped GEMM"]
    ffn = [r for r in rows if r["section"] == "grouped FFN"]
    assert gemm and all(k in gemm[0] for k in ("triton_ms", "hopper_ms", "hopper_padded_ms", "hopper_kernel_ms"))
    assert ffn and all(k in ffn[0] for k in ("triton_ms", "hopper_ms"))
    assert not [k for r in rows for k in r if k.endswith("_failed")]
    assert (out / "moe_bench.png").stat().st_size > 0


def test_the_moe_layout_bench_checks_every_way_of_filling_the_layout(tmp_path):
    out = tmp_path / "moe_layout"
    _run(["benchmarks/moe_layout.py", "--quick", "--out", str(out)], tmp_path)
    rows = json.load(open(out / "moe_layout.json"))
    assert len(rows) == 2  # the script asserts each variant's layout equal to the scatter's
    assert all(rows[0][f"{k}_us"] > 0 for k in ("scatter_in", "scatter_in_unique", "gather_in", "gather_out"))
    assert all(rows[1][f"{k}_us"] > 0 for k in ("scatter_in", "gather_in"))


@pytest.mark.slow  # KIMIK3_SLOW=1: every MLA code path in interpret mode (the suite must stay under 20 min on 2 cores)
def test_the_mla_bench_runs_every_section_at_toy_sizes(tmp_path):
    out = tmp_path / "mla"
    _run(["benchmarks/mla.py", "--tiny", "--out", str(out)], tmp_path)
    rows = json.load(open(out / "mla_bench.json"))
    assert {r["section"] for r in rows} >= {"roofline", "decode", "prefill", "chunk"}
    assert all(r["ours_ms"] > 0 for r in rows if r["section"] == "prefill")


@pytest.mark.slow  # KIMIK3_SLOW=1: two engines' compiles (the suite must stay under 20 min on 2 cores)
def test_serving_bench_runs_pd_with_an_engine_on_each_device(tmp_path):
    """Issue 23's P/D on two GPUs, rehearsed on two CPU devices: the prefill engine on device 0,
    the decode engine on device 1, each stepping in its own thread."""
    out = tmp_path / "pd"
    _run(["benchmarks/serving_bench.py", "--config", "tiny", "--quick", "--modes", "pd", "--pd-devices", "0,1",
          "--decode-batches", "2", "--compile-cache", "off", "--out", str(out)], tmp_path,
         XLA_FLAGS="--xla_force_host_platform_device_count=2")
    rows = json.load(open(out / "serving_bench.json"))
    loads = [r for r in rows if r["section"] == "load sweep"]
    assert [r["load"] for r in loads] == [1, 2] and all(r["mode"] == "pd" for r in loads)


@pytest.mark.slow  # KIMIK3_SLOW=1: every prefill tuning's interpret-mode kernels (the suite must stay under 20 min)
def test_the_kda_bench_times_every_prefill_tuning(tmp_path):
    out = tmp_path / "kda"
    _run(["benchmarks/kda.py", "--sections", "prefill", "--shapes", "1x256x2x32", "--out", str(out)], tmp_path)
    rows = json.load(open(out / "kda_bench.json"))
    tuned = [r for r in rows if r["section"] == "prefill tuning"]
    assert len(tuned) == 5 and not [r for r in tuned if "failed" in r]
    assert [r for r in rows if r["section"] == "prefill"]


@pytest.mark.slow  # KIMIK3_SLOW=1: interpret-mode KDA prefills (the suite must stay under 20 min on 2 cores)
def test_the_kda_export_probe_times_each_export_case_and_the_core_alone(tmp_path):
    out = tmp_path / "export"
    _run(["benchmarks/kda_export_probe.py", "--shapes", "1x256x2", "--head-dim", "16", "--iters", "1",
          "--out", str(out)], tmp_path)
    rows = json.load(open(out / "kda_export_probe.json"))
    assert [r["export"] for r in rows] == ["no export", "every 128", "every 128, V block 64", "every 128, V block 32",
                                           "every 1536"]
    assert [r["n_states"] for r in rows] == [0, 2, 2, 2, 0]
    assert all(r["ms"] > 0 and r["core_ms"] > 0 for r in rows)
