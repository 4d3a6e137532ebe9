"""Every maintained benchmark, registered once: its suite, its cases as named shape presets, its
peer, its ceiling, its correctness check and its named variants.  `benchmarks/run.py` runs them.

A benchmark is a function `fn(ctx: Context) -> Iterable[dict]` in a module of this package,
yielding one row per case (and per variant asked for) made by `Context.row`.  Its contract:

* ours: the library's public entry point with the defaults a user gets (what `kimik3.ops` picks
  on this device); tuned configurations are named variants beside it (`--variants`).
* the check runs first, ours against a reference on the same inputs within a tolerance; a row
  whose check fails is marked failed and is not timed.
* ours and the peer are timed by the same rule (`common.pipelined_ms` and its twins: calls back
  to back, one sync); paged kernels read a shuffled page table or slot list, as a live pool has.
* shapes: "ci" runs in seconds on the CPU (Pallas in interpret mode, `tiny` configs); "full" is
  the real work for an H100 / H200.
* rows come out as their cases finish (the runner writes its JSON at every row); a benchmark whose
  peer can only be measured after all of ours (two full-size models that do not share the device)
  yields a case's row with ours first and the same row again, completed, once its peer is timed.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from typing import Any

from benchmarks import common

SUITES = ("kernels", "serving", "quant", "spec", "model")
CEILINGS = ("memory", "compute", "roofline")
RIDGE_FLOP_PER_BYTE = 300.0  # where no ceilings were measured: an H100's ridge, to name a case's bound


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One registered benchmark.  fields: the names of a case tuple's entries; shapes: {"ci": [...],
    "full": [...]} case tuples; peer: what ours is compared with (None: peer_note says why);
    ceiling: "memory" (bytes at the run's copy rate), "compute" (FLOPs at its matmul rate),
    "roofline" (the nearer of the two per case) or None; variants: {name: what it changes}."""

    name: str
    suite: str
    module: str
    fn: str
    doc: str
    fields: tuple[str, ...]
    shapes: dict[str, tuple]
    peer: str | None
    peer_note: str
    ceiling: str | None
    check: str
    variants: dict[str, str] = dataclasses.field(default_factory=dict)

    def load(self):
        return getattr(importlib.import_module(f"benchmarks.{self.module}"), self.fn)

    def label(self, case: tuple) -> str:
        short = lambda k, v: len(k) <= 4 and isinstance(v, (int, float)) and not isinstance(v, bool)
        return " ".join(f"{k}{v}" if short(k, v) else f"{k}={v}" for k, v in zip(self.fields, case))


def _b(name, suite, module, fn, doc, fields, ci, full, peer, peer_note, ceiling, check, variants=None):
    return Benchmark(
        name,
        suite,
        module,
        fn,
        doc,
        tuple(fields.split()),
        {"ci": tuple(ci), "full": tuple(full)},
        peer,
        peer_note,
        ceiling,
        check,
        dict(variants or {}),
    )


_LAT = (512, 64, 128)  # the model's MLA latent width, rope width and page size
_KL = ("kimi_linear", "kimi_k3_mxfp4")  # the model suite's full cases: Kimi-Linear, MXFP4 experts

