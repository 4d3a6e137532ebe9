"""Frozen model configurations and the presets (tiny, mini, small, kimi_k3, k3_slice, kimi_linear,
kimi_linear_mla).

Layer layout: by default layer i's token mixer is MLA when ``i % 4 == 3`` and KDA otherwise
(groups of [KDA, KDA, KDA, MLA], starting at layer 0); `mixer_layout` names every layer's mixer
instead (a checkpoint's own list, e.g. Kimi-Linear's MLA at 1-based 4, 8, ..., 24 and 27).  The
first `dense_layers` layers' FFN is a dense MLP and every later layer's is the MoE.

The model variant is a set of switches over the one model (the defaults are Kimi-K3's):

============================  ==========================  ===================================
switch                        Kimi-K3 (default)           Kimi-Linear (`kimik3.hf`)
============================  ==========================  ===================================
``kda_gate``                  ``"bounded"``:              ``"softplus"``:
                              lb * sigmoid(e^A (f + dt))  -e^A * softplus(f + dt)
``mla_output_gate``           True (sigmoid gate)         False
``q_lora_rank``               > 0                         0 (a direct q projection)
``moe_latent``                True (LatentMoE)            False (experts at d_model)
``ffn_activation``            ``"situ"`` (capped)         ``"silu"`` (SwiGLU)
``moe_biased_weights``        False                       False (the remote code: True)
``norm_eps`` / ``mla_norm_eps``
/ ``kda_norm_eps``            1e-6 everywhere             1e-5 / 1e-6 / 1e-5
============================  ==========================  ===================================
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
        _require(
            self.image_size % self.patch_size == 0,
            f"vit.image_size {self.image_size} is not a multiple of patch_size {self.patch_size}",
        )
        _require(
            self.patches_per_side % self.merge == 0,
            f"vit patches per side {self.patches_per_side} is not a multiple of merge {self.merge}",
        )
        _require(self.width % self.heads == 0, f"vit.width {self.width} is not divisible by vit.heads {self.heads}")
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
    norm_eps: float = 1e-6  # the blocks' pre-norms, the final norm, the MoE's latent norm
    # ---- variant switches (module docstring); the defaults are Kimi-K3's ----
    mixer_layout: tuple[str, ...] | None = None  # per layer "kda" | "mla"; None: [KDA, KDA, KDA, MLA] periods
    dense_layers: int = 1  # the first this many layers have the dense FFN
    kda_gate: str = "bounded"  # "bounded" | "softplus" (unbounded, Kimi-Linear)
    mla_output_gate: bool = True  # MLA's sigmoid output gate (w_gate_dhv)
    moe_latent: bool = True  # experts in a latent of moe_latent_dim (False: at d_model, no latent norm)
    ffn_activation: str = "situ"  # "situ": SiTU-GLU with the caps; "silu": SwiGLU
    moe_biased_weights: bool = False  # top-k weights from scores + correction bias (Kimi's remote code)
    mla_norm_eps: float | None = None  # MLA's q / kv latent norms (None: norm_eps)
    kda_norm_eps: float | None = None  # KDA's gated output norm (None: norm_eps)
    # Up to this many new tokens per sequence, cached MLA uses the absorbed
    # (latent MQA) form; beyond it, the naive expanded form.
    mla_absorb_max_tokens: int = 8
    dtype: str = "bfloat16"  # serving dtype; the oracle always runs fp32

    def __post_init__(self):
        positive = (
            "vocab_size",
            "d_model",
            "n_layers",
            "max_seq_len",
            "kda_heads",
            "kda_head_dim",
            "mla_heads",
            "kv_lora_rank",
            "qk_nope_dim",
            "qk_rope_dim",
            "v_head_dim",
            "dense_ffn_dim",
            "kda_conv_size",
            "kda_chunk_size",
        )
        for name in positive:
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _require(self.q_lora_rank >= 0, f"q_lora_rank must be >= 0, got {self.q_lora_rank}")
        _require(
            self.kda_gate_lower_bound < 0,
            f"kda_gate_lower_bound must be negative (a decay), got {self.kda_gate_lower_bound}",
        )
        if self.n_layers > self.dense_layers:
            _require(self.n_routed_experts > 0, "n_routed_experts must be positive when a layer has the MoE")
            _require(
                0 < self.n_active_experts <= self.n_routed_experts,
                f"n_active_experts ({self.n_active_experts}) must be in [1, n_routed_experts={self.n_routed_experts}]",
            )
            _require(self.n_shared_experts >= 0, "n_shared_experts must be >= 0")
            _require(
                self.moe_latent_dim > 0 and self.moe_expert_dim > 0,
                "moe_latent_dim and moe_expert_dim must be positive",
            )
            _require(
                self.n_shared_experts == 0 or self.moe_shared_dim > 0,
                "moe_shared_dim must be positive when there are shared experts",
            )
        _require(
            self.vocab_size >= _tokenizer_vocab_size(),
            f"vocab_size {self.vocab_size} is smaller than the tokenizer's {_tokenizer_vocab_size()} ids",
        )
        _require(self.dtype in ("float32", "bfloat16", "float16"), f"unknown dtype {self.dtype!r}")
        _require(self.mla_absorb_max_tokens >= 1, "mla_absorb_max_tokens must be >= 1")
        if self.mixer_layout is not None:
            _require(isinstance(self.mixer_layout, tuple), "mixer_layout must be a tuple (frozen configs hash)")
            _require(
                len(self.mixer_layout) == self.n_layers,
                f"mixer_layout names {len(self.mixer_layout)} layers; n_layers is {self.n_layers}",
            )
            bad = sorted({k for k in self.mixer_layout if k not in ("kda", "mla")})
            _require(not bad, f"mixer_layout holds {bad}; each entry must be 'kda' or 'mla'")
        _require(
            0 <= self.dense_layers <= self.n_layers,
            f"dense_layers must be in [0, n_layers={self.n_layers}], got {self.dense_layers}",
        )
        _require(
            self.kda_gate in ("bounded", "softplus"), f"kda_gate must be 'bounded' or 'softplus', got {self.kda_gate!r}"
        )
        _require(
            self.ffn_activation in ("situ", "silu"),
            f"ffn_activation must be 'situ' or 'silu', got {self.ffn_activation!r}",
        )
        for name in ("norm_eps", "mla_norm_eps", "kda_norm_eps"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{name} must be positive, got {value}")

    # ---- layout -------------------------------------------------------------------------------
    def mixer_kind(self, layer: int) -> str:
        """'kda' or 'mla' for layer `layer`."""
        if self.mixer_layout is not None:
            return self.mixer_layout[layer]
        return "mla" if layer % ATTENTION_PERIOD == ATTENTION_PERIOD - 1 else "kda"

    def ffn_kind(self, layer: int) -> str:
        """'dense' for the first `dense_layers` layers, 'moe' after."""
        return "dense" if layer < self.dense_layers else "moe"

    @property
    def mla_eps(self) -> float:
        """The eps of MLA's q / kv latent RMSNorms."""
        return self.norm_eps if self.mla_norm_eps is None else self.mla_norm_eps

    @property
    def kda_eps(self) -> float:
        """The eps of KDA's sigmoid-gated output RMSNorm."""
        return self.norm_eps if self.kda_norm_eps is None else self.kda_norm_eps

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
        if d.get("mixer_layout") is not None:  # JSON holds a list
            d["mixer_layout"] = tuple(d["mixer_layout"])
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
        name="tiny",
        vocab_size=288,
        d_model=64,
        n_layers=4,
        max_seq_len=1024,
        kda_heads=2,
        kda_head_dim=16,
        mla_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_dim=16,
        qk_rope_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_active_experts=2,
        n_shared_experts=1,
        moe_latent_dim=32,
        moe_expert_dim=32,
        moe_shared_dim=64,
        routed_scaling_factor=2.5,
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
        name="mini",
        vocab_size=288,
        d_model=512,
        n_layers=8,
        max_seq_len=4096,
        kda_heads=4,
        kda_head_dim=128,
        mla_heads=8,
        q_lora_rank=256,
        kv_lora_rank=256,
        qk_nope_dim=64,
        qk_rope_dim=32,
        v_head_dim=64,
        n_routed_experts=16,
        n_active_experts=4,
        n_shared_experts=1,
        moe_latent_dim=256,
        moe_expert_dim=256,
        moe_shared_dim=512,
        routed_scaling_factor=2.5,
        dense_ffn_dim=1536,
        vit=ViTConfig(image_size=112, patch_size=14, width=128, depth=2, heads=4, mlp_dim=512, merge=2),
        dtype="float32",
    )


