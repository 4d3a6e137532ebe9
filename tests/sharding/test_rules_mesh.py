"""Logical-axis rules, param placement, mesh validation and `kimik3 plan`."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kimik3 import config, model
from sharding import plan
from sharding.mesh import decode_mesh, parse_spec, prefill_mesh
from sharding.rules import DECODE_RULES, PREFILL_RULES, param_logical_axes, param_specs, shard_params


def test_every_param_has_logical_axes():
    for cfg in (config.tiny(), config.kimi_k3()):
        tree = model.abstract_params(cfg, "float32")
        axes = jax.tree_util.tree_leaves(param_logical_axes(tree), is_leaf=lambda a: isinstance(a, tuple))
        assert len(axes) == len(jax.tree_util.tree_leaves(tree))


def test_specs_follow_the_rules(tiny_cfg):
    tree = model.abstract_params(tiny_cfg, "float32")
    pre, dec = param_specs(tree, PREFILL_RULES), param_specs(tree, DECODE_RULES)
    heads = ("replica", "expert")
    assert pre["layer_0"]["kda"]["w_q_dhk"] == P(None, heads, None)
    assert pre["layer_0"]["kda"]["w_o_hvd"] == P(heads, None, None)
    assert pre["layer_0"]["kda"]["conv_q_wc"] == P(None, heads)
    assert pre["layer_3"]["mla"]["w_kb_rhn"] == P(None, heads, None)
    assert pre["layer_3"]["mla"]["w_kva_dr"] == P(None, None)  # the latent projection is shared by all heads
    assert dec["layer_0"]["kda"]["w_q_dhk"] == P(None, None, None)  # decode: attention replicated
    for specs in (pre, dec):
        assert specs["layer_1"]["moe"]["w_gate_elf"] == P("expert", None, None)
        assert specs["layer_1"]["moe"]["w_out_efl"] == P("expert", None, None)
        assert specs["layer_1"]["moe"]["w_router_de"] == P(None, None)  # every rank routes over all experts
        assert specs["embed_vd"] == P(None, None)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_placed_shards_have_the_rule_shapes(mode, tiny_cfg, tiny_params, devices):
    """Each device holds exactly the slice the rules give: heads / tp (prefill), experts / ep, else whole."""
    mesh = prefill_mesh(2, 2, devices[:2]) if mode == "prefill" else decode_mesh(4, 2, devices[:4])
    rules = PREFILL_RULES if mode == "prefill" else DECODE_RULES
    placed = shard_params(tiny_params, mesh, rules)
    axes = param_logical_axes(tiny_params)
    split = {"heads": 2 if mode == "prefill" else 1, "experts": 2}
    for (path, leaf), ax in zip(
        jax.tree_util.tree_leaves_with_path(placed),
        jax.tree_util.tree_leaves(axes, is_leaf=lambda a: isinstance(a, tuple)),
    ):
        want = tuple(n // split.get(a, 1) for n, a in zip(leaf.shape, ax))
        assert {s.data.shape for s in leaf.addressable_shards} == {want}, jax.tree_util.keystr(path)


def test_mesh_errors_name_the_axis(tiny_cfg, devices):
    with pytest.raises(ValueError, match="tp=4 does not divide kda_heads=2"):
        prefill_mesh(4, 2, devices[:4], cfg=tiny_cfg)
    with pytest.raises(ValueError, match="ep=3 does not divide n_routed_experts=8"):
        decode_mesh(3, 3, devices[:3], cfg=tiny_cfg)
    with pytest.raises(ValueError, match="ep=4 must divide tp=2"):
        prefill_mesh(2, 4, devices[:2])
    with pytest.raises(ValueError, match="tp=2 needs exactly 2 devices; got 4"):
        prefill_mesh(2, 2, devices[:4])
    with pytest.raises(ValueError, match="dp=4 needs exactly 4 devices; got 8"):
        decode_mesh(4, 2, devices)
    with pytest.raises(ValueError, match=r"dp=64 needs 64 devices; only \d+ available"):
        decode_mesh(64, 8)
    mesh = prefill_mesh(4, 2, devices[:4])
    assert dict(mesh.shape) == {"replica": 2, "expert": 2}
    assert list(mesh.devices.reshape(-1)) == list(devices[:4])


def test_parse_spec():
    s = parse_spec("tp8,ep8", "prefill")
    assert (s.size, s.ep, s.replicas) == (8, 8, 1)
    assert parse_spec("dp16", "decode").ep == 1
    for bad in ("tp8,ep8", "dp", "dp8,xx2"):
        with pytest.raises(ValueError, match="decode mesh"):
            parse_spec(bad, "decode")


def test_plan_cli_full_model(capsys):
    assert plan.main(["--config", "kimi_k3", "--prefill", "tp8,ep8", "--decode", "dp16,ep16", "--gpu", "gb300"]) == 0
    out = capsys.readouterr().out
    assert "prefill: tp8,ep8" in out and "decode: dp16,ep16" in out
    assert out.count("-> fits") == 2
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert kind in out


def test_plan_shows_what_each_manifest_frees_for_kv_on_a_decode_rank():
    from sharding.mesh import MeshShape

    cfg = config.get_config("kimi_k3")
    lines = plan.manifest_capacity(cfg, MeshShape("decode", 16, 16), 256, 32768, "gb300")
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == set(plan.CAPACITY_MANIFESTS)
    tokens = {name: int(line.split("GB")[-1].split("KV tokens")[0].replace(",", "")) for name, line in rows.items()}
    # FP8 attention frees more than MXFP4 experts alone; bf16 experts hold back the most
    assert tokens["fp8_attn"] > tokens["kimi_k3_mxfp4"] > tokens["fp8_attn_bf16_moe"] >= tokens["bf16"]


def test_plan_numbers(tiny_cfg):
    """Weights per rank = replicated leaves + split leaves / split; KV and all-to-all sizes from shapes."""
    from kimik3 import quantization
    from sharding.mesh import MeshShape

    shape = MeshShape("decode", 8, 8)
    mem = plan.memory(tiny_cfg, shape, batch=8, seq=1, context=64, manifest=quantization.BF16, act_dtype="float32")
    tree = model.abstract_params(tiny_cfg, "float32")
    flat = {
        jax.tree_util.keystr(p, simple=True, separator="/"): int(np.prod(x.shape))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }
    expert = sum(n for k, n in flat.items() if k.endswith(("_elf", "_efl")))
    fp32 = sum(n for k, n in flat.items() if quantization.BF16.format_of(k) == "fp32")
    rest = sum(flat.values()) - expert - fp32
    assert mem.weights == pytest.approx(expert * 2 / 8 + fp32 * 4 + rest * 2, abs=2)
    assert mem.kv_per_request == 1 * 64 * tiny_cfg.mla_latent_dim * 4
    assert mem.requests_per_rank == 1
    colls = plan.collectives(tiny_cfg, shape, 8, 1, "float32", "dense")
    assert [c.shape for c in colls[:3]] == [(8, 2), (8, 2, 32), (8, 2, 32)]  # ep=8, C = 1 token * top-2


def test_plan_bad_mesh_is_a_clear_error(capsys):
    assert plan.main(["--config", "kimi_k3", "--prefill", "tp7,ep7", "--decode", ""]) == 2
    assert "tp=7 does not divide kda_heads=64" in capsys.readouterr().err