BENCHMARKS: tuple[Benchmark, ...] = (
    # ------------------------------------------------------------------ kernels
    _b(
        "kda_chunk",
        "kernels",
        "kda",
        "kda_chunk",
        "KDA chunked prefill, `pallas_kernels.kda.chunk_kda(..., output_final_state=True)`; export=1 also "
        "exports the state after every 128th and 1536th token in the same pass (what prefix caching stores). "
        "gate=softplus: Kimi-Linear's unbounded gate (-e^A softplus(f + dt), log-decays far below -5) "
        "through `kimik3.ops.kda(..., gate_bounded=False, kernels='pallas')`, which checks the gates on the "
        "device and takes the chunked reference where the kernel's factorisation does not hold.",
        "B T H D export gate",
        [(1, 128, 2, 32, 1, "bounded"), (1, 128, 2, 32, 1, "softplus")],
        [
            (1, 32768, 32, 128, 0, "bounded"),
            (1, 32768, 32, 128, 1, "bounded"),
            (8, 4096, 32, 128, 0, "bounded"),
            (8, 4096, 32, 128, 1, "bounded"),
            (4, 8192, 12, 128, 0, "bounded"),
            (1, 32768, 32, 128, 1, "softplus"),
            (8, 4096, 32, 128, 1, "softplus"),
        ],
        "fla chunk_kda",
        "fla's `chunk_kda` on the same bf16 inputs and gates (its plain pass: fla exports no states); "
        "no peer without fla and torch",
        "memory",
        "o, final state and exported states vs `kda_chunked_ref` (fp32) on the same inputs: relative L2 error "
        "<= 2e-2 (bf16 inputs)",
        {
            "intra16": 'tuning {"intra": (16, 1)}',
            "intra4x2": 'tuning {"intra": (4, 2)}',
            "intra8x2": 'tuning {"intra": (8, 2)}',
            "intra_solve": 'tuning {"prepare_impl": "intra_solve"}',
            "prepare_fused": 'tuning {"prepare_impl": "fused", "prepare": (4, 1), "prepare_dot": "bf16"}',
            "tf32x3": 'tuning {"prepare_dot": "tf32x3"}',
            "state_bv32": 'tuning {"state_block_v": 32}',
            "state8x3": 'tuning {"state": (8, 3)}',
        },
    ),
    _b(
        "kda_decode",
        "kernels",
        "kda",
        "kda_decode",
        "KDA decode, one token on pooled states updated in place: `pallas_kernels.kda.fused_recurrent_kda` on a "
        "pool of 2B slots, B rows at shuffled slots.",
        "B H D",
        [(2, 2, 32)],
        [(1, 32, 128), (8, 32, 128), (64, 32, 128), (128, 32, 128), (256, 32, 128), (512, 32, 128)],
        "fla fused_recurrent_kda_fwd",
        "fla's kernel as vLLM calls it for decode: `fused_recurrent_kda_fwd` on "
        "the same pool by slot, in place; no peer without fla and torch",
        "memory",
        "o and the updated slots vs `kda_recurrent_ref` (fp32) on the gathered states: relative L2 <= 2e-2",
        {
            "bv32w4": "block_v 32, 4 warps (fla's tiling)",
            "bv64w4": "block_v 64, 4 warps",
            "bv32w2": "block_v 32, 2 warps",
            "bv128w8": "block_v 128, 8 warps",
            "hints": "L2 eviction hints",
        },
    ),
    _b(
        "kda_decode_fused",
        "kernels",
        "kda",
        "kda_decode_fused",
        "A KDA layer's whole decode token in one kernel (`pallas_kernels.kda_decode.kda_decode`: short convs, "
        "gates, recurrence, gated norm) on conv and state pools at shuffled slots.",
        "B H K",
        [(2, 2, 16)],
        [(8, 12, 128), (32, 12, 128), (128, 12, 128)],
        None,
        "no external kernel fuses the convs, gates, recurrence and norm of a KDA decode token "
        "(`kda_decode`'s recurrence alone is `kda_decode`'s benchmark)",
        "memory",
        "o and both updated pools vs `kda_decode_ref` on the same inputs: relative L2 <= 2e-2",
        {
            "w8": "8 warps",
            "bv128w4": "block_v 128, 4 warps",
            "bv128w8": "block_v 128, 8 warps",
            "bv32w4": "block_v 32, 4 warps",
            "bv32w2": "block_v 32, 2 warps",
        },
    ),
    _b(
        "mla_decode",
        "kernels",
        "mla",
        "mla_decode",
        "MLA absorbed decode on a paged latent cache (bf16, shuffled page table): the kernel "
        "`kimik3.ops.mla_decode_impl` picks (`mla_decode_hopper` or `mla.mla_decode`), R latent + P rope.",
        "H B ctx Sq R P page",
        [(2, 2, 256, 1, 32, 16, 16)],
        [
            (16, 1, 1024, 1, *_LAT),
            (16, 64, 8192, 1, *_LAT),
            (16, 128, 32768, 1, *_LAT),
            (96, 16, 8192, 1, *_LAT),
            (128, 64, 8192, 1, *_LAT),
            (128, 64, 8192, 4, *_LAT),
            (32, 1, 131072, 1, *_LAT),  # Kimi-Linear's heads at 128K
            (32, 8, 131072, 1, *_LAT),
        ],
        "FlashMLA",
        "FlashMLA's `flash_mla_with_kvcache` (64-token blocks viewing the same pages) where it imports, "
        "else XLA's `mla_decode_ref` on the gathered pages",
        "roofline",
        "o vs `mla_decode_ref` (fp32 math on the same bf16 inputs): <= 2e-2 relative",
        {
            "triton": "the Triton kernel at its defaults",
            "hopper": "the Hopper kernel at its defaults",
            "triton_64x8x512x32": "Triton: 64 rows, 8 warps, 512 value columns, block_k 32",
            "hopper_cluster2": "Hopper: row tiles in CTA pairs",
        },
    ),
    _b(
        "mla_prefill",
        "kernels",
        "mla",
        "mla_prefill",
        "MLA prefill of fresh tokens (naive form, qk 192 = 128 + rope 64, v 128, causal, packed "
        "sequences): the kernel `kimik3.ops.mla_prefill_impl` picks (`mla_hopper` or `mla.mla_prefill`).",
        "B T H",
        [(1, 128, 1)],
        [(1, 4096, 16), (1, 16384, 16), (4, 4096, 96)],
        "cuDNN",
        "cuDNN flash attention doing the same work (qk 192, v 128): the faster of JAX's cuDNN call and "
        "torch SDPA's cuDNN backend; no peer off the GPU",
        "compute",
        "o vs `mla_prefill_ref` on each sequence's first min(T, 1024) queries (causal: they see only their "
        "prefix): <= 2e-2 relative",
        {
            "triton": "the Triton kernel at its defaults",
            "hopper": "the Hopper kernel at its defaults",
            "triton_128x64x8x3": "Triton: block_q 128, block_k 64, 8 warps, 3 stages",
            "hopper_persistent": "Hopper: persistent grid",
        },
    ),
    _b(
        "mla_chunk",
        "kernels",
        "mla",
        "mla_chunk",
        "A prefill chunk continuing a paged cache (expanded form, what the serving engine runs): the kernel "
        "`kimik3.ops.mla_chunk_impl` picks (`mla_prefill_chunk_hopper` or `mla.mla_prefill_chunk`).",
        "B T P H R Pe nope dv page",
        [(1, 24, 40, 2, 32, 16, 16, 16, 16)],
        [
            (1, 2048, 0, 16, 512, 64, 128, 128, 128),
            (1, 2048, 2048, 16, 512, 64, 128, 128, 128),
            (1, 2048, 8192, 16, 512, 64, 128, 128, 128),
            (1, 2048, 8192, 96, 512, 64, 128, 128, 128),
        ],
        "XLA attention",
        "XLA's masked attention on the expanded K / V of the gathered pages (no external kernel "
        "takes a latent-page prefix)",
        "compute",
        "o vs the peer's output (XLA, same inputs): <= 2e-2 relative",
        {
            "triton": "the Triton chunk kernel",
            "hopper": "the Hopper chunk kernel",
            "hopper_128": "Hopper, 128-key blocks",
            "absorbed": "the absorbed decode kernel with Sq = T",
        },
    ),
    _b(
        "moe_gemm",
        "kernels",
        "moe",
        "moe_gemm",
        "Routed-expert grouped GEMM: rows sorted by expert [M, K] x weights [G, K, N] -> [M, N], "
        "`kimik3.ops.grouped_matmul(kernels='pallas')` (the Hopper or Triton kernel by `moe_gmm_impl`).",
        "M K N G",
        [(64, 64, 128, 4)],
        [
            (32, 768, 768, 32),
            (128, 768, 768, 32),
            (512, 768, 768, 32),
            (8192, 768, 768, 32),
            (32768, 768, 768, 32),
            (512, 1024, 2048, 24),
            (16384, 1024, 2048, 24),
            # Kimi-Linear's experts (256, top-8): gate ++ up [2304, 2 x 1024] and down [1024, 2304] at
            # the rows of a decode step of B 64, 128, 256 (8 B) and of an 8K-token prefill chunk
            *((8 * t, k, n, 256) for k, n in ((2304, 2048), (1024, 2304)) for t in (64, 128, 256, 8192)),
        ],
        "ragged_dot_mgpu",
        "JAX's Mosaic GPU `ragged_dot_mgpu` at the best of a short sweep of its tilings; "
        "off the GPU XLA's `lax.ragged_dot`",
        "roofline",
        "vs `moe.grouped_matmul_ref` in fp32: max |err| <= 2^-6 max |ref| + 1e-3",
        {
            "triton": "the Triton kernel",
            "hopper": "the Hopper kernel on the rows as they are",
            "hopper_padded": "the Hopper kernel through the group-aligned layout",
            "hopper_sweep": "each Hopper tiling of `HOPPER_SWEEP` (one row each)",
        },
    ),
    _b(
        "moe_ffn",
        "kernels",
        "moe",
        "moe_ffn",
        "A MoE layer's routed experts: T tokens, top-k routing, gate ++ up with SiTU-GLU, then down: "
        "`kimik3.ops.grouped_ffn`.",
        "T L F E K",
        [(64, 128, 128, 4, 2)],
        [
            (8, 768, 768, 32, 4),
            (32, 768, 768, 32, 4),
            (2048, 768, 768, 32, 4),
            (8192, 768, 768, 32, 4),
            (4096, 1024, 1024, 24, 4),
        ],
        "ragged_dot_mgpu",
        "the same experts on `ragged_dot_mgpu` (sort by expert, two GEMMs, the activation in "
        "XLA, unsort), best of a short tiling sweep; no peer off the GPU",
        "roofline",
        "vs the reference FFN (`grouped_matmul_ref` twice, fp32): <= 2^-5 max |ref| + 1e-3",
        {
            "triton": "the Triton kernels",
            "hopper": "the Hopper kernels",
            "tiling_sweep": "the Triton gate/up and down tilings of `TILINGS`, one changed at a time",
        },
    ),
    # ------------------------------------------------------------------ quant
    _b(
        "quant_linear",
        "quant",
        "quant_gemm",
        "quant_linear",
        "A projection GEMM on fp8 / mxfp8 weights (`kimik3.ops.linear` on a `QTensor`: the rows quantized, then "
        "the block-scaled Pallas kernel), `small`'s and the full-scale model's projections.",
        "M K N fmt",
        [(4, 256, 256, "fp8"), (4, 256, 256, "mxfp8")],
        [
            (m, k, n, f)
            for k, n in ((1536, 4876), (7168, 24896), (12288, 7168))
            for m in (1, 64, 8192)
            for f in ("fp8", "mxfp8")
        ],
        "bf16 XLA matmul",
        "the same projection in bf16 (`x @ w`, XLA / cuBLAS) on the dequantized weights",
        "roofline",
        "vs `ops.linear(kernels='reference')` (the same row quantization, fp32 dots): <= 2e-2 relative",
    ),
    _b(
        "mxfp4_experts",
        "quant",
        "quant_gemm",
        "mxfp4_experts",
        "Routed-expert GEMM on MXFP4 weights decoded in the kernel (`ops.grouped_matmul` on a `QTensor`; the "
        "Hopper layout where `ops.moe_mxfp4_impl` names it), rows spread uniformly over G experts.",
        "rows G K N",
        [(8, 4, 256, 256)],
        [
            (4, 56, 4096, 8192),
            (32, 56, 4096, 8192),
            (256, 56, 4096, 8192),
            (1024, 56, 4096, 8192),
            (8, 32, 768, 1536),
            (128, 32, 768, 1536),
            # Kimi-Linear's experts (256, top-8), as `moe_gemm`'s: gate ++ up and down at a decode step of
            # B 64, 128, 256 (its reference's dense expansion bounds the rows)
            *((8 * t, 256, k, n) for k, n in ((2304, 2048), (1024, 2304)) for t in (64, 128, 256)),
        ],
        "bf16 grouped GEMM",
        "our bf16 grouped GEMM (`ops.grouped_matmul`) on the same weights dequantized: what MXFP4 saves",
        "memory",
        "vs `grouped_matmul_ref` on the dequantized weights: <= 2e-2 relative",
        {
            "triton": "the Triton MXFP4 kernel",
            "hopper": "the Hopper MXFP4 kernel",
            "triton_sweep": "each Triton tiling of `MX_TILINGS`",
            "hopper_sweep": "each Hopper tiling of `HOPPER_MX_TILINGS`",
        },
    ),
    _b(
        "mxfp4_ffn",
        "quant",
        "quant_gemm",
        "mxfp4_ffn",
        "A decode step's routed experts on MXFP4 weights: `moe.grouped_ffn` (gate / up with the activation, then "
        "down), each token routed to top-k experts.",
        "T E L F K",
        [(2, 4, 128, 128, 2)],
        [(1, 32, 768, 768, 8), (32, 32, 768, 768, 8), (4, 56, 4096, 4096, 8), (64, 56, 4096, 4096, 8)],
        "bf16 grouped FFN",
        "the same FFN on the dequantized bf16 weights",
        "memory",
        "vs the same FFN on the dequantized weights: <= 3e-2 relative",
    ),
    _b(
        "quant_accuracy",
        "quant",
        "quant_accuracy",
        "quant_accuracy",
        "Held-out loss and greedy agreement of each served manifest (fp8 / mxfp8 attention, MXFP4 or bf16 "
        "experts) against bf16 and fp32, teacher-forced windows; random weights unless "
        "`--option quant_accuracy.checkpoint=DIR` names trained ones (full trains `mini` for `minutes` first).",
        "config windows window minutes manifests",
        [("tiny", 2, 32, 0.0, "fp8_attn")],
        [("mini", 32, 256, 3.0, "all")],
        None,
        "an accuracy benchmark: nothing is timed",
        None,
        "a manifest's row: each fused quantized projection group equals its members' GEMMs bit for bit; the "
        "bf16 row: mean |logit error| against fp32 <= 0.15",
    ),
    # ------------------------------------------------------------------ serving
    _b(
        "decode_step",
        "serving",
        "serving_bench",
        "decode_step",
        "The serving engine's decode program (`serving.decode_runner.decode_program`) at the bucket of B "
        "requests with ctx cached tokens each, back to back on its persistent buffers, against the bytes a "
        "step must read (weights, KV, KDA states).",
        "config B ctx",
        [("tiny", 2, 48)],
        [("small", 1, 2048), ("small", 32, 2048)],
        None,
        "no external engine serves this model",
        "memory",
        "each greedy token the program picks vs the fp32 model's step program (`model.forward_step_jit`) on the "
        "reference kernels, same pools and rows: the share of rows whose token lies more than 0.1 of the "
        "row's logit range below the oracle's best <= 0.25 for a bf16 engine (in fp32: none past 1e-3)",
    ),
    _b(
        "serving_load",
        "serving",
        "serving_bench",
        "serving_load",
        "The engine under load: N requests of `prompt` tokens and `output` new tokens at once; ours_ms is TPOT "
        "p50 (TTFT, throughput beside it).",
        "config N prompt output",
        [("tiny", 2, 48, 6)],
        [("small", n, 2048, 128) for n in (1, 4, 16, 32)],
        None,
        "no external engine serves this model",
        None,
        "the first request's tokens vs the fp32 `model.forward` on the reference kernels (teacher-forced): "
        "decode_step's margin",
        {"pd": "prefill / decode disaggregated, one engine each, stepping in threads"},
    ),
    _b(
        "host_tier",
        "serving",
        "host_tier",
        "host_tier",
        "Host KV tier: batch get of MLA pages / KDA snapshots (sized by the config) from the embedded tier.",
        "config entry",
        [("tiny", "mla_page"), ("tiny", "kda_snapshot")],
        [(c, e) for c in ("small", "kimi_k3") for e in ("mla_page", "kda_snapshot")],
        "memcpy",
        "numpy `copyto` of the same bytes, host to host",
        None,
        "every entry read back equals what was put (max |err| <= 0)",
        {"mooncake": "Mooncake's store over loopback TCP (its master, metadata and memory servers started here)"},
    ),
    _b(
        "compile_time",
        "serving",
        "startup",
        "compile_time",
        "Compile time of one decode step (`model.forward`, B rows of one token, contiguous cache) in a fresh "
        "process with no compilation cache: the first call minus the second.",
        "config B",
        [("tiny", 2)],
        [("small", 8)],
        None,
        "no peer compiles this model",
        None,
        "the two calls' logits are equal (max |err| <= 0)",
        {
            "whole": "programs='whole' (one program, as the engine compiles)",
            "fused": "the serving layout",
            "stacked": "the scanned layout",
        },
    ),
    _b(
        "init_time",
        "serving",
        "startup",
        "init_time",
        "Drawing the params (`model.init_params`) in a fresh process: seconds and peak host RSS.",
        "config",
        [("tiny",)],
        [("small",)],
        None,
        "no peer initializes this model",
        None,
        "the params' tree and shapes equal `model.abstract_params` and every value is finite",
        {
            "whole": "flax's init of the whole model as one jitted program",
            "whole_kernel": "the same with jax_threefry_gpu_kernel_lowering",
        },
    ),
    _b(
        "hf_load",
        "serving",
        "startup",
        "hf_load",
        "Loading a Hugging Face Kimi-Linear directory (`kimik3.hf.load`, streamed shard by shard) in a fresh "
        "process: seconds and the loader's own peak host memory.  The directory is synthetic (random bf16 at "
        "the checkpoint's widths, Hub names, many shards).",
        "width layers experts shard_mb",
        [("tiny", 2, 8, 1)],
        [("full", 4, 64, 256)],
        None,
        "no other JAX loader reads this checkpoint",
        None,
        "the loader's peak host RSS above its start (less the weights where they live in host memory) "
        "<= directory bytes / 4 + 2 GB",
        {"mxfp4": "the routed experts quantized to MXFP4 on the way in"},
    ),
    # ------------------------------------------------------------------ spec
    _b(
        "spec_decode",
        "spec",
        "spec_bench",
        "spec_decode",
        "Decode through the serving engine with EAGLE-3 speculative decoding (k drafted tokens per verify) "
        "against the same engine without a draft; ours_ms and peer_ms are ms per decoded token.  Random "
        "weights unless `--option spec_decode.target=DIR --option spec_decode.draft=DIR` name trained ones.",
        "config B k prompt max_new",
        [("tiny", 1, 2, 16, 8)],
        [("mini", 1, 3, 64, 128), ("mini", 8, 3, 64, 128)],
        "plain engine",
        "the same engine and requests without a draft (greedy)",
        None,
        "every request's tokens vs the fp32 `model.forward` on the reference kernels (teacher-forced): "
        "decode_step's margin",
    ),
    _b(
        "spec_acceptance",
        "spec",
        "spec_bench",
        "spec_acceptance",
        "Draft acceptance through the speculative reference (`kimik3.speculative.speculative_generate`): "
        "acceptance and accept length per k; random weights unless `--option spec_acceptance.target=DIR "
        "--option spec_acceptance.draft=DIR` name trained ones.",
        "config prompts k prompt max_new",
        [("tiny", 1, 2, 16, 6)],
        [("mini", 16, k, 48, 64) for k in (1, 2, 3, 4)],
        None,
        "an accuracy benchmark: the reference recomputes everything, its seconds say nothing",
        None,
        "the speculative tokens equal the oracle's (`generate`, fp32, no cache) exactly",
    ),
    # ------------------------------------------------------------------ model
    _b(
        "kl_decode",
        "model",
        "kimi_linear",
        "kl_decode",
        "One decode step (TPOT) of Kimi-Linear against its all-MLA twin (`kimik3.config.all_mla`), both "
        "through the serving engine's decode program (`serving.decode_runner.decode_program`) for B requests "
        "of ctx cached tokens on synthetic paged pools (hash-filled pages and KDA states, shuffled tables); "
        "random weights drawn on the device in the served layout.  `extra`: speedup_vs_twin (twin / ours), "
        "cache bytes per token of context (KV + state over ctx) of both, tokens/s, the twin's fraction of "
        "the ceiling.  Options: manifest, budget_s, seed.",
        "config manifest B ctx",
        [("tiny", "bf16", 4, 36), ("tiny", "bf16", 4, 40)],  # the check's pool and table shapes: one program
        [(*_KL, 1, c) for c in (4096, 32768, 131072, 262144, 524288, 1048576)]
        + [(*_KL, b, c) for b in (8, 32, 64, 128) for c in (4096, 32768)],
        "all-MLA twin",
        "the same model with every mixer MLA, the same decode program, pools, rows and timing; a case whose "
        "pools do not fit the device's free memory is skipped for either with a note",
        "memory",
        "on `kimi_linear.check_config` (the ci config itself; the full model cut to 3 layers, 32 experts): "
        "one step's greedy tokens vs the fp32 model on the reference kernels over the same pools and rows, "
        "`serving_bench.margin_check` (<= 0.25 of the rows past 0.1 of their logit range in bf16)",
    ),
    _b(
        "kl_prefill",
        "model",
        "kimi_linear",
        "kl_prefill",
        "Prefill latency of one prompt of T tokens (B1) through the serving engine's chunk program "
        "(`ModelRunner.forward`, chunk by chunk on paged pools, KDA exports at the engine's boundaries), "
        "Kimi-Linear against its all-MLA twin.  `extra`: speedup_vs_twin, tokens/s, TFLOP.  Options: "
        "manifest, chunk (tokens, default 4096), long=1 (adds T 256K and 512K), budget_s, seed.",
        "config manifest T",
        [("tiny", "bf16", 96)],  # as wide a table as the check's prompts: one chunk program
        [(*_KL, t) for t in (4096, 16384, 65536, 131072)],
        "all-MLA twin",
        "the same model with every mixer MLA through the same chunk program, prompt and timing",
        "compute",
        "on `kimi_linear.check_config`: the greedy token after two prompts of 2.5 chunks and 3 tokens vs "
        "the fp32 model on the reference kernels without a cache, `serving_bench.margin_check`",
    ),
    _b(
        "kl_prefix",
        "model",
        "kl_prefix",
        "kl_prefix",
        "Prefix caching on Kimi-Linear: TTFT p50 of S agent sessions of `turns` turns whose contexts grow "
        "from `first` to `last` tokens (each turn's prompt extends the previous one; a turn of every "
        "session arrives at once), KDA snapshots exported in the chunk's pass (ours) against the same "
        "engine cutting a chunk at each snapshot as vLLM's mamba_cache_mode=align does (peer) and against "
        "no prefix caching (`extra`: p50 / p99 of all three, cache rate, snapshot bytes held, first "
        "tokens equal to ours).  Options: manifest, chunk, budget_s, seed.",
        "config manifest S turns first last",
        [("tiny", "bf16", 2, 3, 80, 208)],
        [(*_KL, 4, 4, 8192, 65536)],
        "vLLM's align mode (same engine)",
        "the same engine build, prompts and compiled programs with `kda_snapshots=align`: the same "
        "snapshots, each from the end of a chunk cut there",
        None,
        "on `kimi_linear.check_config`: kl_prefill's (the chunk program's greedy token vs the fp32 model)",
    ),
)


