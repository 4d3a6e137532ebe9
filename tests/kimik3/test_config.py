"""Configs: presets are valid, bad configs are refused, sizes match the public record."""

import jax
import pytest

from kimik3 import config, model, quantization, sizing
from sharding import plan


@pytest.mark.parametrize("name", sorted(config.PRESETS))
def test_presets_are_valid_and_round_trip_through_json(name):
    cfg = config.get_config(name)
    assert config.ModelConfig.from_dict(cfg.to_dict()) == cfg
    twin = name.endswith("_mla")  # an all-MLA twin (`config.all_mla`)
    assert cfg.mixer_kinds[:4] == (("mla",) * 4 if twin else ("kda", "kda", "kda", "mla"))
    assert cfg.ffn_kind(0) == "dense" and all(cfg.ffn_kind(i) == "moe" for i in range(1, cfg.n_layers))


def _mixer_params(cfg, kind: str) -> int:
    """Parameters of the layers whose mixer is `kind`, their mixer (and its norm) only."""
    tree = model.abstract_params(cfg, "float32")
    return sum(
        x.size
        for i in range(cfg.n_layers)
        if cfg.mixer_kind(i) == kind
        for key in (kind, "mixer_norm")
        for x in jax.tree.leaves(tree[f"layer_{i}"][key])
    )


@pytest.mark.parametrize("make", [config.tiny, config.kimi_linear])
def test_the_all_mla_twin_differs_only_by_its_mixers(make):
    cfg = make()
    twin = config.all_mla(cfg)
    assert twin.name == f"{cfg.name}_mla" and twin.mixer_kinds == ("mla",) * cfg.n_layers
    assert config.all_mla(twin) is twin  # already all MLA
    same = {f for f in cfg.to_dict() if f not in ("name", "mixer_layout")}
    assert {f: getattr(twin, f) for f in same} == {f: getattr(cfg, f) for f in same}
    # the parameter counts differ by the KDA layers' mixers, each replaced by an MLA mixer
    n_kda = cfg.mixer_kinds.count("kda")
    per_mla = _mixer_params(twin, "mla") // cfg.n_layers
    per_kda = _mixer_params(cfg, "kda") // n_kda
    assert sizing.param_count(twin) - sizing.param_count(cfg) == n_kda * (per_mla - per_kda)
    # a cached token costs the twin every layer's latent (Kimi-Linear: 27 / 7 of its MLA part), and
    # the twin keeps no KDA state
    kv, state = plan.cache_bytes_per_request(cfg, 1)
    kv_twin, state_twin = plan.cache_bytes_per_request(twin, 1)
    assert kv_twin * cfg.mixer_kinds.count("mla") == kv * cfg.n_layers
    assert kv == cfg.mixer_kinds.count("mla") * cfg.mla_latent_dim * 2
    assert state > 0 and state_twin == 0


def test_kimi_linear_mla_is_the_preset_twin_of_kimi_linear():
    twin, cfg = config.get_config("kimi_linear_mla"), config.kimi_linear()
    assert twin == config.all_mla(cfg)
    assert (cfg.mixer_kinds.count("mla"), twin.mixer_kinds.count("mla")) == (7, 27)
    kv, kv_twin = (plan.cache_bytes_per_request(c, 1)[0] for c in (cfg, twin))
    assert kv_twin / kv == pytest.approx(27 / 7) and kv == 8064  # 7 x (512 + 64) bf16 values
    assert 1 - kv / kv_twin > 0.74  # the report's "up to 75% smaller"
    # the same size: the mixers are a small part of 49B parameters
    assert sizing.param_count(twin) == pytest.approx(sizing.param_count(cfg), rel=0.01)


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
