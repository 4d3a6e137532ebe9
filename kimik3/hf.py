"""Hugging Face Kimi-Linear checkpoints (``KimiLinearForCausalLM``) in and out.

A model directory holds ``config.json``, ``model.safetensors`` or
``model.safetensors.index.json`` with its shards, and the tokenizer files (``tiktoken.model``,
``tokenizer_config.json``: `kimik3.text.load_tokenizer` reads them).

* `read_config(directory)` -> `ModelConfig`: the config's switches set for Kimi-Linear
  (`kimik3.config`'s table), the layer list from ``linear_attn_config`` (1-based) or
  ``layer_types``, the dense layers from ``first_k_dense_replace`` or ``mlp_layer_types``.
* `load(directory, dtype=)` -> (params, cfg): params in the checkpoint layout
  (`kimik3.model.init_params`'s tree), streamed shard by shard and tensor by tensor with the
  ``safetensors`` library straight into `dtype` on the device; a per-expert tensor of the Hub's
  layout fills its layer's stacked [E, ...] buffer, which goes to the device once whole.  No
  second full copy is ever held in host memory.
* `save(directory, params, cfg, names=)` writes the other way: transformers' names
  (``names="transformers"``, what ``save_pretrained`` writes) or the Hub checkpoint's
  (``names="hub"``: ``q_conv1d``, ``block_sparse_moe``, ``experts.N.w1``).

Both name sets load.  A tensor name nobody knows, a tensor the model needs that no shard holds,
a shape that disagrees with the config, a missing shard or a corrupt header is a `CheckpointError`
whose one line names it, raised before any request is served.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from kimik3.config import ModelConfig
from kimik3.model import FP32_PARAM_PATTERN
from kimik3.quant import formats

log = logging.getLogger(__name__)

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file or tensor."""


def is_hf_dir(path: str | os.PathLike | None) -> bool:
    """Whether `path` is a Hugging Face model directory (a config.json with a model_type, safetensors)."""
    if not path or not os.path.isdir(path) or not os.path.exists(os.path.join(path, CONFIG)):
        return False
    try:
        with open(os.path.join(path, CONFIG)) as f:
            return "model_type" in json.load(f)
    except (OSError, ValueError):
        return False


# ---- config -------------------------------------------------------------------------------------


def _get(hf: dict, *names, default=None):
    for n in names:
        if n in hf and hf[n] is not None:
            return hf[n]
    return default


