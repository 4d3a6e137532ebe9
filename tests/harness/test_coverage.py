"""Coverage harness: cache rate rises from GPU-only to host offload to the shared store."""

from cache.mooncake_tier import MooncakeHostKVTier
from harness import coverage
from kimik3 import config
from serving.workload import WorkloadSpec, generate_sessions


def test_workload_is_seeded_and_shaped_like_design():
    spec = WorkloadSpec.scaled(8, sessions=3, seed=1)
    a, b = generate_sessions(spec), generate_sessions(spec)
    assert a == b
    for session in a:
        assert 20 <= len(session) <= 30
        for prev, nxt in zip(session, session[1:]):
            assert nxt.prompt[: len(prev.prompt) + len(prev.output)] == prev.prompt + prev.output  # history grows


def test_cache_rate_rises_gpu_then_host_then_shared(tmp_path, mooncake_services):
    cfg = config.tiny()
    workload = WorkloadSpec.scaled(16, sessions=6, turns=(8, 10))
    spec = coverage.CoverageSpec(engines=3)
    shared = MooncakeHostKVTier(mooncake_services.master_addr, mooncake_services.metadata_url)
    rows = [
        coverage.replay(cfg, workload, spec, "gpu"),
        coverage.replay(cfg, workload, spec, "host"),
        coverage.replay(cfg, workload, spec, "shared", shared),
    ]
    shared.close()
    gpu, host, shared_row = rows
    assert gpu.hit_tokens_host == 0 and host.hit_tokens_host > 0 and shared_row.hit_tokens_host > 0
    assert gpu.cache_rate < host.cache_rate < shared_row.cache_rate
    assert "| shared |" in coverage.format_table(rows)
    coverage.plot(rows, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 1000