def small() -> ModelConfig:
    """About 1B parameters: real kernel shapes (head_dim 128, latent 512+64) on one H200."""
    return ModelConfig(
        name="small",
        vocab_size=32_768,
        d_model=1536,
        n_layers=16,
        max_seq_len=65_536,
        kda_heads=12,
        kda_head_dim=128,
        mla_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        n_routed_experts=32,
        n_active_experts=4,
        n_shared_experts=1,
        moe_latent_dim=768,
        moe_expert_dim=768,
        moe_shared_dim=1536,
        routed_scaling_factor=2.5,
        dense_ffn_dim=4096,
        vit=ViTConfig(image_size=224, patch_size=14, width=384, depth=6, heads=6, mlp_dim=1536, merge=2),
        dtype="bfloat16",
    )


def kimi_k3() -> ModelConfig:
    """Full scale, for capacity planning and sharding plans (not for running)."""
    a = KIMI_K3_ASSUMPTIONS
    return ModelConfig(
        name="kimi_k3",
        vocab_size=a["vocab_size"],
        d_model=a["d_model"],
        n_layers=a["n_layers"],
        max_seq_len=a["max_seq_len"],
        kda_heads=a["kda_heads"],
        kda_head_dim=a["kda_head_dim"],
        mla_heads=a["mla_heads"],
        q_lora_rank=a["q_lora_rank"],
        kv_lora_rank=a["kv_lora_rank"],
        qk_nope_dim=a["qk_nope_dim"],
        qk_rope_dim=a["qk_rope_dim"],
        v_head_dim=a["v_head_dim"],
        n_routed_experts=896,
        n_active_experts=16,
        n_shared_experts=2,
        moe_latent_dim=a["moe_latent_dim"],
        moe_expert_dim=a["moe_expert_dim"],
        moe_shared_dim=a["moe_shared_dim"],
        routed_scaling_factor=a["routed_scaling_factor"],
        dense_ffn_dim=a["dense_ffn_dim"],
        situ_gate_cap=a["situ_gate_cap"],
        situ_up_cap=a["situ_up_cap"],
        vit=ViTConfig(
            image_size=a["vit_image_size"],
            patch_size=a["vit_patch_size"],
            width=a["vit_width"],
            depth=a["vit_depth"],
            heads=a["vit_heads"],
            mlp_dim=a["vit_mlp_dim"],
            merge=a["vit_merge"],
        ),
        dtype="bfloat16",
    )