def config_from_hf(
    hf: dict, *, name: str = "kimi_linear", dtype: str | None = None, biased_weights: bool = False
) -> ModelConfig:
    """The `ModelConfig` of a Kimi-Linear ``config.json`` (either key spelling transformers
    reads: ``num_experts`` / ``num_local_experts``, ``num_experts_per_token`` /
    ``num_experts_per_tok``, ...).  biased_weights: the checkpoint's remote code's routing rule
    (top-k weights read scores + bias); default transformers' and vLLM's (scores only)."""
    if hf.get("model_type") not in ("kimi_linear", None):
        raise CheckpointError(f"config.json: model_type {hf.get('model_type')!r} is not 'kimi_linear'")
    n_layers = int(_get(hf, "num_hidden_layers"))
    lin = hf.get("linear_attn_config") or {}
    if "full_attn_layers" in lin and "kda_layers" in lin:
        kinds = [None] * n_layers
        for i in lin["full_attn_layers"]:
            kinds[i - 1] = "mla"
        for i in lin["kda_layers"]:
            kinds[i - 1] = "kda"
        if None in kinds:
            raise CheckpointError(
                f"config.json: linear_attn_config names no mixer for 1-based layer {kinds.index(None) + 1}"
            )
    elif hf.get("layer_types"):
        kinds = ["mla" if t == "full_attention" else "kda" for t in hf["layer_types"]]
    else:
        raise CheckpointError(
            "config.json: neither linear_attn_config's kda_layers / full_attn_layers nor "
            "layer_types says which layers are KDA"
        )
    if hf.get("mlp_layer_types"):
        dense = [t == "dense" for t in hf["mlp_layer_types"]]
        n_dense = dense.index(False) if False in dense else len(dense)
        if any(dense[n_dense:]):
            raise CheckpointError(
                "config.json: mlp_layer_types puts a dense layer after a sparse one; only the first layers may be dense"
            )
    else:
        n_dense = int(_get(hf, "first_k_dense_replace", default=1))
    groups, topk_groups = int(_get(hf, "num_expert_group", "n_group", default=1)), _get(hf, "topk_group", default=1)
    if groups != 1 and topk_groups != groups:
        raise CheckpointError(
            f"config.json: group-limited routing ({groups} groups, top {topk_groups}) is not "
            f"supported; Kimi-Linear routes over one group"
        )
    if _get(hf, "moe_router_activation_func", default="sigmoid") != "sigmoid":
        raise CheckpointError("config.json: moe_router_activation_func must be 'sigmoid'")
    if not _get(hf, "moe_renormalize", "norm_topk_prob", default=True):
        raise CheckpointError("config.json: unnormalised top-k weights (moe_renormalize false) are not supported")
    if _get(hf, "hidden_act", default="silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf.get('hidden_act')!r}; Kimi-Linear's FFNs are SwiGLU")
    if hf.get("mla_use_nope") is False:
        raise CheckpointError("config.json: mla_use_nope false (rotary MLA) is not supported; Kimi-Linear is NoPE")
    if hf.get("attention_bias"):
        raise CheckpointError("config.json: attention_bias true is not supported")
    if hf.get("tie_word_embeddings"):
        raise CheckpointError("config.json: tied embeddings are not supported (Kimi-Linear has a separate lm_head)")
    head_dim = int(_get(lin, "head_dim", default=_get(hf, "linear_head_dim", default=128)))
    moe_dim = int(_get(hf, "moe_intermediate_size"))
    d_model = int(_get(hf, "hidden_size"))
    eps = float(_get(hf, "rms_norm_eps", default=1e-5))
    return ModelConfig(
        name=name,
        vocab_size=int(_get(hf, "vocab_size")),
        d_model=d_model,
        n_layers=n_layers,
        max_seq_len=int(_get(hf, "model_max_length", "max_position_embeddings", default=1 << 20)),
        kda_heads=int(_get(lin, "num_heads", default=_get(hf, "linear_num_heads", default=32))),
        kda_head_dim=head_dim,
        kda_conv_size=int(_get(lin, "short_conv_kernel_size", default=_get(hf, "linear_conv_kernel_dim", default=4))),
        mla_heads=int(_get(hf, "num_attention_heads")),
        q_lora_rank=int(_get(hf, "q_lora_rank", default=0)),
        kv_lora_rank=int(_get(hf, "kv_lora_rank")),
        qk_nope_dim=int(_get(hf, "qk_nope_head_dim")),
        qk_rope_dim=int(_get(hf, "qk_rope_head_dim")),
        v_head_dim=int(_get(hf, "v_head_dim")),
        n_routed_experts=int(_get(hf, "num_experts", "num_local_experts", "n_routed_experts")),
        n_active_experts=int(_get(hf, "num_experts_per_token", "num_experts_per_tok")),
        n_shared_experts=int(_get(hf, "num_shared_experts", "n_shared_experts", default=0)),
        moe_latent_dim=d_model,
        moe_expert_dim=moe_dim,
        moe_shared_dim=moe_dim,
        routed_scaling_factor=float(_get(hf, "routed_scaling_factor", default=1.0)),
        dense_ffn_dim=int(_get(hf, "intermediate_size")),
        vit=None,
        norm_eps=eps,
        mixer_layout=tuple(kinds),
        dense_layers=n_dense,
        kda_gate="softplus",
        mla_output_gate=False,
        moe_latent=False,
        ffn_activation="silu",
        moe_biased_weights=biased_weights,
        mla_norm_eps=1e-6,
        kda_norm_eps=eps,
        dtype=dtype or {"float32": "float32", "float16": "float16"}.get(_get(hf, "dtype", "torch_dtype"), "bfloat16"),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """A ``config.json`` for `cfg` that transformers' ``KimiLinearConfig`` reads (and `config_from_hf`)."""
    if not (
        cfg.kda_gate == "softplus"
        and not cfg.mla_output_gate
        and not cfg.moe_latent
        and cfg.ffn_activation == "silu"
        and cfg.vit is None
    ):
        raise ValueError(
            f"config {cfg.name!r} is not a Kimi-Linear variant (softplus gate, no MLA output gate, "
            f"no MoE latent, SwiGLU, no ViT): it has no Hugging Face layout"
        )
    if cfg.n_shared_experts and cfg.moe_shared_dim != cfg.moe_expert_dim:
        raise ValueError(
            "the HF layout sizes the shared experts by moe_intermediate_size: moe_shared_dim must equal moe_expert_dim"
        )
    kinds = cfg.mixer_kinds
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.dense_ffn_dim,
        "moe_intermediate_size": cfg.moe_expert_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.mla_heads,
        "num_key_value_heads": cfg.mla_heads,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_dim,
        "qk_rope_head_dim": cfg.qk_rope_dim,
        "v_head_dim": cfg.v_head_dim,
        "num_experts": cfg.n_routed_experts,
        "num_experts_per_token": cfg.n_active_experts,
        "num_shared_experts": cfg.n_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "hidden_act": "silu",
        "first_k_dense_replace": cfg.dense_layers,
        "rms_norm_eps": cfg.norm_eps,
        "model_max_length": cfg.max_seq_len,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": None,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "kda"],
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "mla"],
            "head_dim": cfg.kda_head_dim,
            "num_heads": cfg.kda_heads,
            "short_conv_kernel_size": cfg.kda_conv_size,
        },
        "dtype": cfg.dtype,
    }


