"""Configs: presets are valid, bad configs are refused, sizes match the public record."""

import jax
import pytest

from kimik3 import config, model, quantization, sizing


@pytest.mark.parametrize("name", sorted(config.PRESETS))
def test_presets_are_valid_and_round_trip_through_json(name):
    cfg = config.get_config(name)
    assert config.ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.mixer_kinds[:4] == ("kda", "kda", "kda", "mla")
    assert cfg.ffn_kind(0) == "dense" and all(cfg.ffn_kind(i) == "moe" for i in range(1, cfg.n_layers))


def test_kimi_k3_matches_the_stated_size():
    cfg = config.kimi_k3()
    assert (cfg.n_routed_experts, cfg.n_active_experts, cfg.n_shared_experts) == (896, 16, 2)
    assert abs(sizing.param_count(cfg) / 2.8e12 - 1) < 0.10
    assert abs(sizing.weight_bytes(cfg, quantization.KIMI_K3_MXFP4) / 1.6e12 - 1) < 0.10
    # MXFP4 experts are what make it fit: bf16 weights would be ~3.6x larger.
    assert sizing.weight_bytes(cfg, quantization.BF16) > 3 * sizing.weight_bytes(cfg)


def test_k3_slice_keeps_k3s_layers_and_needs_several_h200s():
    k3, cut = config.kimi_k3(), config.k3_slice()
    same = {f for f in k3.to_dict() if f not in ("name", "n_layers", "n_routed_experts")}
    assert {f: getattr(cut, f) for f in same} == {f: getattr(k3, f) for f in same}
    h200 = 141e9
    assert 4 * h200 < sizing.weight_bytes(cut, quantization.BF16) < 6 * h200
    assert sizing.weight_bytes(cut, quantization.KIMI_K3_MXFP4) > h200  # MXFP4 experts still need more than one
    assert cut.n_routed_experts % 16 == 0 and cut.n_layers % 4 == 0  # EP8 / EP16; whole [KDA x3, MLA] periods


def test_tiny_is_tiny_and_small_is_about_1b():
    assert sizing.param_count(config.tiny()) < 1_000_000
    assert 0.7e9 < sizing.param_count(config.small()) < 1.5e9


def test_param_count_equals_the_initialized_tree(tiny_cfg, tiny_params):
    assert sizing.param_count(tiny_cfg) == sum(x.size for x in jax.tree.leaves(tiny_params))


def test_weight_bytes_follow_the_manifest(tiny_cfg):
    all_fp32 = quantization.QuantManifest(default="fp32")
    assert sizing.weight_bytes(tiny_cfg, all_fp32) == 4 * sizing.param_count(tiny_cfg)
    assert sizing.weight_bytes(tiny_cfg, quantization.KIMI_K3_MXFP4) < sizing.weight_bytes(tiny_cfg, quantization.BF16)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_active_experts=9), "n_active_experts"),
        (dict(d_model=0), "d_model"),
        (dict(kda_gate_lower_bound=1.0), "kda_gate_lower_bound"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_inconsistent_config_raises_a_clear_error(change, message):
    with pytest.raises(ValueError, match=message):
        config.tiny().replace(**change)


def test_inconsistent_vit_config_raises():
    with pytest.raises(ValueError, match="patch_size"):
        config.ViTConfig(image_size=15, patch_size=4, width=32, depth=1, heads=2, mlp_dim=64)


def test_unknown_preset_and_unknown_weight_format_raise():
    with pytest.raises(ValueError, match="unknown config"):
        config.get_config("huge")
    with pytest.raises(ValueError, match="unknown weight format"):
        quantization.QuantManifest(default="int3")


def test_fp32_leaves_stay_fp32_in_bf16_params(tiny_cfg):
    abstract = model.abstract_params(tiny_cfg, "bfloat16")
    moe = abstract["layer_1"]["moe"]
    assert moe["w_router_de"].dtype == "float32" and moe["w_gate_elf"].dtype == "bfloat16"
