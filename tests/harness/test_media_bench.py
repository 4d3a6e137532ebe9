"""`kimik3 media-bench` (the media cache's ablation) on a small workload: every configuration gives the
same tokens, and each tier shows hits exactly where it is on."""

import json

from harness import media_bench


def test_the_ablation_runs_and_every_configuration_gives_the_same_tokens(tmp_path):
    spec = media_bench.MediaBenchSpec(sessions=1, turns=2, image_px=(96, 64), fetch_latency_ms=5.0)
    text = media_bench.main(spec, str(tmp_path / "rows.json"))  # raises if any tier changed a token
    rows = {r["config"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert (
        list(rows) == [name for name, _ in media_bench.CONFIGS] and "tokens equal across configurations: True" in text
    )
    assert all(r["tokens_equal_none"] and r["ttft_p50_ms"] > 0 for r in rows.values())
    none, all4 = rows["none"], rows["all"]
    assert none["l1_hit_rate"] == none["l2_hit_rate"] == none["l3_hit_rate"] == none["l4_hit_rate"] == 0
    assert none["fetches"] == none["images"] == 3  # 1 + 2 images
    # turn 2 resends turn 1's image: L1, L2 and L3 hit it; its prompt extends turn 1's (L4)
    assert rows["L1"]["fetches"] == 2 and rows["L1"]["l1_hit_rate"] > 0 and rows["L1"]["l2_hit_rate"] == 0
    assert rows["L1+L2"]["l2_hit_rate"] > 0 and rows["L1+L2"]["l3_hit_rate"] == 0
    assert rows["L1+L2+L3"]["l3_hit_rate"] > 0 and rows["L1+L2+L3"]["l4_hit_rate"] == 0
    assert all4["l4_hit_rate"] > 0