def k3_slice() -> ModelConfig:
    """Kimi-K3's layer shapes (every width, head count, KDA / MLA dim, expert width and top-k of
    `kimi_k3`) with 16 layers and 384 routed experts: ~300B parameters, 601 GB of bf16 weights
    (4.3 H200s) or 175 GB with MXFP4 experts, so it fits no single GPU and needs the production
    layouts (TP8/EP8 prefill, DP8/EP8 decode) to run at all."""
    return kimi_k3().replace(name="k3_slice", n_layers=16, n_routed_experts=384)


def kimi_linear() -> ModelConfig:
    """Kimi-Linear-48B-A3B's shapes (its ``config.json``): 27 layers (MLA at 1-based 4, 8, ..., 24
    and 27), KDA 32 x 128 with the unbounded gate, MLA 32 heads with no q-LoRA and no output gate,
    256 SwiGLU experts top-8 at d_model + 1 shared, layer 0 dense (9216), vocab 163840; about
    49B parameters.  Random weights at these shapes serve planning and speed; `kimik3.hf` loads
    the real checkpoint (the same config, read from its directory)."""
    mla = {3, 7, 11, 15, 19, 23, 26}
    return ModelConfig(
        name="kimi_linear",
        vocab_size=163_840,
        d_model=2304,
        n_layers=27,
        max_seq_len=1_048_576,
        kda_heads=32,
        kda_head_dim=128,
        mla_heads=32,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_active_experts=8,
        n_shared_experts=1,
        moe_latent_dim=2304,
        moe_expert_dim=1024,
        moe_shared_dim=1024,
        routed_scaling_factor=2.446,
        dense_ffn_dim=9216,
        vit=None,
        norm_eps=1e-5,
        mixer_layout=tuple("mla" if i in mla else "kda" for i in range(27)),
        dense_layers=1,
        kda_gate="softplus",
        mla_output_gate=False,
        moe_latent=False,
        ffn_activation="silu",
        mla_norm_eps=1e-6,
        kda_norm_eps=1e-5,
        dtype="bfloat16",
    )


def all_mla(cfg: ModelConfig) -> ModelConfig:
    """The all-MLA twin of `cfg`: the same model with every token mixer MLA (``mixer_layout``
    ``("mla",) * n_layers``), named ``<name>_mla``; every other field, the FFNs included, is
    `cfg`'s, so the two differ only by their mixers' params and caches.  What the hybrid's speed
    and cache figures are measured against (`benchmarks/kimi_linear.py`, ``kimik3 plan --fits``).
    A config whose mixers are all MLA already comes back as it is."""
    layout = ("mla",) * cfg.n_layers
    if cfg.mixer_kinds == layout:
        return cfg
    return cfg.replace(name=f"{cfg.name}_mla", mixer_layout=layout)


def kimi_linear_mla() -> ModelConfig:
    """`kimi_linear`'s all-MLA twin (`all_mla`): its 27 layers all MLA, everything else the same;
    the full-attention model of the same size the Kimi Linear report compares against."""
    return all_mla(kimi_linear())


PRESETS = {
    "tiny": tiny,
    "mini": mini,
    "small": small,
    "kimi_k3": kimi_k3,
    "k3_slice": k3_slice,
    "kimi_linear": kimi_linear,
    "kimi_linear_mla": kimi_linear_mla,
}


def get_config(name: str) -> ModelConfig:
    """The preset `name` (a key of `PRESETS`: tiny, mini, small, kimi_linear, kimi_k3, ...) as a
    fresh `ModelConfig`; ValueError naming the presets for any other name."""
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
