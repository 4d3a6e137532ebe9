"""Frozen model configurations and the three presets: tiny, small, kimi_k3.

Layer layout: layer i's token mixer is MLA when ``i % 4 == 3`` and KDA
otherwise (groups of [KDA, KDA, KDA, MLA], starting at layer 0); layer 0's FFN
is a dense MLP and every later layer's FFN is the LatentMoE.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kimik3.assumptions import KIMI_K3_ASSUMPTIONS

ATTENTION_PERIOD = 4  # [KDA, KDA, KDA, MLA]


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Vision encoder: square RGB images -> `tokens_per_image` embeddings."""

    image_size: int
    patch_size: int
    width: int
    depth: int
    heads: int
    mlp_dim: int
    merge: int = 2  # pixel-shuffle merge: merge x merge patches -> one token
    channels: int = 3

    def __post_init__(self):
        _require(self.image_size % self.patch_size == 0,
                 f"vit.image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        _require(self.patches_per_side % self.merge == 0,
                 f"vit patches per side {self.patches_per_side} is not a multiple of merge {self.merge}")
        _require(self.width % self.heads == 0,
                 f"vit.width {self.width} is not divisible by vit.heads {self.heads}")
        for name in ("image_size", "patch_size", "width", "depth", "heads", "mlp_dim", "merge", "channels"):
            _require(getattr(self, name) > 0, f"vit.{name} must be positive, got {getattr(self, name)}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def tokens_per_image(self) -> int:
        return (self.patches_per_side // self.merge) ** 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """All sizes of the hybrid model.  Validated on construction."""

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    max_seq_len: int
    # KDA
    kda_heads: int
    kda_head_dim: int
    # MLA (DeepSeek-V3 shapes; q_lora_rank 0 means a direct query projection)
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    # LatentMoE
    n_routed_experts: int
    n_active_experts: int
    n_shared_experts: int
    moe_latent_dim: int
    moe_expert_dim: int
    moe_shared_dim: int
    routed_scaling_factor: float
    dense_ffn_dim: int
    vit: ViTConfig | None = None
    # fixed by the design
    kda_conv_size: int = 4
    kda_chunk_size: int = 64
    kda_gate_lower_bound: float = -5.0
    situ_gate_cap: float = 10.0
    situ_up_cap: float = 10.0
    norm_eps: float = 1e-6
    # Up to this many new tokens per sequence, cached MLA uses the absorbed
    # (latent MQA) form; beyond it, the naive expanded form.
    mla_absorb_max_tokens: int = 8
    dtype: str = "bfloat16"  # serving dtype; the oracle always runs fp32

    def __post_init__(self):
        positive = ("vocab_size", "d_model", "n_layers", "max_seq_len", "kda_heads", "kda_head_dim",
                    "mla_heads", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim",
                    "dense_ffn_dim", "kda_conv_size", "kda_chunk_size")
        for name in positive:
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _require(self.q_lora_rank >= 0, f"q_lora_rank must be >= 0, got {self.q_lora_rank}")
        _require(self.kda_gate_lower_bound < 0,
                 f"kda_gate_lower_bound must be negative (a decay), got {self.kda_gate_lower_bound}")
        if self.n_layers > 1:
            _require(self.n_routed_experts > 0, "n_routed_experts must be positive when n_layers > 1")
            _require(0 < self.n_active_experts <= self.n_routed_experts,
                     f"n_active_experts ({self.n_active_experts}) must be in [1, n_routed_experts="
                     f"{self.n_routed_experts}]")
            _require(self.n_shared_experts >= 0, "n_shared_experts must be >= 0")
            _require(self.moe_latent_dim > 0 and self.moe_expert_dim > 0,
                     "moe_latent_dim and moe_expert_dim must be positive")
            _require(self.n_shared_experts == 0 or self.moe_shared_dim > 0,
                     "moe_shared_dim must be positive when there are shared experts")
        _require(self.vocab_size >= _tokenizer_vocab_size(),
                 f"vocab_size {self.vocab_size} is smaller than the tokenizer's {_tokenizer_vocab_size()} ids")
        _require(self.dtype in ("float32", "bfloat16", "float16"), f"unknown dtype {self.dtype!r}")
        _require(self.mla_absorb_max_tokens >= 1, "mla_absorb_max_tokens must be >= 1")

    # ---- layout -------------------------------------------------------------------------------
    def mixer_kind(self, layer: int) -> str:
        """'kda' or 'mla' for layer `layer`."""
        return "mla" if layer % ATTENTION_PERIOD == ATTENTION_PERIOD - 1 else "kda"

    def ffn_kind(self, layer: int) -> str:
        """'dense' for layer 0, 'moe' after."""
        return "dense" if layer == 0 else "moe"

    @property
    def mixer_kinds(self) -> tuple[str, ...]:
        return tuple(self.mixer_kind(i) for i in range(self.n_layers))

    @property
    def mla_qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def mla_latent_dim(self) -> int:
        """Values cached per token per MLA layer: c_kv ++ k_pe."""
        return self.kv_lora_rank + self.qk_rope_dim

    # ---- serialization ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("vit") is not None:
            d["vit"] = ViTConfig(**d["vit"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _tokenizer_vocab_size() -> int:
    from kimik3.tokenizer import VOCAB_SIZE  # local: tokenizer has no model deps, avoids a cycle

    return VOCAB_SIZE


# ---- presets --------------------------------------------------------------------------------


def tiny() -> ModelConfig:
    """CPU tests: ~0.2M parameters, every layer kind present, runs in seconds."""
    return ModelConfig(
        name="tiny", vocab_size=288, d_model=64, n_layers=4, max_seq_len=1024,
        kda_heads=2, kda_head_dim=16,
        mla_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=16, v_head_dim=16,
        n_routed_experts=8, n_active_experts=2, n_shared_experts=1,
        moe_latent_dim=32, moe_expert_dim=32, moe_shared_dim=64, routed_scaling_factor=2.5,
        dense_ffn_dim=128,
        vit=ViTConfig(image_size=16, patch_size=4, width=32, depth=1, heads=2, mlp_dim=64, merge=2),
        mla_absorb_max_tokens=4,
        dtype="float32",
    )


def mini() -> ModelConfig:
    """Training on one GPU (`kimik3 train`): every layer kind, byte-level vocabulary, 43.5M
    parameters (26M active), meant to reach a plateau on Debian's Python documentation within
    one short H200 run (not yet measured)."""
    return ModelConfig(
        name="mini", vocab_size=288, d_model=512, n_layers=8, max_seq_len=4096,
        kda_heads=4, kda_head_dim=128,
        mla_heads=8, q_lora_rank=256, kv_lora_rank=256, qk_nope_dim=64, qk_rope_dim=32, v_head_dim=64,
        n_routed_experts=16, n_active_experts=4, n_shared_experts=1,
        moe_latent_dim=256, moe_expert_dim=256, moe_shared_dim=512, routed_scaling_factor=2.5,
        dense_ffn_dim=1536,
        vit=ViTConfig(image_size=112, patch_size=14, width=128, depth=2, heads=4, mlp_dim=512, merge=2),
        dtype="float32",
    )


def small() -> ModelConfig:
    """About 1B parameters: real kernel shapes (head_dim 128, latent 512+64) on one H200."""
    return ModelConfig(
        name="small", vocab_size=32_768, d_model=1536, n_layers=16, max_seq_len=65_536,
        kda_heads=12, kda_head_dim=128,
        mla_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
        n_routed_experts=32, n_active_experts=4, n_shared_experts=1,
        moe_latent_dim=768, moe_expert_dim=768, moe_shared_dim=1536, routed_scaling_factor=2.5,
        dense_ffn_dim=4096,
        vit=ViTConfig(image_size=224, patch_size=14, width=384, depth=6, heads=6, mlp_dim=1536, merge=2),
        dtype="bfloat16",
    )


def kimi_k3() -> ModelConfig:
    """Full scale, for capacity planning and sharding plans (not for running)."""
    a = KIMI_K3_ASSUMPTIONS
    return ModelConfig(
        name="kimi_k3", vocab_size=a["vocab_size"], d_model=a["d_model"], n_layers=a["n_layers"],
        max_seq_len=a["max_seq_len"],
        kda_heads=a["kda_heads"], kda_head_dim=a["kda_head_dim"],
        mla_heads=a["mla_heads"], q_lora_rank=a["q_lora_rank"], kv_lora_rank=a["kv_lora_rank"],
        qk_nope_dim=a["qk_nope_dim"], qk_rope_dim=a["qk_rope_dim"], v_head_dim=a["v_head_dim"],
        n_routed_experts=896, n_active_experts=16, n_shared_experts=2,
        moe_latent_dim=a["moe_latent_dim"], moe_expert_dim=a["moe_expert_dim"],
        moe_shared_dim=a["moe_shared_dim"], routed_scaling_factor=a["routed_scaling_factor"],
        dense_ffn_dim=a["dense_ffn_dim"],
        situ_gate_cap=a["situ_gate_cap"], situ_up_cap=a["situ_up_cap"],
        vit=ViTConfig(image_size=a["vit_image_size"], patch_size=a["vit_patch_size"], width=a["vit_width"],
                      depth=a["vit_depth"], heads=a["vit_heads"], mlp_dim=a["vit_mlp_dim"], merge=a["vit_merge"]),
        dtype="bfloat16",
    )


def k3_slice() -> ModelConfig:
    """Kimi-K3's layer shapes (every width, head count, KDA / MLA dim, expert width and top-k of
    `kimi_k3`) with 16 layers and 384 routed experts: ~300B parameters, 601 GB of bf16 weights
    (4.3 H200s) or 175 GB with MXFP4 experts, so it fits no single GPU and needs the production
    layouts (TP8/EP8 prefill, DP8/EP8 decode) to run at all."""
    return kimi_k3().replace(name="k3_slice", n_layers=16, n_routed_experts=384)


PRESETS = {"tiny": tiny, "mini": mini, "small": small, "kimi_k3": kimi_k3, "k3_slice": k3_slice}


def get_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
