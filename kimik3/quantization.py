"""Storage formats of weights and the manifest that assigns one to each param.

A manifest is an ordered list of (regex over the param path, format) rules;
the first match wins, else the default.  Bits per value include block scales:

* ``fp8``: e4m3 values with one fp32 scale per 128x128 block (DeepSeek-V3 style).
* ``mxfp4``: OCP microscaling, e2m1 values with one e8m0 scale per 32 values.
"""

from __future__ import annotations

import dataclasses
import re

BITS_PER_VALUE = {
    "fp32": 32.0,
    "bf16": 16.0,
    "fp8": 8.0 + 32.0 / (128 * 128),
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
# Kimi-K3 serving: routed experts in MXFP4, everything else bf16.
KIMI_K3_MXFP4 = QuantManifest(rules=(_FP32_RULE, (r"moe/w_(gate_elf|up_elf|out_efl)$", "mxfp4")), default="bf16")

MANIFESTS = {"bf16": BF16, "kimi_k3_mxfp4": KIMI_K3_MXFP4}
