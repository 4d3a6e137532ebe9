"""Where `small` in bf16 leaves the fp32 oracle (issue 16): layer by layer, on the same inputs.

    PYTHONPATH=$PWD python3 benchmarks/bf16_drift.py [--config small] [--tokens 300] [--out DIR]

For each layer i, the fp32 model's input to that layer x_i (no cache, reference math) goes
through layer i twice: fp32 params on fp32 x_i, and bf16 params on bf16(x_i) (what a bf16 model
computes there, given a perfect input).  Per layer: the relative error of the layer's output
(|y_bf16 - y_fp32| / |y_fp32|, RMS over tokens), the residual stream's RMS, and for MoE layers
the router decisions that differ (tokens whose top-k set changed) and how many of those were
near-ties in fp32 (gap between the k-th and (k+1)-th biased score < 1e-2).  Then the end-to-end
last-token logits of the bf16 model against fp32.  Runs on the CPU (reference kernels).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import config, model
from kimik3.model import Block
from kimik3.layers.moe import route


def _layer(params, cfg, i, x, positions):
    """(layer output, the MoE's input or None): layer i on x, no cache."""
    (y, _), state = Block(cfg, i, "grouped", "reference").apply(
        {"params": params[f"layer_{i}"]}, x, positions, None, capture_intermediates=True)
    moe_in = state["intermediates"]["ffn_norm"]["__call__"][0] if cfg.ffn_kind(i) == "moe" else None
    return y, moe_in


def _flips(p32, p16, cfg, i, h32, h16):
    """(tokens whose top-k expert set differs, of them near-ties in fp32) at layer i."""
    moe32, moe16 = p32[f"layer_{i}"]["moe"], p16[f"layer_{i}"]["moe"]
    k = cfg.n_active_experts
    d = h32.shape[-1]
    ids32, _ = route(h32.reshape(-1, d), moe32["w_router_de"], moe32["router_bias_e"], k)
    ids16, _ = route(h16.reshape(-1, d), moe16["w_router_de"], moe16["router_bias_e"], k)
    differ = np.any(np.sort(np.asarray(ids32), -1) != np.sort(np.asarray(ids16), -1), -1)
    scores = jax.nn.sigmoid(h32.reshape(-1, d).astype(jnp.float32) @ moe32["w_router_de"].astype(jnp.float32))
    top = np.sort(np.asarray(scores + moe32["router_bias_e"]), -1)[:, ::-1]
    near = (top[:, k - 1] - top[:, k]) < 1e-2
    return int(differ.sum()), int((differ & near).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg32 = config.get_config(args.config).replace(dtype="float32")
    p32 = model.init_params(cfg32, jax.random.PRNGKey(args.seed), "float32")
    p16 = model.cast_params(p32, jnp.bfloat16)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, args.tokens)), jnp.int32)
    positions = jnp.arange(args.tokens, dtype=jnp.int32)[None]
    x = p32["embed_vd"][tokens]
    rows = []
    for i in range(cfg32.n_layers):
        y32, h32 = _layer(p32, cfg32, i, x, positions)
        y16, h16 = _layer(p16, cfg32, i, x.astype(jnp.bfloat16), positions)
        delta32, delta16 = y32 - x, y16.astype(jnp.float32) - x  # what the layer adds to the stream
        rel = float(jnp.sqrt(jnp.mean((delta16 - delta32) ** 2) / jnp.mean(delta32 ** 2)))
        row = {"layer": i, "mixer": cfg32.mixer_kind(i), "ffn": cfg32.ffn_kind(i),
               "stream_rms": float(jnp.sqrt(jnp.mean(x ** 2))), "update_rel_err": rel}
        if h32 is not None:
            row["router_flips"], row["flips_at_near_ties"] = _flips(p32, p16, cfg32, i, h32, h16)
        rows.append(row)
        print(json.dumps(row), flush=True)
        x = y32
    logits32, _ = model.forward(p32, cfg32, tokens, kernels="reference")
    logits16, _ = model.forward(p16, cfg32.replace(dtype="bfloat16"), tokens, kernels="reference")
    err = np.abs(np.asarray(logits16[0, -1], np.float32) - np.asarray(logits32[0, -1]))
    last = {"end_to_end_last_token_max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()),
            "logit_max_abs": float(np.abs(np.asarray(logits32[0, -1])).max()),
            "top1_same": bool(np.argmax(logits16[0, -1]) == np.argmax(logits32[0, -1]))}
    print(json.dumps(last), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bf16_drift.json"), "w") as f:
            json.dump({"layers": rows, "end_to_end": last}, f, indent=1)


if __name__ == "__main__":
    main()