def read_config(directory: str, **kw) -> ModelConfig:
    """`config_from_hf` of the directory's ``config.json`` (named after the directory)."""
    path = os.path.join(directory, CONFIG)
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (not a Hugging Face model directory)") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    kw.setdefault("name", os.path.basename(os.path.normpath(directory)))
    return config_from_hf(hf, **kw)


# ---- the tensor map -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """Where an HF tensor goes: `path` in the params tree (tuple of keys), `shape` the HF tensor's,
    `to_ours` (np array -> our layout), and for a per-expert tensor its `expert` index (the
    tensor fills row `expert` of the stacked [E, ...] leaf)."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    expert: int | None = None


def _t(x):
    return x.T


def _heads(*shape):
    """[out, in] Linear weight -> [in, *shape] (out split into heads)."""
    return lambda x: x.T.reshape((x.shape[1],) + shape)


def _tensor_map(cfg: ModelConfig, names: str) -> dict[str, Target]:
    """Every tensor of the checkpoint, by its name in `names` ("transformers" or "hub")."""
    d, hk, h, dk = cfg.d_model, cfg.kda_heads * cfg.kda_head_dim, cfg.kda_heads, cfg.kda_head_dim
    mh, qk, r, rope, nope, dv = (
        cfg.mla_heads,
        cfg.mla_qk_dim,
        cfg.kv_lora_rank,
        cfg.qk_rope_dim,
        cfg.qk_nope_dim,
        cfg.v_head_dim,
    )
    e, f = cfg.n_routed_experts, cfg.moe_expert_dim
    hub = names == "hub"
    out = {
        "model.embed_tokens.weight": Target(("embed_vd",), (cfg.vocab_size, d), lambda x: x),
        "model.norm.weight": Target(("final_norm", "scale"), (d,), lambda x: x),
        "lm_head.weight": Target(("lm_head_dv",), (cfg.vocab_size, d), _t),
    }
    for i in range(cfg.n_layers):
        pre, L = f"model.layers.{i}.", f"layer_{i}"
        add = lambda name, path, shape, fn, expert=None: out.__setitem__(
            pre + name, Target((L,) + path, shape, fn, expert)
        )
        add("input_layernorm.weight", ("mixer_norm", "scale"), (d,), lambda x: x)
        add("post_attention_layernorm.weight", ("ffn_norm", "scale"), (d,), lambda x: x)
        if cfg.mixer_kind(i) == "kda":
            a = "self_attn."
            for n, ours in (("q", "w_q_dhk"), ("k", "w_k_dhk"), ("v", "w_v_dhv")):
                add(f"{a}{n}_proj.weight", ("kda", ours), (hk, d), _heads(h, dk))
            if hub:
                for n in "qkv":
                    add(
                        f"{a}{n}_conv1d.weight",
                        ("kda", f"conv_{n}_wc"),
                        (hk, 1, cfg.kda_conv_size),
                        lambda x: x[:, 0, :].T,
                    )
            else:  # one depthwise conv over [q | k | v]: ours per group
                add(f"{a}conv1d.weight", ("kda", "conv_qkv"), (3 * hk, 1, cfg.kda_conv_size), lambda x: x[:, 0, :].T)
            fg = a if hub else a + "forget_gate."
            add(f"{fg}f_a_proj.weight", ("kda", "w_fa_dr"), (dk, d), _t)
            add(f"{fg}f_b_proj.weight", ("kda", "w_fb_rhk"), (hk, dk), _heads(h, dk))
            add(f"{fg}dt_bias", ("kda", "dt_bias_hk"), (hk,), lambda x: x.reshape(h, dk))
            add(f"{fg}A_log", ("kda", "a_log_h"), (1, 1, h, 1), lambda x: x.reshape(h))
            add(f"{a}b_proj.weight", ("kda", "w_beta_dh"), (h, d), _t)
            add(f"{a}g_a_proj.weight", ("kda", "w_ga_dr"), (dk, d), _t)
            add(f"{a}g_b_proj.weight", ("kda", "w_gb_rhv"), (hk, dk), _heads(h, dk))
            add(f"{a}o_norm.weight", ("kda", "o_norm_v"), (dk,), lambda x: x)
            add(f"{a}o_proj.weight", ("kda", "w_o_hvd"), (d, hk), lambda x: x.T.reshape(h, dk, d))
        else:
            a = "self_attn."
            if cfg.q_lora_rank:
                add(f"{a}q_a_proj.weight", ("mla", "w_qa_dq"), (cfg.q_lora_rank, d), _t)
                add(f"{a}q_a_layernorm.weight", ("mla", "q_norm"), (cfg.q_lora_rank,), lambda x: x)
                add(f"{a}q_b_proj.weight", ("mla", "w_qb_qhk"), (mh * qk, cfg.q_lora_rank), _heads(mh, qk))
            else:
                add(f"{a}q_proj.weight", ("mla", "w_q_dhk"), (mh * qk, d), _heads(mh, qk))
            add(f"{a}kv_a_proj_with_mqa.weight", ("mla", "w_kva_dr"), (r + rope, d), _t)
            add(f"{a}kv_a_layernorm.weight", ("mla", "kv_norm"), (r,), lambda x: x)
            add(f"{a}kv_b_proj.weight", ("mla", "kv_b"), (mh * (nope + dv), r), lambda x: x)  # split below
            add(f"{a}o_proj.weight", ("mla", "w_o_hvd"), (d, mh * dv), lambda x: x.T.reshape(mh, dv, d))
        if cfg.ffn_kind(i) == "dense":
            for hub_prefix in ("mlp.",) + (("block_sparse_moe.",) if hub else ()):
                for n, ours, shape in (
                    ("gate", "w_gate_df", (cfg.dense_ffn_dim, d)),
                    ("up", "w_up_df", (cfg.dense_ffn_dim, d)),
                    ("down", "w_out_fd", (d, cfg.dense_ffn_dim)),
                ):
                    add(f"{hub_prefix}{n}_proj.weight", ("mlp", ours), shape, _t)
        else:
            m = "block_sparse_moe." if hub else "mlp."
            add(f"{m}gate.weight", ("moe", "w_router_de"), (e, d), _t)
            add(f"{m}gate.e_score_correction_bias", ("moe", "router_bias_e"), (e,), lambda x: x)
            if hub:
                for j in range(e):
                    add(f"{m}experts.{j}.w1.weight", ("moe", "w_gate_elf"), (f, d), _t, j)
                    add(f"{m}experts.{j}.w3.weight", ("moe", "w_up_elf"), (f, d), _t, j)
                    add(f"{m}experts.{j}.w2.weight", ("moe", "w_out_efl"), (d, f), _t, j)
            else:
                add(f"{m}experts.gate_up_proj", ("moe", "gate_up"), (e, 2 * f, d), lambda x: x)  # split below
                add(f"{m}experts.down_proj", ("moe", "w_out_efl"), (e, d, f), lambda x: np.swapaxes(x, 1, 2))
            if cfg.n_shared_experts:
                fs = cfg.n_shared_experts * cfg.moe_shared_dim
                for n, ours, shape in (
                    ("gate", "w_gate_df", (fs, d)),
                    ("up", "w_up_df", (fs, d)),
                    ("down", "w_out_fd", (d, fs)),
                ):
                    add(f"{m}shared_experts.{n}_proj.weight", ("moe", "shared", ours), shape, _t)
    return out


