"""Storage formats of weights and the manifest that assigns one to each param.

A manifest is an ordered list of (regex over the param path, format) rules;
the first match wins, else the default.  Paths are the checkpoint layout's
(`kimik3.model.init_params`).  Bits per value include block scales:

* ``fp8``: e4m3 values with one fp32 scale per 128x128 block (DeepSeek-V3 style).
* ``mxfp8``: OCP microscaling, e4m3 values with one e8m0 scale per 32 along K.
* ``mxfp4``: OCP microscaling, e2m1 values with one e8m0 scale per 32 values.

The serving manifests (`kimik3 quantize` writes one checkpoint holding what all of them need,
`kimik3.quant_store`): ``fp8_attn`` / ``mxfp8_attn`` put the attention projections (KDA's q, k,
v, gate, beta and output-gate down-projections and its output; MLA's q (LoRA down and up), kv
latent, output gate and output) in FP8 or MXFP8 and the routed experts in MXFP4; the
``*_bf16_moe`` variants leave the MoE path as it is (bf16 experts, read from a checkpoint
written with ``--keep-bf16-experts``).  What stays bf16 everywhere: embeddings, norms, the
gates' low-rank up-projections, MLA's per-head key / value up-projections (the absorbed decode
reads them inside the attention kernel), shared experts, head; fp32: the router and KDA's gate
parameters.
"""

from __future__ import annotations

import dataclasses
import re

BITS_PER_VALUE = {
    "fp32": 32.0,
    "bf16": 16.0,
    "fp8": 8.0 + 32.0 / (128 * 128),
    "mxfp8": 8.0 + 8.0 / 32,
    "mxfp4": 4.0 + 8.0 / 32,
}


@dataclasses.dataclass(frozen=True)
class QuantManifest:
    rules: tuple[tuple[str, str], ...] = ()
    default: str = "bf16"

    def __post_init__(self):
        for pattern, fmt in self.rules + (("", self.default),):
            if fmt not in BITS_PER_VALUE:
                raise ValueError(f"unknown weight format {fmt!r}; known: {sorted(BITS_PER_VALUE)}")
            re.compile(pattern)

    def format_of(self, path: str) -> str:
        for pattern, fmt in self.rules:
            if re.search(pattern, path):
                return fmt
        return self.default


# Kept fp32 everywhere: the router and the KDA gate parameters (see
# kimik3.model.FP32_PARAM_PATTERN).
_FP32_RULE = (r"(w_router_de|router_bias_e|a_log_h|dt_bias_hk)$", "fp32")

BF16 = QuantManifest(rules=(_FP32_RULE,), default="bf16")
_EXPERTS = r"moe/w_(gate_elf|up_elf|out_efl)$"
# The attention projections a quantized manifest stores in FP8 / MXFP8 (see the module comment).
ATTENTION_PROJECTIONS = (
    r"kda/w_(q_dhk|k_dhk|v_dhv|fa_dr|beta_dh|ga_dr|o_hvd)$"
    r"|mla/w_(q_dhk|qa_dq|qb_qhk|kva_dr|gate_dhv|o_hvd)$"
)
# Kimi-K3 serving: routed experts in MXFP4, everything else bf16.
KIMI_K3_MXFP4 = QuantManifest(rules=(_FP32_RULE, (_EXPERTS, "mxfp4")), default="bf16")


def _attention(fmt: str, experts: str) -> QuantManifest:
    return QuantManifest(
        rules=(_FP32_RULE, (r"^vit/", "bf16"), (ATTENTION_PROJECTIONS, fmt), (_EXPERTS, experts)), default="bf16"
    )


MANIFESTS = {
    "bf16": BF16,
    "kimi_k3_mxfp4": KIMI_K3_MXFP4,
    "fp8_attn": _attention("fp8", "mxfp4"),
    "mxfp8_attn": _attention("mxfp8", "mxfp4"),
    "fp8_attn_bf16_moe": _attention("fp8", "bf16"),
    "mxfp8_attn_bf16_moe": _attention("mxfp8", "bf16"),
}
# The manifests a quantized checkpoint serves (`kimik3.quant_store`).
SERVING_MANIFESTS = ("fp8_attn", "mxfp8_attn", "fp8_attn_bf16_moe", "mxfp8_attn_bf16_moe")
