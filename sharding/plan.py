"""`kimik3 plan`: memory per rank and bytes per collective per layer of a sharding.

    kimik3 plan --config kimi_k3 --prefill tp8,ep8 --decode dp16,ep16 --gpu gb300

Memory per rank: weights (each leaf's bytes under the quantization manifest,
divided by the number of ranks its `PartitionSpec` splits it over), KV and
KDA state per request, and the step's largest buffers.  Collectives: the
exact list the sharded layers issue (`collectives`), with their buffer shapes;
the same function is checked against the collectives in the compiled HLO of
the tiny config (tests/sharding), so the plan cannot drift from the code.

Bytes of a collective = bytes of its full buffer: the gathered output of an
all-gather, the input of a reduce-scatter, the whole ``[ep, C, L]`` buffer of
a dense all-to-all.  ``wire`` = bytes one rank actually sends: ``(n-1)/n`` of
the buffer for all-gather / reduce-scatter, the rows for other ranks for an
all-to-all (ragged dispatch: only routed rows, at uniform routing).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys

import jax
import numpy as np

from kimik3 import config as config_lib
from kimik3 import quantization
from kimik3.config import ModelConfig
from kimik3.model import abstract_params
from sharding.mesh import MeshShape, check_config, parse_spec
from sharding.rules import RULES, path_str, param_specs

log = logging.getLogger(__name__)

GPUS = {"h200": 141e9, "gb300": 288e9, "h100": 80e9, "b200": 192e9}  # HBM bytes per GPU


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of one layer: kind in {all-gather, reduce-scatter, all-to-all}."""

    layer: int
    kind: str
    what: str
    shape: tuple[int, ...]
    dtype: str
    group: int  # ranks taking part

    @property
    def bytes(self) -> int:
        return collective_bytes(self.shape, self.dtype)

    @property
    def wire_bytes(self) -> float:
        return self.bytes * (self.group - 1) / self.group


def collective_bytes(shape, dtype) -> int:
    """Bytes of a collective's full buffer (shared by the plan and the HLO check)."""
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def local_tokens(shape: MeshShape, batch: int, seq: int) -> int:
    """Tokens one rank routes through the MoE: B*T/tp (prefill, token shard) or B/dp*T (decode)."""
    if shape.mode == "prefill":
        return batch * seq // shape.size
    return batch // shape.size * seq


def collectives(
    cfg: ModelConfig, shape: MeshShape, batch: int, seq: int, act_dtype: str = "bfloat16", dispatch: str = "dense"
) -> list[Collective]:
    """Every collective the sharded forward issues for `batch` sequences of `seq` new tokens.

    Prefill: per layer an all-gather of the normed activations [B, T, D] before QKV and a
    reduce-scatter of the mixer's partial sums [B, T, D] over tokens.  Per MoE layer
    (both modes, over the EXPERT axis): dispatch (rows, local expert ids) and combine.
    Dense dispatch buffers are [ep, C, L] with C = local tokens * top_k; ragged ones hold
    the expected routed rows (uniform routing), plus an all-gather of the [ep] send sizes.
    """
    out = []
    d, l, k, ep = cfg.d_model, cfg.moe_latent_dim, cfg.n_active_experts, shape.ep
    n_loc = local_tokens(shape, batch, seq)
    cap = n_loc * k
    for i in range(cfg.n_layers):
        if shape.mode == "prefill" and shape.size > 1:
            out.append(Collective(i, "all-gather", "activations before QKV", (batch, seq, d), act_dtype, shape.size))
            out.append(
                Collective(
                    i, "reduce-scatter", "o_proj partial sums over tokens", (batch, seq, d), act_dtype, shape.size
                )
            )
        if cfg.ffn_kind(i) == "moe" and ep > 1:
            if dispatch == "dense":
                out.append(Collective(i, "all-to-all", "dispatch expert ids", (ep, cap), "int32", ep))
                out.append(Collective(i, "all-to-all", "dispatch latent rows", (ep, cap, l), act_dtype, ep))
                out.append(Collective(i, "all-to-all", "combine latent rows", (ep, cap, l), act_dtype, ep))
            else:
                out.append(Collective(i, "all-gather", "dispatch sizes", (ep, ep), "int32", ep))
                out.append(Collective(i, "all-to-all", "dispatch expert ids (ragged)", (cap,), "int32", ep))
                out.append(Collective(i, "all-to-all", "dispatch latent rows (ragged)", (cap, l), act_dtype, ep))
                out.append(Collective(i, "all-to-all", "combine latent rows (ragged)", (cap, l), act_dtype, ep))
    return out


