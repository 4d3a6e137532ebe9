"""Parameter counts and weight bytes, read off the abstract param tree.

Counting from `jax.eval_shape` of the real init (rather than a formula kept
beside the model) means the numbers cannot drift from the model.
"""

from __future__ import annotations

import math

import jax

from kimik3.config import ModelConfig
from kimik3.model import abstract_params
from kimik3.quantization import BITS_PER_VALUE, KIMI_K3_MXFP4, QuantManifest


def _leaves(cfg: ModelConfig):
    tree = abstract_params(cfg, "float32")
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        yield jax.tree_util.keystr(path, simple=True, separator="/"), math.prod(leaf.shape)


def param_count(cfg: ModelConfig) -> int:
    """Total parameters, vision encoder included."""
    return sum(n for _, n in _leaves(cfg))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a text token touches: routed experts count k of E."""
    frac = cfg.n_active_experts / cfg.n_routed_experts if cfg.n_routed_experts else 0.0
    total = 0.0
    for path, n in _leaves(cfg):
        if path.startswith("vit/"):
            continue
        total += n * frac if "moe/w_" in path and path.endswith(("_elf", "_efl")) else n
    return int(total)


def weight_bytes(cfg: ModelConfig, manifest: QuantManifest = KIMI_K3_MXFP4) -> int:
    """Bytes of all weights stored as `manifest` says (block scales included)."""
    bits = sum(n * BITS_PER_VALUE[manifest.format_of(path)] for path, n in _leaves(cfg))
    return int(math.ceil(bits / 8))