# HF tensors that hold several of our leaves: the fused q | k | v conv, kv_b (W_UK | W_UV per
# head), the experts' gate | up (`_split` takes them apart, `_from_ours` puts them together)
COMPOSITE = {
    "conv_qkv": ("conv_q_wc", "conv_k_wc", "conv_v_wc"),
    "kv_b": ("w_kb_rhn", "w_vb_rhv"),
    "gate_up": ("w_gate_elf", "w_up_elf"),
}


def _split(cfg: ModelConfig, path: tuple[str, ...], x: np.ndarray) -> dict[tuple[str, ...], np.ndarray]:
    """Tensors that are several of ours: the fused q|k|v conv, kv_b (W_UK | W_UV per head), the
    experts' gate | up.  Others pass through."""
    *pre, leaf = path
    pre = tuple(pre)
    if leaf == "conv_qkv":  # [W, 3HK]
        hk = cfg.kda_heads * cfg.kda_head_dim
        return {pre + (f"conv_{n}_wc",): x[:, j * hk : (j + 1) * hk] for j, n in enumerate("qkv")}
    if leaf == "kv_b":  # [H*(nope+v), r] -> [r, H, nope], [r, H, v]
        per_head = x.reshape(cfg.mla_heads, cfg.qk_nope_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return {
            pre + ("w_kb_rhn",): np.transpose(per_head[:, : cfg.qk_nope_dim], (2, 0, 1)),
            pre + ("w_vb_rhv",): np.transpose(per_head[:, cfg.qk_nope_dim :], (2, 0, 1)),
        }
    if leaf == "gate_up":  # [E, 2F, D] -> [E, D, F] twice
        f = cfg.moe_expert_dim
        return {pre + ("w_gate_elf",): np.swapaxes(x[:, :f], 1, 2), pre + ("w_up_elf",): np.swapaxes(x[:, f:], 1, 2)}
    return {path: x}


# ---- reading ------------------------------------------------------------------------------------


def _shards(directory: str) -> list[str]:
    """The safetensors files of a directory (from its index when there is one), each checked to exist."""
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(directory, SINGLE)):
        files = [SINGLE]
    else:
        raise CheckpointError(f"{directory}: neither {INDEX} nor {SINGLE}")
    for name in files:
        if not os.path.exists(os.path.join(directory, name)):
            raise CheckpointError(f"{os.path.join(directory, name)}: shard missing (named by {INDEX})")
    return [os.path.join(directory, n) for n in files]