def all_to_all_wire(c: Collective) -> float:
    """Bytes a rank sends in an all-to-all: (ep-1)/ep of its buffer (dense: whole capacity; ragged: routed rows)."""
    return c.bytes * (c.group - 1) / c.group


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per rank."""

    weights: int
    weights_by_format: dict
    kv_per_request: int  # MLA latent rows (all MLA layers) at the planned length, on one rank
    kda_per_request: int  # KDA recurrent + conv state (all KDA layers), on one rank
    requests_per_rank: float
    buffers: dict

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.requests_per_rank * (self.kv_per_request + self.kda_per_request)
            + sum(self.buffers.values())
        )


def weight_bytes_per_rank(cfg: ModelConfig, shape: MeshShape, manifest) -> tuple[int, dict]:
    """Weights one rank stores: each leaf's bytes / the number of ranks its spec splits it over."""
    tree = abstract_params(cfg, "float32")
    specs = param_specs(tree, RULES[shape.mode])
    axis_size = {"replica": shape.replicas, "expert": shape.ep}
    by_format: dict[str, float] = {}
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    for (path, leaf), spec in zip(leaves, spec_leaves):
        name = path_str(path)
        fmt = manifest.format_of(name)
        split = 1
        for entry in spec:
            for ax in entry if isinstance(entry, tuple) else (entry,):
                if ax is not None:
                    split *= axis_size[ax]
        bits = math.prod(leaf.shape) * quantization.BITS_PER_VALUE[fmt] / split
        by_format[fmt] = by_format.get(fmt, 0.0) + bits / 8
    return int(sum(by_format.values())), {k: int(v) for k, v in by_format.items()}


def memory(
    cfg: ModelConfig,
    shape: MeshShape,
    batch: int,
    seq: int,
    context: int,
    manifest,
    act_dtype: str = "bfloat16",
    dispatch: str = "dense",
) -> Memory:
    """Per-rank memory of `shape` running `batch` requests: `seq` new tokens each, caches of `context` tokens."""
    s = np.dtype(act_dtype).itemsize
    weights, by_format = weight_bytes_per_rank(cfg, shape, manifest)
    n_mla = cfg.mixer_kinds.count("mla")
    n_kda = cfg.mixer_kinds.count("kda")
    kv = n_mla * context * cfg.mla_latent_dim * s
    kda_state = n_kda * (
        cfg.kda_heads * cfg.kda_head_dim**2 * 4 + 3 * (cfg.kda_conv_size - 1) * cfg.kda_heads * cfg.kda_head_dim * s
    )
    n_loc = local_tokens(shape, batch, seq)
    ep_buffer = shape.ep * n_loc * cfg.n_active_experts * cfg.moe_latent_dim * s
    if shape.mode == "prefill":
        kda_state //= shape.size  # heads split over tp; the MLA latent is replicated over tp
        requests = batch
        buffers = {
            "gathered activations [B,T,D]": batch * seq * cfg.d_model * s,
            "mixer partial sums [B,T,D]": batch * seq * cfg.d_model * s,
            "logits [B,T/tp,V] fp32": n_loc * cfg.vocab_size * 4,
        }
    else:
        requests = batch / shape.size
        buffers = {"logits [B/dp,T,V] fp32": n_loc * cfg.vocab_size * 4}
    buffers["expert dispatch/combine send+recv"] = 2 * ep_buffer if shape.ep > 1 else 0
    return Memory(weights, by_format, kv, kda_state, requests, buffers)


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def _mb(x: float) -> str:
    return f"{x / 1e6:,.3f} MB"


