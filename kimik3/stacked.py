"""The scanned layout of the params: the repeated [KDA, KDA, KDA, MLA] periods stacked.

A forward over N unrolled layers traces, lowers and compiles N copies of the block; the
model's layers after the first period are identical periods, so the serving programs run
them as one `lax.scan` step over stacked weights (`kimik3.model.KimiK3`'s "periods").
`stack_periods(params, cfg)` rewrites the checkpoint layout once, at load (as
`kimik3.fused` does, and composable with it)::

    layer_0 .. layer_{first-1}           unrolled (the dense-FFN layer's period)
    periods/layer_j  [n_periods, ...]     layer first + i*P + j for period i, position j
    layer_{first + n*P} ..                unrolled tail (layers that fill no whole period)

`scan_layout(cfg)` names first and n.  The math is the block's, per layer, unchanged: the
scanned forward equals the unrolled one (tests/kimik3/test_stacked.py).  Sharded steps keep
the checkpoint layout (their rules name layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimik3.config import ATTENTION_PERIOD, ModelConfig

PERIODS = "periods"


def scan_layout(cfg: ModelConfig) -> tuple[int, int]:
    """(first scanned layer, number of scanned periods).  The dense-FFN layers make their
    periods unlike the others, so scanning starts at the first period after them; it runs over
    the periods whose mixers repeat the first one's (a `mixer_layout` may break the pattern:
    the rest is the unrolled tail); fewer than two such periods leave nothing worth a scan (n = 0)."""
    p = ATTENTION_PERIOD
    first = p * max(1, -(-cfg.dense_layers // p))
    kinds = cfg.mixer_kinds
    pattern = kinds[first : first + p]
    n = 0
    while first + (n + 1) * p <= cfg.n_layers and kinds[first + n * p : first + (n + 1) * p] == pattern:
        n += 1
    return first, (n if n >= 2 else 0)


def scanned_layers(cfg: ModelConfig) -> range:
    first, n = scan_layout(cfg)
    return range(first, first + n * ATTENTION_PERIOD)


def stack_positions(layer_tree, first: int, n: int) -> tuple:
    """Per period position j, the trees `layer_tree(l)` of layers l = first + i*P + j (i < n)
    stacked on a new leading axis i."""
    return tuple(
        jax.tree_util.tree_map(
            lambda *leaves: jnp.stack(leaves), *[layer_tree(first + i * ATTENTION_PERIOD + j) for i in range(n)]
        )
        for j in range(ATTENTION_PERIOD)
    )


def unstack_positions(positions, first: int, n: int) -> dict:
    """The inverse of `stack_positions`: {layer: its tree} (None trees stay None)."""
    return {
        first + i * ATTENTION_PERIOD + j: jax.tree_util.tree_map(lambda leaf: leaf[i], positions[j])
        for j in range(ATTENTION_PERIOD)
        for i in range(n)
    }


def is_stacked(params) -> bool:
    return PERIODS in params


def stack_periods(params, cfg: ModelConfig):
    """params with the scanned periods stacked (see the module comment); a stacked tree, or a
    config with nothing to scan, comes back as is.  The arrays are new: callers drop the
    unstacked tree to free its memory."""
    first, n = scan_layout(cfg)
    if is_stacked(params) or n == 0:
        return params
    out = {k: v for k, v in params.items() if k not in {f"layer_{i}" for i in scanned_layers(cfg)}}
    out[PERIODS] = {
        f"layer_{j}": tree for j, tree in enumerate(stack_positions(lambda l: params[f"layer_{l}"], first, n))
    }
    return out


def unstack_periods(params, cfg: ModelConfig):
    """The inverse of `stack_periods` (checkpoint layout back from the scanned one)."""
    if not is_stacked(params):
        return params
    first, n = scan_layout(cfg)
    out = {k: v for k, v in params.items() if k != PERIODS}
    positions = tuple(params[PERIODS][f"layer_{j}"] for j in range(ATTENTION_PERIOD))
    out.update({f"layer_{l}": tree for l, tree in unstack_positions(positions, first, n).items()})
    return out


def serving_layout(params, cfg: ModelConfig, *, scan: bool = True):
    """What the unsharded serving programs read: projections fused (`kimik3.fused`) and, with
    `scan`, the periods stacked (without it, unstacked).  Idempotent; callers that share params
    between engines convert once and pass the result."""
    from kimik3 import fused  # fused has no dependency back here

    params = fused.fuse_projections(params, cfg)
    return stack_periods(params, cfg) if scan else unstack_periods(params, cfg)
