"""One quantized checkpoint, every serving manifest (`kimik3.quant_store`): each manifest loads
from the same directory with the formats it names; every fused quantized projection group gives
its members' GEMMs bit for bit; the engine on quantized weights gives the no-cache oracle's tokens
on those weights; and a manifest that does not match the checkpoint, or a corrupt entry, is a
clear error at load."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from kimik3 import checkpoint, model, ops, quantization, sizing
from kimik3.generate import generate
from kimik3 import quant_store as store
from kimik3.quant import formats
from serving.engine import Engine


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_cfg, tiny_params):
    root = tmp_path_factory.mktemp("quant")
    checkpoint.save(root / "ckpt", tiny_params, tiny_cfg)
    record = store.quantize_checkpoint(root / "ckpt", root / "q", keep_bf16_experts=True)
    return root, record


def _leaf_formats(params):
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, formats.QTensor)):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        out[name] = leaf.fmt if isinstance(leaf, formats.QTensor) else "plain"
    return out


def test_one_checkpoint_serves_every_manifest_storing_each_tensor_once(quantized, tiny_cfg):
    root, record = quantized
    assert record["manifests"] == list(quantization.SERVING_MANIFESTS)
    # the experts are MXFP4 in fp8_attn and in mxfp8_attn: one copy
    experts = [p for p in record["entries"]["mxfp4"]]
    assert experts and all(p.endswith(("w_gate_elf", "w_up_elf", "w_out_efl")) for p in experts)
    assert set(record["entries"]) == {"fp8", "mxfp8", "mxfp4"}
    for name in record["manifests"]:
        params, cfg = store.load(root / "q", name, fuse=False)
        want = {p: quantization.MANIFESTS[name].format_of(p) for p in _leaf_formats(params)}
        got = _leaf_formats(params)
        assert {p for p, f in got.items() if f != "plain"} == {p for p, f in want.items() if f not in store.PLAIN}
        assert all(got[p] == f for p, f in want.items() if f not in store.PLAIN)
        assert ("mxfp4" in got.values()) == (not name.endswith("_bf16_moe"))
        # quant.json's bytes are what `kimik3 info` / plan count for this manifest
        assert record["bytes"][name] == pytest.approx(sizing.weight_bytes(cfg, quantization.MANIFESTS[name]), rel=1e-4)


@pytest.mark.parametrize("manifest", ["fp8_attn", "mxfp8_attn"])
@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_fused_quantized_groups_equal_their_members_bit_for_bit(rng, quantized, tiny_cfg, manifest, kernels):
    """KDA's q | k | v | f_a | beta | g_a and MLA's q_a | kv_a | gate as one quantized GEMM each
    vs each member's own GEMM, on the checkpoint's weights and fresh random activations."""
    root, _ = quantized
    fused_params, _ = store.load(root / "q", manifest)
    apart, _ = store.load(root / "q", manifest, fuse=False)
    groups = {
        "kda": ("w_q_dhk", "w_k_dhk", "w_v_dhv", "w_fa_dr", "w_beta_dh", "w_ga_dr"),
        "mla": ("w_qa_dq", "w_kva_dr", "w_gate_dhv"),
    }
    x = jnp.asarray(rng.standard_normal((2, 7, tiny_cfg.d_model)) * 3, jnp.float32)
    seen = set()
    for i in range(tiny_cfg.n_layers):
        for kind, members in groups.items():
            if kind not in apart[f"layer_{i}"]:
                continue
            fused_w = fused_params[f"layer_{i}"][kind]["w_in_dx"]
            assert isinstance(fused_w, formats.QTensor) and fused_w.fmt == manifest.split("_")[0]
            y = ops.linear(x, fused_w, kernels=kernels)
            start = 0
            for name in members:
                member = apart[f"layer_{i}"][kind][name]
                y_m = ops.linear(x, member, kernels=kernels)
                np.testing.assert_array_equal(np.asarray(y[..., start : start + member.shape[1]]), np.asarray(y_m))
                start += member.shape[1]
            assert start == fused_w.shape[1]
            seen.add(kind)
    assert seen == {"kda", "mla"}


@pytest.mark.parametrize("manifest", ["fp8_attn", "mxfp8_attn"])
def test_the_engine_on_quantized_weights_gives_the_oracles_tokens(rng, quantized, tiny_cfg, manifest):
    root, _ = quantized
    params, cfg = store.load(root / "q", manifest)
    eng = Engine(
        params,
        cfg,
        num_pages=48,
        num_slots=4,
        num_snapshots=12,
        page_tokens=16,
        kda_block_tokens=64,
        max_pages_per_request=16,
        prefill_chunk_tokens=40,
        kernels="reference",
    )
    assert "/q-" in eng.manager.spec.namespace and "mxfp4" in eng.manager.spec.namespace
    prompts = [rng.integers(0, 256, n).tolist() for n in (37, 70)]
    reqs = [eng.submit(p, 6) for p in prompts]
    eng.run(max_steps=200)
    for req, p in zip(reqs, prompts):
        assert req.done and req.error is None
        assert req.output == generate(params, cfg, p, 6).tokens.tolist()


def test_quantized_weights_stay_quantized_through_casts_and_give_nearby_logits(quantized, tiny_cfg, tiny_params):
    root, _ = quantized
    params, cfg = store.load(root / "q", "fp8_attn_bf16_moe")
    cast = model.cast_params(params, jnp.bfloat16)
    assert isinstance(cast["layer_0"]["kda"]["w_in_dx"], formats.QTensor)
    assert cast["layer_0"]["kda"]["w_in_dx"].values.dtype == jnp.float8_e4m3fn
    toks = jnp.asarray(np.arange(24, dtype=np.int32)[None] % 200)
    want = model.forward(tiny_params, tiny_cfg, toks)[0]
    got = model.forward(params, cfg, toks)[0]
    # FP8 attention projections only: the logits move by a few percent of their size, not more
    assert float(jnp.mean(jnp.abs(got - want))) < 0.25 * float(jnp.mean(jnp.abs(want)))


def _copy(root, name):
    dst = root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(root / "q", dst)
    return dst


def test_a_manifest_that_does_not_match_is_a_clear_error(quantized, tiny_cfg):
    root, _ = quantized
    with pytest.raises(ValueError, match="unknown manifest"):
        store.load(root / "q", "int4_everything")
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        store.load(root / "ckpt", "fp8_attn")
    with pytest.raises(ValueError, match="pass --manifest"):
        store.load_params(root / "q")
    no_bf16 = _copy(root, "no_bf16")
    rec = json.loads((no_bf16 / "quant.json").read_text())
    rec["manifests"] = ["fp8_attn", "mxfp8_attn"]
    (no_bf16 / "quant.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="keep-bf16-experts"):
        store.load(no_bf16, "fp8_attn_bf16_moe")
    shaped = _copy(root, "shaped")
    rec = json.loads((shaped / "quant.json").read_text())
    path = next(iter(rec["entries"]["fp8"]))
    rec["entries"]["fp8"][path] = [1, 1]
    (shaped / "quant.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=f"needs {path} in fp8"):
        store.load(shaped, "fp8_attn")
    other_cfg = _copy(root, "other_cfg")
    (other_cfg / "config.json").write_text(tiny_cfg.to_json().replace('"n_layers": 4', '"n_layers": 8'))
    with pytest.raises(ValueError, match="not the config the weights were quantized for"):
        store.load(other_cfg, "fp8_attn")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda s: s.at[0, 0].set(0.0), "non-finite or non-positive"),
        (lambda s: jnp.concatenate([s, s]), "scales for a"),
    ],
)
def test_a_corrupt_scale_tensor_is_refused_at_load(quantized, damage, match):
    root, _ = quantized
    bad = _copy(root, "bad")
    with ocp.StandardCheckpointer() as ckptr:
        tree = store._restore(str(bad), "fp8")
        entry = tree["layer_3"]["mla"]["w_kva_dr"]
        entry["scales"] = np.asarray(damage(jnp.asarray(entry["scales"])))
        shutil.rmtree(bad / "fp8")
        ckptr.save(os.path.join(bad, "fp8"), tree)
    with pytest.raises(ValueError, match=f"layer_3/mla/w_kva_dr: .*{match}"):
        store.load(bad, "fp8_attn")


def test_each_manifest_caches_under_its_own_namespace(quantized):
    """Workers serving one checkpoint as different manifests compute different KV (FP8 vs MXFP8
    projections): their cache namespaces differ, so a prefix from one is never a hit in another."""
    import argparse

    from serving import worker

    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    root, _ = quantized
    spaces = set()
    for argv in ([], ["--manifest", "fp8_attn"], ["--manifest", "mxfp8_attn"]):
        path = root / ("ckpt" if not argv else "q")
        args = parser.parse_args(
            ["--port", "1", "--num-pages", "8", "--kernels", "reference", "--checkpoint", str(path), *argv]
        )
        spaces.add(worker.build_engine(args)[2]["namespace"])
    assert len(spaces) == 3, spaces