def report(
    cfg: ModelConfig,
    shape: MeshShape,
    *,
    batch: int,
    seq: int,
    context: int,
    manifest_name: str,
    gpu: str,
    dispatch: str,
    act_dtype: str = "bfloat16",
) -> str:
    """A text report of one mode's plan."""
    check_config(cfg, shape)
    manifest = quantization.MANIFESTS[manifest_name]
    mem = memory(cfg, shape, batch, seq, context, manifest, act_dtype, dispatch)
    hbm = GPUS[gpu]
    g = shape.group_axis
    lines = [
        f"== {shape.mode}: {g}{shape.size},ep{shape.ep} ({shape.size} ranks, {shape.replicas} expert "
        f"replica group(s)); batch {batch} x {seq} new tokens, caches of {context} tokens; "
        f"{dispatch} dispatch, activations {act_dtype}"
    ]
    lines.append(
        f"weights per rank      {_gb(mem.weights)}  ("
        + ", ".join(f"{k}: {_gb(v)}" for k, v in sorted(mem.weights_by_format.items()))
        + f"; manifest {manifest_name})"
    )
    where = "replicated over tp" if shape.mode == "prefill" else "on the owning rank only"
    lines.append(f"MLA KV per request    {_gb(mem.kv_per_request)}  ({context} tokens, {where})")
    lines.append(
        f"KDA state per request {_gb(mem.kda_per_request)}  "
        f"({'split over tp' if shape.mode == 'prefill' else 'on the owning rank only'}; "
        f"independent of length)"
    )
    lines.append(f"requests per rank     {mem.requests_per_rank:g}")
    for name, b in mem.buffers.items():
        lines.append(f"buffer                {_gb(b)}  {name}")
    fits = mem.total <= hbm
    lines.append(
        f"total per rank        {_gb(mem.total)} of {_gb(hbm)} ({gpu}) -> {'fits' if fits else 'DOES NOT FIT'}"
    )
    free = hbm - mem.weights - sum(mem.buffers.values())
    per_req = mem.kv_per_request + mem.kda_per_request
    if free > 0 and per_req > 0:
        lines.append(f"request capacity      {int(free // per_req):,} requests of {context} tokens per rank")
    if shape.mode == "decode":
        lines += manifest_capacity(cfg, shape, batch, context, gpu, act_dtype, dispatch)
    colls = collectives(cfg, shape, batch, seq, act_dtype, dispatch)
    first_moe = next((i for i in range(cfg.n_layers) if cfg.ffn_kind(i) == "moe"), None)
    shown = sorted({c.layer for c in colls if c.layer in (0, first_moe)})
    lines.append("collectives per layer (buffer = full collective buffer; wire = bytes one rank sends)")
    for layer in shown:
        kind = f"{cfg.mixer_kind(layer)} + {cfg.ffn_kind(layer)}"
        for c in (c for c in colls if c.layer == layer):
            lines.append(
                f"  layer {layer:<3} {kind:<10} {c.kind:<15} {str(c.shape):<22} {c.dtype:<9} "
                f"buffer {_mb(c.bytes):>14}  wire {_mb(c.wire_bytes):>14}  {c.what}"
            )
    total = sum(c.bytes for c in colls)
    wire = sum(c.wire_bytes for c in colls)
    lines.append(
        f"all {cfg.n_layers} layers: {len(colls)} collectives, buffers {_gb(total)}, wire {_gb(wire)} per rank per step"
    )
    return "\n".join(lines)


CAPACITY_MANIFESTS = ("bf16", "kimi_k3_mxfp4") + quantization.SERVING_MANIFESTS


