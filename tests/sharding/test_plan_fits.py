"""`kimik3 plan --fits`: what one GPU holds of a config and of its all-MLA twin (`sharding.plan.decode_fit`,
`fits_report`): the largest decode batch from the GPU's usable memory, a reserve, the weights and
per request its MLA KV, KDA state and logits row."""

import pytest

from kimik3 import config, quantization, sizing
from serving import kv_pools
from sharding import plan


def test_a_fit_counts_the_weights_once_and_each_request_its_cache_state_and_logits(tiny_cfg):
    fit = plan.decode_fit(tiny_cfg, "bf16", 64, memory_bytes=10**9, reserve_bytes=10**6)
    assert fit.weights == sizing.weight_bytes(tiny_cfg, quantization.BF16)
    assert fit.kv_per_request == 1 * 64 * tiny_cfg.mla_latent_dim * 2  # one MLA layer, bf16
    assert fit.state_per_request == kv_pools.bytes_per_state(tiny_cfg, "bfloat16")  # the engine's slot row
    assert fit.logits_per_request == tiny_cfg.vocab_size * 4
    assert fit.batch == (10**9 - 10**6 - fit.weights) // fit.per_request
    assert fit.total(fit.batch) <= 10**9 < fit.total(fit.batch + 1)
    assert plan.decode_fit(tiny_cfg, "bf16", 64, memory_bytes=fit.weights).batch == 0  # no room: none


def test_kimi_linear_on_one_h100_needs_mxfp4_experts_and_holds_more_requests_than_its_twin():
    cfg, twin = config.kimi_linear(), config.kimi_linear_mla()
    h100 = plan.USABLE_BYTES["h100"]
    assert h100 == pytest.approx(79.1 * 2**30) and plan.USABLE_BYTES["h200"] == pytest.approx(139 * 2**30)
    assert plan.decode_fit(cfg, "bf16", 4096, h100).batch == 0  # 98 GB of bf16 weights
    prev = None
    for ctx in plan.FIT_CONTEXTS:
        ours, other = (plan.decode_fit(c, "kimi_k3_mxfp4", ctx, h100) for c in (cfg, twin))
        assert ours.batch > other.batch >= 1  # even the twin serves one 1M-token request
        assert prev is None or ours.batch <= prev
        prev = ours.batch
    # at 1M the KV dominates: the batches go as the KV per token, 27 / 7
    ours, other = (plan.decode_fit(c, "kimi_k3_mxfp4", 1 << 20, h100) for c in (cfg, twin))
    assert other.kv_per_request / ours.kv_per_request == pytest.approx(27 / 7)
    assert (ours.batch, other.batch) == (6, 1)


def test_plan_fits_cli_prints_both_gpus_both_manifests_config_and_twin(capsys):
    assert plan.main(["--config", "kimi_linear", "--fits"]) == 0
    out = capsys.readouterr().out
    assert "kimi_linear (20 KDA + 7 MLA)" in out and "kimi_linear_mla" in out
    assert "79.1 GiB" in out and "139.0 GiB" in out and "4.0 GiB" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("h100 ", "h200 "))]
    assert [(r[0], r[1]) for r in rows] == [
        ("h100", "bf16"),
        ("h100", "kimi_k3_mxfp4"),
        ("h200", "bf16"),
        ("h200", "kimi_k3_mxfp4"),
    ]
    h100_mxfp4 = rows[1]
    cells = " ".join(h100_mxfp4[5:])  # after gpu, manifest and "weights / twin"
    assert cells.endswith("6 / 1")  # 1M: six requests, the twin one
    assert "0 / 0" in " ".join(rows[0])  # bf16 weights do not fit an H100
    assert plan.main(["--config", "tiny", "--fits", "--gpu", "h200"]) == 0  # one GPU
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines if line.startswith("h")] == ["h200", "h200"]


def test_plan_fits_names_the_gpus_it_knows(capsys):
    assert plan.main(["--config", "tiny", "--fits", "--gpu", "gb300"]) == 2
    assert "--fits knows the usable memory of" in capsys.readouterr().err