def _open(path: str):
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({str(e).splitlines()[0]})") from None


def _headers(directory: str) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(shard path, name, shape) of every tensor, from the shards' headers only."""
    for path in _shards(directory):
        with _open(path) as f:
            for name in f.keys():
                yield path, name, tuple(f.get_slice(name).get_shape())


def _tensors(directory: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every tensor, one at a time, shard by shard."""
    for path in _shards(directory):
        with _open(path) as f:
            for name in f.keys():
                try:
                    yield name, f.get_tensor(name)
                except (SafetensorError, OSError, ValueError) as e:
                    raise CheckpointError(f"{path}: tensor {name} unreadable ({str(e).splitlines()[0]})") from None


def _leaf_dtype(path: tuple[str, ...], dtype) -> np.dtype:
    """The dtype a leaf is served in: `dtype`, except the leaves the model keeps fp32."""
    return np.dtype(np.float32) if FP32_PARAM_PATTERN.search("/".join(path)) else np.dtype(dtype)


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _target(cfg: ModelConfig, maps: dict, directory: str, name: str, shape: tuple[int, ...]) -> Target:
    target = maps["transformers"].get(name) or maps["hub"].get(name)
    if target is None:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        i = int(layer.group(1)) if layer else None
        hint = (
            f" (layer {i} is {cfg.mixer_kind(i).upper()} with a {cfg.ffn_kind(i)} FFN)"
            if i is not None and i < cfg.n_layers
            else ""
        )
        raise CheckpointError(f"{directory}: unknown tensor {name}{hint}")
    if shape != target.shape:
        raise CheckpointError(f"{directory}: tensor {name} has shape {shape}; the config needs {target.shape}")
    return target


def _leaves_of(cfg: ModelConfig, target: Target) -> tuple[tuple[str, ...], ...]:
    """The param leaves one tensor sets (the fused conv, kv_b and gate_up set several)."""
    *pre, last = target.path
    return tuple(tuple(pre) + (leaf,) for leaf in COMPOSITE.get(last, (last,)))


def check(directory: str, cfg: ModelConfig | None = None) -> ModelConfig:
    """Validate a model directory from its config and the shards' headers alone (no tensor data
    is read): every shard present and readable, every tensor known with the config's shape, none
    twice, none missing.  Returns its config; raises `CheckpointError` naming the first problem."""
    cfg = cfg or read_config(directory)
    maps = {n: _tensor_map(cfg, n) for n in ("transformers", "hub")}
    filled: dict[tuple, str] = {}
    for _, name, shape in _headers(directory):
        target = _target(cfg, maps, directory, name, shape)
        keys = [target.path + (target.expert,)] if target.expert is not None else list(_leaves_of(cfg, target))
        for key in keys:
            if key in filled:
                raise CheckpointError(f"{directory}: tensor {name} sets what {filled[key]} sets already")
            filled[key] = name
    for name, target in maps["transformers"].items():
        for leaf in _leaves_of(cfg, target):
            if leaf in filled:
                continue
            hub = [(n, t) for n, t in maps["hub"].items() if t.path == leaf]
            if hub and all(t.expert is not None for _, t in hub):
                absent = [n for n, t in hub if leaf + (t.expert,) not in filled]
                if not absent:
                    continue
                raise CheckpointError(
                    f"{directory}: tensor {absent[0]} is missing"
                    + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else "")
                )
            raise CheckpointError(f"{directory}: tensor {name} is missing")
    return cfg


EXPERT_LEAVES = ("w_gate_elf", "w_up_elf", "w_out_efl")


def load(
    directory: str,
    *,
    dtype=None,
    device=None,
    biased_weights: bool = False,
    cfg: ModelConfig | None = None,
    experts: str | None = None,
):
    """(params, cfg) of a Kimi-Linear model directory (see the module docstring); params in the
    checkpoint layout, each leaf in `dtype` (default the config's; the router and the KDA gate's
    parameters stay fp32) on `device` (default JAX's first).  The directory is `check`ed whole
    from its headers before any tensor is read.

    experts: None, or "mxfp4": the routed experts quantized on the way in (each stacked leaf,
    once whole, goes to the device in fp32 and comes back a `kimik3.quant.formats.QTensor`, as
    `kimik3 quantize` stores them): the 48B model's weights in ~29 GB instead of ~98 GB, so it
    loads onto one H100 without a full bf16 copy ever on the device."""
    if experts not in (None, "mxfp4"):
        raise ValueError(f"experts must be None or 'mxfp4'; got {experts!r}")
    cfg = check(directory, cfg or read_config(directory, biased_weights=biased_weights))
    dtype = jnp.dtype(dtype or cfg.dtype)
    device = device or jax.devices()[0]
    maps = {n: _tensor_map(cfg, n) for n in ("transformers", "hub")}
    params: dict = {}
    pending: dict[tuple[str, ...], tuple[np.ndarray, int]] = {}  # stacked expert leaves being filled

    def put(path, x):
        if experts and path[-1] in EXPERT_LEAVES:
            value = formats.quantize(jax.device_put(np.asarray(x, np.float32), device), experts)
        else:
            value = jax.device_put(np.ascontiguousarray(x, _leaf_dtype(path, dtype)), device)
        _set(params, path, value)

    n_bytes = n_tensors = 0
    for name, x in _tensors(directory):
        target = _target(cfg, maps, directory, name, tuple(x.shape))
        n_bytes, n_tensors = n_bytes + x.nbytes, n_tensors + 1
        if target.expert is not None:  # a row of a stacked leaf: to the device once every row is in
            buf, rows = pending.get(target.path, (None, 0))
            row = target.to_ours(x)
            if buf is None:
                buf = np.empty((cfg.n_routed_experts,) + row.shape, _leaf_dtype(target.path, dtype))
            buf[target.expert] = row
            pending[target.path] = (buf, rows + 1)
            if rows + 1 == cfg.n_routed_experts:
                put(target.path, pending.pop(target.path)[0])
            continue
        for path, value in _split(cfg, target.path, target.to_ours(x)).items():
            put(path, value)
    log.info("loaded %s: %d tensors, %.2f GB from safetensors", directory, n_tensors, n_bytes / 1e9)
    return params, cfg


# ---- writing ------------------------------------------------------------------------------------


def _from_ours(cfg: ModelConfig, params, names: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, HF array) of every tensor, in `names`' spelling."""

    def leaf(path):
        x = params
        for k in path:
            x = x[k]
        return np.asarray(jax.device_get(x))

    d = cfg.d_model
    for name, t in _tensor_map(cfg, names).items():
        if "block_sparse_moe." in name and t.path[1] == "mlp":  # the dense layers' alias prefix: written once
            continue
        *pre, last = t.path
        pre = tuple(pre)
        if last == "conv_qkv":
            x = np.concatenate([leaf(pre + (f"conv_{n}_wc",)) for n in "qkv"], axis=1)  # [W, 3HK]
            yield name, x.T[:, None, :]
        elif last == "kv_b":
            kb, vb = leaf(pre + ("w_kb_rhn",)), leaf(pre + ("w_vb_rhv",))  # [r, H, nope], [r, H, v]
            yield name, np.transpose(np.concatenate([kb, vb], axis=2), (1, 2, 0)).reshape(-1, cfg.kv_lora_rank)
        elif last == "gate_up":
            g, u = leaf(pre + ("w_gate_elf",)), leaf(pre + ("w_up_elf",))  # [E, D, F]
            yield name, np.concatenate([np.swapaxes(g, 1, 2), np.swapaxes(u, 1, 2)], axis=1)
        elif t.expert is not None:
            yield name, leaf(t.path)[t.expert].T
        else:
            x = leaf(t.path)
            if last == "w_out_efl":
                yield name, np.swapaxes(x, 1, 2)
            elif last in ("a_log_h",):
                yield name, x.reshape(1, 1, -1, 1)
            elif last in ("dt_bias_hk",):
                yield name, x.reshape(-1)
            elif last.startswith("conv_"):
                yield name, x.T[:, None, :]
            elif x.ndim == 1 or last == "embed_vd":
                yield name, x
            elif last in ("w_o_hvd",):
                yield name, x.reshape(-1, d).T
            else:  # [in, ...out] -> Linear [out, in]
                yield name, x.reshape(x.shape[0], -1).T


def save(
    directory: str, params, cfg: ModelConfig, *, names: str = "transformers", max_shard_bytes: int = 2 << 30
) -> None:
    """Write params (checkpoint layout) as a Hugging Face Kimi-Linear directory: config.json and
    safetensors shards of at most `max_shard_bytes` (an index when there are several)."""
    if names not in ("transformers", "hub"):
        raise ValueError(f"names must be 'transformers' or 'hub'; got {names!r}")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(config_to_hf(cfg), f, indent=2)
    shards, current, size = [], {}, 0
    for name, x in _from_ours(cfg, params, names):
        x = np.ascontiguousarray(x)
        if current and size + x.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = x
        size += x.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, SINGLE), metadata={"format": "pt"})
        return
    weight_map = {}
    for j, shard in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(
            {"metadata": {"total_size": sum(x.nbytes for s in shards for x in s.values())}, "weight_map": weight_map},
            f,
            indent=2,
        )