def manifest_capacity(
    cfg: ModelConfig,
    shape: MeshShape,
    batch: int,
    context: int,
    gpu: str,
    act_dtype: str = "bfloat16",
    dispatch: str = "dense",
) -> list[str]:
    """Lines: per manifest, the weights one decode rank stores, what that frees against bf16, and
    the KV (MLA latent) tokens and requests of `context` tokens the rest of the GPU holds."""
    hbm = GPUS[gpu]
    lines = [f"per manifest (decode rank, {gpu}): weights, freed vs bf16, KV capacity of what is left"]
    base = None
    for name in CAPACITY_MANIFESTS:
        mem = memory(cfg, shape, batch, 1, context, quantization.MANIFESTS[name], act_dtype, dispatch)
        base = mem.weights if base is None else base
        free = hbm - mem.weights - sum(mem.buffers.values())
        per_token = cfg.mixer_kinds.count("mla") * cfg.mla_latent_dim * np.dtype(act_dtype).itemsize
        per_req = mem.kv_per_request + mem.kda_per_request
        cap = (
            f"{int(max(free, 0) // per_token):,} KV tokens, {int(max(free, 0) // per_req):,} requests of {context}"
            if per_req > 0
            else "-"
        )
        lines.append(f"  {name:22s} weights {_gb(mem.weights):>12}  freed {_gb(base - mem.weights):>12}  {cap}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `kimik3 plan` options (for serving/cli.py's subparser)."""
    parser.add_argument(
        "--config",
        default="kimi_k3",
        help="a preset of kimik3.config: tiny, small, kimi_k3, k3_slice, kimi_linear, ...",
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="plan a checkpoint's or a Hugging Face model directory's config (overrides --config)",
    )
    parser.add_argument("--prefill", default="tp8,ep8", help="prefill mesh, e.g. tp8,ep8 ('' to skip)")
    parser.add_argument("--decode", default="dp16,ep16", help="decode mesh, e.g. dp16,ep16 ('' to skip)")
    parser.add_argument("--batch", type=int, default=1, help="prefill sequences per step")
    parser.add_argument("--seq-len", type=int, default=8192, help="prefill tokens per sequence")
    parser.add_argument("--decode-batch", type=int, default=256, help="decode requests per step (all dp ranks)")
    parser.add_argument("--context", type=int, default=32768, help="KV length per request")
    parser.add_argument(
        "--manifest",
        default="kimi_k3_mxfp4",
        choices=sorted(quantization.MANIFESTS),
        help="the storage format of each weight (kimik3.quantization)",
    )
    parser.add_argument(
        "--gpu", default="gb300", choices=sorted(GPUS), help="the GPU whose memory and links the plan is sized for"
    )
    parser.add_argument(
        "--dispatch",
        default="ragged",
        choices=("ragged", "dense"),
        help="expert dispatch: ragged (GPU) or dense fixed-capacity (CPU)",
    )
    parser.add_argument("--act-dtype", default="bfloat16", choices=("bfloat16", "float32"), help="activations' dtype")


def run(args) -> int:
    """Print the plan; ValueError (bad mesh or config) propagates to the CLI's error handler."""
    if args.checkpoint:  # a checkpoint's or a Hugging Face directory's own config
        from kimik3 import checkpoint

        cfg = checkpoint.load_config(args.checkpoint)
    else:
        cfg = config_lib.get_config(args.config)
    parts = []
    if args.prefill:
        shape = parse_spec(args.prefill, "prefill")
        check_config(cfg, shape)
        if args.seq_len % shape.size:
            raise ValueError(f"--seq-len {args.seq_len} is not a multiple of tp={shape.size}")
        parts.append(
            report(
                cfg,
                shape,
                batch=args.batch,
                seq=args.seq_len,
                context=args.seq_len,
                manifest_name=args.manifest,
                gpu=args.gpu,
                dispatch=args.dispatch,
                act_dtype=args.act_dtype,
            )
        )
    if args.decode:
        shape = parse_spec(args.decode, "decode")
        check_config(cfg, shape)
        if args.decode_batch % shape.size:
            raise ValueError(f"--decode-batch {args.decode_batch} is not a multiple of dp={shape.size}")
        parts.append(
            report(
                cfg,
                shape,
                batch=args.decode_batch,
                seq=1,
                context=args.context,
                manifest_name=args.manifest,
                gpu=args.gpu,
                dispatch=args.dispatch,
                act_dtype=args.act_dtype,
            )
        )
    print(
        f"config {cfg.name}: {cfg.n_layers} layers ({cfg.mixer_kinds.count('kda')} KDA, "
        f"{cfg.mixer_kinds.count('mla')} MLA), {cfg.n_routed_experts} experts, top-{cfg.n_active_experts}"
    )
    print("\n\n".join(parts))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="kimik3 plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"kimik3 plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
