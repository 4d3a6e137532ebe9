"""`kimik3.hf`: Hugging Face Kimi-Linear directories round-trip in both name sets (transformers'
and the Hub checkpoint's, one file or sharded), and a broken directory is a one-line
`CheckpointError` naming the file or tensor, found from the headers before any tensor is read.
`kimik3 generate --checkpoint DIR --prompt-ids ... --json --logits-out` prints what `generate`
computes.  (Logits against transformers itself: test_hf_reference.py.)"""

from __future__ import annotations

import json
import os
import struct

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kimik3 import config, hf, model
from kimik3.generate import generate


def small_kimi_linear() -> config.ModelConfig:
    """Kimi-Linear's switches at tiny sizes: MLA at 1-based 3 and 5 (the last), two dense layers."""
    return config.kimi_linear().replace(
        name="kl_small",
        vocab_size=300,
        d_model=32,
        n_layers=5,
        max_seq_len=4096,
        kda_heads=2,
        kda_head_dim=8,
        mla_heads=2,
        kv_lora_rank=16,
        qk_nope_dim=8,
        qk_rope_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_active_experts=2,
        moe_latent_dim=32,
        moe_expert_dim=16,
        moe_shared_dim=16,
        dense_ffn_dim=48,
        mixer_layout=("kda", "kda", "mla", "kda", "mla"),
        dense_layers=2,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def cfg_params():
    cfg = small_kimi_linear()
    params = model.init_params(cfg, jax.random.PRNGKey(3), "float32")
    return cfg, params


def _same(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("names, shard_bytes", [("transformers", 2 << 30), ("hub", 20_000)])
def test_save_then_load_gives_the_same_params_and_config(tmp_path, cfg_params, names, shard_bytes):
    cfg, params = cfg_params
    hf.save(str(tmp_path), params, cfg, names=names, max_shard_bytes=shard_bytes)
    sharded = os.path.exists(tmp_path / hf.INDEX)
    assert sharded == (shard_bytes < 1 << 20)
    loaded, cfg2 = hf.load(str(tmp_path), dtype="float32")
    assert cfg2.replace(name=cfg.name) == cfg
    _same(loaded, params)


def test_bf16_loading_keeps_the_router_and_gate_parameters_fp32(tmp_path, cfg_params):
    cfg, params = cfg_params
    hf.save(str(tmp_path), params, cfg)
    loaded, _ = hf.load(str(tmp_path), dtype="bfloat16")
    assert loaded["layer_2"]["moe"]["w_router_de"].dtype == np.float32
    assert loaded["layer_0"]["kda"]["a_log_h"].dtype == np.float32
    assert loaded["layer_0"]["kda"]["w_q_dhk"].dtype == jax.numpy.bfloat16


def _broken(tmp_path, cfg, params, edit):
    """A sharded Hub-named directory, then `edit(directory, shard files)` applied to it."""
    d = tmp_path / "broken"
    hf.save(str(d), params, cfg, names="hub", max_shard_bytes=20_000)
    shards = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))
    edit(d, shards)
    return str(d)


def _rewrite(d, shard, fn):
    tensors = load_file(str(d / shard))
    save_file(fn(tensors), str(d / shard), metadata={"format": "pt"})


def _rename(t, old, new):
    t[new] = t.pop(old)
    return t


def _first_with(d, shards, fragment):
    return next((s, n) for s in shards for n in load_file(str(d / s)) if fragment in n)