def by_name() -> dict[str, Benchmark]:
    return {b.name: b for b in BENCHMARKS}


def select(suite: str = "all", only: list[str] | None = None) -> list[Benchmark]:
    """The benchmarks of `suite` ("all": every suite), or those named in `only`, in registry order."""
    names = by_name()
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"unknown benchmarks {unknown}; known: {sorted(names)}")
        return [b for b in BENCHMARKS if b.name in only]
    if suite != "all" and suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES + ('all',)}; got {suite!r}")
    return [b for b in BENCHMARKS if suite in ("all", b.suite)]


@dataclasses.dataclass
class Context:
    """What a benchmark function gets: its cases, the variants asked for, the run's ceilings and
    options, the timing rule at this preset's iteration counts, and `row` to report a case."""

    bench: Benchmark
    shapes: str = "ci"
    variants: Any = ()  # names, or "all"
    ceilings: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    deadline: float = float("inf")
    pick: tuple[int, ...] | None = None  # indices of the preset's cases to run (None: all)

    @property
    def ci(self) -> bool:
        return self.shapes == "ci"

    @property
    def iters(self) -> int:
        return 2 if self.ci else 20

    @property
    def warmup(self) -> int:
        return 1 if self.ci else 3

    @property
    def on_gpu(self) -> bool:
        import jax

        return jax.default_backend() == "gpu"

    def cases(self) -> tuple:
        cases = self.bench.shapes[self.shapes]
        return cases if self.pick is None else tuple(cases[i] for i in self.pick if i < len(cases))

    def label(self, case) -> str:
        return self.bench.label(case)

    def wanted(self) -> list[str]:
        """The variants of this benchmark to run beside the default, in registry order."""
        if self.variants == "all":
            return list(self.bench.variants)
        return [v for v in self.bench.variants if v in self.variants]

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def time(self, fn, *args) -> float:
        return common.pipelined_ms(fn, *args, iters=self.iters, warmup=self.warmup)

    def time_carried(self, step, carry) -> float:
        return common.carried_ms(step, carry, iters=self.iters, warmup=self.warmup)

    def time_torch(self, fn) -> float:
        return common.torch_pipelined_ms(fn, iters=self.iters, warmup=self.warmup)

    def attempt(self, case, variant: str, make_row) -> dict:
        """make_row()'s row, or an error row for (case, variant) if it raises: one case or variant
        that does not compile or run ends neither the benchmark nor the run.  Past the run's
        deadline, a skipped row without running it."""
        import logging

        if self.out_of_time():
            return dict(
                error_row(self.bench, self._case(case), "skipped: the run's budget was spent", status="skipped"),
                variant=variant,
            )
        try:
            return make_row()
        except Exception as e:  # noqa: BLE001 - reported in the row
            logging.getLogger("benchmarks").warning(
                "%s %s [%s]: %s: %s", self.bench.name, self._case(case), variant, type(e).__name__, str(e)[:300]
            )
            return dict(error_row(self.bench, self._case(case), e), variant=variant)

    def error(self, case, variant: str, message: str) -> dict:
        """An error row for (case, variant): it could not run, and why."""
        return dict(error_row(self.bench, self._case(case), message), variant=variant)

    def _case(self, case) -> str:
        return case if isinstance(case, str) else self.label(case)

    def row(
        self,
        case,
        check: dict | None,
        ours,
        *,
        variant: str = "default",
        peer_ms=None,
        peer: str | None = None,
        work: dict | None = None,
        extra: dict | None = None,
    ) -> dict:
        """One result row.  ours / peer_ms: ms, or a callable returning ms (called only when the
        check passed; a failing peer leaves peer_ms None and says why in extra).  work: {"bytes",
        "flops"} one call of ours moves / computes, for the fraction of the ceiling."""
        row = dict(
            benchmark=self.bench.name,
            case=self._case(case),
            variant=variant,
            ours_ms=None,
            peer=None,
            peer_ms=None,
            ratio=None,
            ceiling_kind=None,
            fraction_of_ceiling=None,
            check=check,
            status="ok",
            extra={} if extra is None else extra,
        )
        if check is not None and not check["ok"]:
            row["status"] = "failed"
            return row
        row["ours_ms"] = ours() if callable(ours) else ours
        if variant == "default" and self.bench.peer is not None:
            row["peer"] = peer or self.bench.peer
            try:
                row["peer_ms"] = peer_ms() if callable(peer_ms) else peer_ms
            except Exception as e:  # noqa: BLE001 - a peer that does not run leaves its column empty
                row["extra"]["peer_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if row["peer_ms"] is None:
                row["peer"] = None
        if row["ours_ms"] and row["peer_ms"]:
            row["ratio"] = row["ours_ms"] / row["peer_ms"]
        row["ceiling_kind"], row["fraction_of_ceiling"] = self._ceiling(row["ours_ms"], work or {})
        return row

    def _ceiling(self, ms, work: dict):
        kind = self.bench.ceiling
        if kind is None:
            return None, None
        bw, tf = self.ceilings.get("memory_gbs"), self.ceilings.get("compute_tflops")
        nbytes, flops = work.get("bytes"), work.get("flops")
        if kind == "roofline":
            if nbytes and flops:
                ridge = tf * 1e3 / bw if bw and tf else RIDGE_FLOP_PER_BYTE
                kind = "compute" if flops / nbytes > ridge else "memory"
            else:
                kind = "memory" if nbytes else "compute"
        if not ms:
            return kind, None
        if kind == "memory" and nbytes and bw:
            return kind, nbytes / (ms * 1e-3) / 1e9 / bw
        if kind == "compute" and flops and tf:
            return kind, flops / (ms * 1e-3) / 1e12 / tf
        return kind, None


def error_row(bench: Benchmark, what: str, error: BaseException | str, status: str = "error") -> dict:
    """A row saying a benchmark (or one of its cases) did not produce a figure, and why."""
    return dict(
        benchmark=bench.name,
        case=what,
        variant="default",
        ours_ms=None,
        peer=None,
        peer_ms=None,
        ratio=None,
        ceiling_kind=None,
        fraction_of_ceiling=None,
        check=None,
        status=status,
        extra={"error": error if isinstance(error, str) else f"{type(error).__name__}: {str(error)[:400]}"},
    )
