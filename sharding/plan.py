"""`kimik3 plan`: memory per rank and bytes per collective per layer of a sharding.

    kimik3 plan --config kimi_k3 --prefill tp8,ep8 --decode dp16,ep16 --gpu gb300

Memory per rank: weights (each leaf's bytes under the quantization manifest,
divided by the number of ranks its `PartitionSpec` splits it over), KV and
KDA state per request, and the step's largest buffers.  Collectives: the
exact list the sharded layers issue (`collectives`), with their buffer shapes;
the same function is checked against the collectives in the compiled HLO of
the tiny config (tests/sharding), so the plan cannot drift from the code.

    kimik3 plan --config kimi_linear --fits [--gpu h100]

`--fits` plans one GPU instead of meshes: for the config and its all-MLA twin
(`kimik3.config.all_mla`) side by side, the largest decode batch that fits at contexts
of 4K to 1M tokens, per manifest (bf16, MXFP4 experts), on an H100 and an H200
(`decode_fit`: the GPU's usable memory less a reserve, then weights, then per request its
MLA KV, KDA state and fp32 logits row).

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
from kimik3 import sizing
from kimik3.config import ModelConfig
from kimik3.model import abstract_params
from sharding.mesh import MeshShape, check_config, parse_spec
from sharding.rules import RULES, path_str, param_specs

log = logging.getLogger(__name__)

GPUS = {"h200": 141e9, "gb300": 288e9, "h100": 80e9, "b200": 192e9}  # HBM bytes per GPU, nominal

GIB = 1 << 30
# What one process can allocate on a GPU (the nominal GPUS figure less what the driver and the CUDA
# context keep): an H100 80GB leaves about 79.1 GiB, an H200 about 139 GiB.  JAX's allocator stops
# at XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of it: a run sized by these figures raises it.
USABLE_BYTES = {"h100": int(79.1 * GIB), "h200": int(139.0 * GIB)}
# Held back from a single-GPU fit for the runtime, the compiled programs and a step's activations.
RESERVE_BYTES = 4 * GIB
FIT_CONTEXTS = (4096, 32768, 131072, 524288, 1048576)
FIT_MANIFESTS = ("bf16", "kimi_k3_mxfp4")


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


@dataclasses.dataclass(frozen=True)
class DecodeFit:
    """A decode engine on one GPU, in bytes: the weights once, and per request its MLA latent
    KV at `context` tokens, its KDA state (fp32 state and conv rows of every KDA layer, whatever
    the length) and its fp32 logits row; `memory` the GPU's usable bytes, `reserve` what is held
    back for the runtime and activations."""

    weights: int
    kv_per_request: int
    state_per_request: int
    logits_per_request: int
    memory: int
    reserve: int

    @property
    def per_request(self) -> int:
        return self.kv_per_request + self.state_per_request + self.logits_per_request

    @property
    def free_for_requests(self) -> int:
        return self.memory - self.reserve - self.weights

    @property
    def batch(self) -> int:
        """The largest decode batch that fits (0: not one request, or not even the weights)."""
        return max(0, self.free_for_requests // self.per_request)

    def total(self, batch: int) -> int:
        """Bytes `batch` requests take with the weights and the reserve."""
        return self.weights + self.reserve + batch * self.per_request


def cache_bytes_per_request(cfg: ModelConfig, context: int, act_dtype: str = "bfloat16") -> tuple[int, int]:
    """(MLA latent KV of `context` tokens, KDA state) of one request, every layer of each kind:
    n_mla x context x (kv_lora + rope) values in `act_dtype`, and n_kda x (fp32 state H x K x K +
    the short convs' last W - 1 inputs of q, k, v)."""
    s = np.dtype(act_dtype).itemsize
    n_mla, n_kda = cfg.mixer_kinds.count("mla"), cfg.mixer_kinds.count("kda")
    kv = n_mla * context * cfg.mla_latent_dim * s
    h, d = cfg.kda_heads, cfg.kda_head_dim
    state = n_kda * (h * d * d * 4 + 3 * (cfg.kda_conv_size - 1) * h * d * s)
    return kv, state


def decode_fit(
    cfg: ModelConfig,
    manifest: str,
    context: int,
    memory_bytes: int,
    *,
    reserve_bytes: int = RESERVE_BYTES,
    act_dtype: str = "bfloat16",
) -> DecodeFit:
    """`DecodeFit` of `cfg` served unsharded with `manifest`'s weights (`sizing.weight_bytes`) in
    `memory_bytes` (e.g. `USABLE_BYTES[gpu]`, or a device's free bytes with weights=... already
    counted by the caller) at caches of `context` tokens."""
    kv, state = cache_bytes_per_request(cfg, context, act_dtype)
    return DecodeFit(
        weights=sizing.weight_bytes(cfg, quantization.MANIFESTS[manifest]),
        kv_per_request=kv,
        state_per_request=state,
        logits_per_request=cfg.vocab_size * 4,
        memory=int(memory_bytes),
        reserve=int(reserve_bytes),
    )


def _ctx_label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def fits_report(
    cfg: ModelConfig,
    gpus=("h100", "h200"),
    manifests=FIT_MANIFESTS,
    contexts=FIT_CONTEXTS,
    reserve_bytes: int = RESERVE_BYTES,
) -> str:
    """`kimik3 plan --fits`: per GPU and manifest, the largest decode batch of `cfg` and of its
    all-MLA twin (`config_lib.all_mla`) at each context, side by side ("ours / twin")."""
    twin = config_lib.all_mla(cfg)
    for gpu in gpus:
        if gpu not in USABLE_BYTES:
            raise ValueError(f"--fits knows the usable memory of {sorted(USABLE_BYTES)}; got --gpu {gpu}")
    n = lambda c, kind: c.mixer_kinds.count(kind)
    kv1, state1 = cache_bytes_per_request(cfg, 1)
    kv2, state2 = cache_bytes_per_request(twin, 1)
    lines = [
        f"largest decode batch on one GPU: {cfg.name} ({n(cfg, 'kda')} KDA + {n(cfg, 'mla')} MLA) / "
        f"{twin.name} (its all-MLA twin, {n(twin, 'mla')} MLA)",
        "usable memory "
        + ", ".join(f"{g} {USABLE_BYTES[g] / GIB:.1f} GiB" for g in gpus)
        + f", less {reserve_bytes / GIB:.1f} GiB for the runtime and activations; then the weights, then per "
        "request: MLA KV (bf16), KDA state (fp32, any length), an fp32 logits row",
        f"per request: KV {kv1:,} / {kv2:,} bytes per token of context; KDA state {state1 / 1e6:,.1f} / "
        f"{state2 / 1e6:,.1f} MB",
    ]
    header = f"{'gpu':5} {'manifest':14} {'weights GB':>15}" + "".join(f" {_ctx_label(c):>13}" for c in contexts)
    lines += ["", header]
    for gpu in gpus:
        for name in manifests:
            fits = [
                [decode_fit(c, name, ctx, USABLE_BYTES[gpu], reserve_bytes=reserve_bytes) for ctx in contexts]
                for c in (cfg, twin)
            ]
            weights = f"{fits[0][0].weights / 1e9:.1f} / {fits[1][0].weights / 1e9:.1f}"
            cells = [f"{a.batch:,} / {b.batch:,}" for a, b in zip(*fits)]
            lines.append(f"{gpu:5} {name:14} {weights:>15}" + "".join(f" {c:>13}" for c in cells))
    lines.append("(0: the weights and one request of that context do not fit)")
    return "\n".join(lines)


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
        "--gpu",
        default=None,
        choices=sorted(GPUS),
        help="the GPU whose memory and links the plan is sized for (default gb300; --fits: h100 and h200)",
    )
    parser.add_argument(
        "--fits",
        action="store_true",
        help="one GPU, no mesh: the largest decode batch of the config and of its all-MLA twin at contexts "
        f"4K to 1M, bf16 and MXFP4 experts, in the GPU's usable memory less {RESERVE_BYTES / GIB:.0f} GiB "
        "for the runtime and activations (h100, h200)",
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
        from kimik3 import checkpoint  # orbax loads only where a checkpoint's config is read

        cfg = checkpoint.load_config(args.checkpoint)
    else:
        cfg = config_lib.get_config(args.config)
    if getattr(args, "fits", False):
        print(fits_report(cfg, (args.gpu,) if args.gpu else ("h100", "h200")))
        return 0
    gpu = args.gpu or "gb300"
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
                gpu=gpu,
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
                gpu=gpu,
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