CASES = {
    "missing shard": (lambda d, s: os.remove(d / s[1]), r"shard missing"),
    "renamed tensor": (
        lambda d, s: _rewrite(
            d,
            _first_with(d, s, "kv_a_layernorm")[0],
            lambda t: _rename(t, _first_with(d, s, "kv_a_layernorm")[1], "model.layers.2.self_attn.kv_a_norm.weight"),
        ),
        r"unknown tensor model\.layers\.2\.self_attn\.kv_a_norm\.weight \(layer 2 is MLA",
    ),
    "wrong shape": (
        lambda d, s: _rewrite(
            d,
            _first_with(d, s, "b_proj")[0],
            lambda t: {n: (np.zeros((3, 32), np.float32) if "b_proj" in n else x) for n, x in t.items()},
        ),
        r"tensor model\.layers\.\d+\.self_attn\.b_proj\.weight has shape \(3, 32\); the config needs \(2, 32\)",
    ),
    "corrupt header": (
        lambda d, s: (d / s[0]).write_bytes(struct.pack("<Q", 999) + b"{not json" + b" " * 990),
        r"unreadable safetensors file",
    ),
    "missing expert": (
        lambda d, s: _rewrite(
            d,
            _first_with(d, s, "layers.4.block_sparse_moe.experts.3.w2")[0],
            lambda t: {n: x for n, x in t.items() if "layers.4.block_sparse_moe.experts.3.w2" not in n},
        ),
        r"tensor model\.layers\.4\.block_sparse_moe\.experts\.3\.w2\.weight is missing",
    ),
    "missing tensor": (
        lambda d, s: _rewrite(
            d, _first_with(d, s, "model.norm")[0], lambda t: {n: x for n, x in t.items() if n != "model.norm.weight"}
        ),
        r"tensor model\.norm\.weight is missing",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_broken_directory_is_one_line_naming_the_problem(tmp_path, cfg_params, case):
    cfg, params = cfg_params
    edit, message = CASES[case]
    d = _broken(tmp_path, cfg, params, edit)
    with pytest.raises(hf.CheckpointError, match=message) as e:
        hf.check(d)
    assert "\n" not in str(e.value)
    with pytest.raises(hf.CheckpointError, match=message):
        hf.load(d)


def test_the_dense_first_layers_load_under_either_prefix(tmp_path, cfg_params):
    """The Hub checkpoint's dense layers sit under ``mlp.``; exports of the remote code also
    write them under ``block_sparse_moe.``: both load."""
    cfg, params = cfg_params
    hf.save(str(tmp_path), params, cfg, names="hub")
    _rewrite(
        tmp_path,
        hf.SINGLE,
        lambda t: {n.replace("layers.1.mlp.", "layers.1.block_sparse_moe."): x for n, x in t.items()},
    )
    loaded, _ = hf.load(str(tmp_path), dtype="float32")
    _same(loaded, params)


def test_generate_prints_the_tokens_and_writes_the_logits(tmp_path, cfg_params, capsys):
    from serving.cli import main

    cfg, params = cfg_params
    hf.save(str(tmp_path / "m"), params, cfg)
    with open(tmp_path / "m" / "config.json") as f:
        assert json.load(f)["architectures"] == ["KimiLinearForCausalLM"]
    prompt = [5, 6, 7, 40, 41]
    rc = main(
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "m"),
            "--prompt-ids",
            ",".join(map(str, prompt)),
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--json",
            "--logits-out",
            str(tmp_path / "l.npy"),
        ]
    )
    assert rc == 0
    want = generate(params, cfg, prompt, 6, use_cache=True)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"tokens": want.tokens.tolist()}
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (6, cfg.vocab_size) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, want.logits, atol=1e-5)
    assert main(["generate", "--checkpoint", str(tmp_path / "m"), "--prompt-ids", "5,x"]) == 2
    assert "--prompt-ids: 'x' is not an integer id" in capsys.readouterr().err


def test_mxfp4_experts_quantized_on_the_way_in_are_what_quantize_stores(tmp_path):
    """experts="mxfp4": each routed-expert leaf is `formats.quantize` of the loaded weights (the
    bits `kimik3 quantize` writes), the rest as without it, and the model runs on them."""
    from kimik3.quant import formats

    cfg = small_kimi_linear().replace(moe_expert_dim=32, moe_shared_dim=32)  # MX blocks of 32 along K
    params = model.init_params(cfg, jax.random.PRNGKey(4), "float32")
    hf.save(str(tmp_path), params, cfg, names="hub", max_shard_bytes=20_000)
    plain, _ = hf.load(str(tmp_path), dtype="bfloat16")
    quant, _ = hf.load(str(tmp_path), dtype="bfloat16", experts="mxfp4")
    for name in hf.EXPERT_LEAVES:
        q, want = quant["layer_2"]["moe"][name], formats.quantize(plain["layer_2"]["moe"][name], "mxfp4")
        assert isinstance(q, formats.QTensor) and q.fmt == "mxfp4"
        np.testing.assert_array_equal(np.asarray(q.values), np.asarray(want.values))
        np.testing.assert_array_equal(np.asarray(q.scales, np.float32), np.asarray(want.scales, np.float32))
    _same(quant["layer_0"], plain["layer_0"])
    # the model on them is the model on their dequantized values
    dequantized = jax.tree.map(
        lambda x: formats.dequantize(x).astype(jax.numpy.bfloat16) if isinstance(x, formats.QTensor) else x,
        quant,
        is_leaf=lambda x: isinstance(x, formats.QTensor),
    )
    prompt = np.asarray([[5, 6, 7, 8]])
    logits_q, _ = model.forward(quant, cfg, prompt, kernels="reference")
    logits_d, _ = model.forward(dequantized, cfg, prompt, kernels="reference")
    np.testing.assert_allclose(np.asarray(logits_q), np.asarray(logits_d), atol=2e-2)  # bf16 GEMMs either way
