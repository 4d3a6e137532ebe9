"""The one place that chooses how the model's heavy operators run.

Layers call these functions, never a kernel or a reference directly.
`kernels` selects the implementation:

* ``"auto"`` (default): the Pallas kernels on GPU, the pure-jnp references elsewhere;
  ``KIMIK3_KERNELS=reference|pallas`` in the environment overrides the choice.
* ``"reference"``: the pure-jnp references (the oracle always uses these).
* ``"pallas"``: the Pallas kernels (interpret mode off the GPU: slow, for tests).
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

from pallas_kernels import kda as kda_kernels
from pallas_kernels import kda_decode as kda_decode_kernels
from pallas_kernels import mla as mla_kernels
from pallas_kernels import mla_forms
from pallas_kernels import mla_decode_hopper, mla_hopper
from pallas_kernels import moe as moe_kernels
from pallas_kernels import moe_combine, moe_hopper, moe_mxfp4_hopper, moe_route, qgemm
from pallas_kernels import mxfp4 as mxfp4_kernels
from kimik3.quant import formats as qformats
from kimik3.quant.formats import QTensor

KERNEL_CHOICES = ("auto", "reference", "pallas")
logger = logging.getLogger(__name__)


def resolve(kernels: str) -> str:
    """'reference' or 'pallas' for a `kernels` setting."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}; got {kernels!r}")
    if kernels == "auto":
        kernels = os.environ.get("KIMIK3_KERNELS", "pallas" if jax.default_backend() == "gpu" else "reference")
        if kernels not in ("reference", "pallas"):
            raise ValueError(f"KIMIK3_KERNELS must be 'reference' or 'pallas'; got {kernels!r}")
    return kernels


def kda_decode_fused(kernels: str) -> bool:
    """Whether a KDA layer's decode token runs as one kernel (`kda_decode`): on the Pallas path."""
    return resolve(kernels) == "pallas"


def kda_decode(x_in, fg, conv_pool, state_pool, slots, valid, **params):
    """One KDA decode token after its projections, on pooled conv rows and states updated in place:
    `pallas_kernels.kda_decode.kda_decode` (its arguments; the layer calls this only where
    `kda_decode_fused`).  Returns (out [B, H, V], conv pool, state pool)."""
    return kda_decode_kernels.kda_decode(x_in, fg, conv_pool, state_pool, slots, valid, **params)


# the most tokens a pass at chunk size 1 runs as the unrolled recurrent kernel (`kda`): a verify
# pass is 1 + k tokens, k <= `kimik3.speculative.MAX_DRAFT_TOKENS`
VERIFY_MAX_TOKENS = 16


def kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state=None,
    chunk_size=64,
    kernels="auto",
    export_at=None,
    slots=None,
    gate_bounded=True,
):
    """KDA over a span of tokens: [B, T, H, K] q/k/g, [B, T, H, V] v, [B, T, H] beta.

    gate_bounded: whether every g is known to lie above the bounded gate's lower bound
    (GATE_FLOOR, Kimi-K3's -5).  The chunked Pallas kernel's factored 16-token diagonal tiles need
    it (exp(16 * 5) stays finite); with an unbounded gate (Kimi-Linear's softplus form) the kernel
    computes those tiles exactly instead (`pallas_kernels.kda.diagonal`: every exponent of a
    non-positive number, any g <= 0).  The recurrent forms (one token, a verify pass) take any g <= 0.

    One token (decode) takes the recurrent form; longer spans the chunked form.
    Returns (o [B, T, H, V], final_state [B, H, K, V] fp32), and with export_at (int32 [E]
    token counts, traced) a third output: the states after them in the same pass,
    [B, E, H, K, V] fp32 (zeros for entries that are not multiples of chunk_size in 1..T).

    slots: int32 [B] or None.  With slots, `initial_state` is a state *pool* [num_slots, H, K, V]
    holding row b's state at slots[b], and the second output is the updated pool.  One decode
    token on the Pallas path updates the pool in place by slot inside the kernel (no gather or
    scatter of state rows around it: at B32 on `small` those moved ~1.2 GB a step); otherwise
    the rows are gathered, run, and scattered back.  Rows may share a slot only if its contents
    are scratch (a decode batch's padding rows).  With slots, chunk_size 1 and at most
    VERIFY_MAX_TOKENS tokens (a speculative verify pass) the Pallas path runs the recurrent
    kernel on the pool, exporting every token's state from it.  The Pallas paths on a pool donate
    it (call them inside a jitted step, or pass a copy).
    """
    b, t, h, dk = q.shape
    if slots is not None:
        if initial_state is None:
            raise ValueError("kda: slots index a state pool; pass it as initial_state")
        if resolve(kernels) == "pallas" and t == 1 and export_at is None:
            return kda_kernels.fused_recurrent_kda(q, k, v, g, beta, state_pool=initial_state, slots=slots)
        if resolve(kernels) == "pallas" and export_at is not None and chunk_size == 1 and t <= VERIFY_MAX_TOKENS:
            # a speculative verify pass (every position exports its state): the recurrence on the
            # pool by slot, the state after each token written out by the same kernel
            o, pool, states = kda_kernels.fused_recurrent_kda(
                q, k, v, g, beta, state_pool=initial_state, slots=slots, export_states=True
            )
            named = (export_at >= 1) & (export_at <= t)
            picked = jnp.take(states, jnp.clip(export_at - 1, 0, t - 1), axis=1)  # [B, E, H, K, V]
            return o, pool, jnp.where(named[None, :, None, None, None], picked, 0.0)
        out = kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state[slots],
            chunk_size=chunk_size,
            kernels=kernels,
            export_at=export_at,
            gate_bounded=gate_bounded,
        )
        return (out[0], initial_state.at[slots].set(out[1])) + tuple(out[2:])
    if export_at is not None:
        ref = lambda: kda_kernels.kda_chunked_ref(
            q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size, export_at=export_at
        )
        if resolve(kernels) == "reference" or chunk_size != kda_kernels.CHUNK:
            return ref()
        return kda_kernels.chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=True,
            export_at=export_at,
            gate_bounded=gate_bounded,
        )
    if resolve(kernels) == "reference":
        if t == 1:
            return kda_kernels.kda_recurrent_ref(q, k, v, g, beta, initial_state=initial_state)
        return kda_kernels.kda_chunked_ref(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size)
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    if t == 1:
        return kda_kernels.fused_recurrent_kda(
            q, k, v, g, beta, state_pool=initial_state, slots=jnp.arange(b, dtype=jnp.int32)
        )
    return kda_kernels.chunk_kda(
        q, k, v, g, beta, initial_state=initial_state, output_final_state=True, gate_bounded=gate_bounded
    )[:2]


# The lowest per-token log-decay the chunked kernel's factored diagonal tiles take (the bounded
# gate's bound); below it `gate_bounded=False` computes them exactly.
GATE_FLOOR = -5.0


def linear(x, w, *, kernels="auto"):
    """x [..., K] times a weight in GEMM form [K, N] -> [..., N] in x's dtype: an array (``x @ w``)
    or a `QTensor` in fp8 / mxfp8: a W8A8 GEMM, x quantized per row per K block
    (`kimik3.quant.formats.quantize_rows`), `pallas_kernels.qgemm.qmatmul` on the Pallas path,
    its reference elsewhere.  Column results read only their own weight column: fused groups are
    bit-exact against their members' GEMMs."""
    if not isinstance(w, QTensor):
        return x @ w
    if w.fmt not in qgemm.FORMATS or len(w.shape) != 2:
        raise ValueError(f"linear takes fp8 / mxfp8 [K, N] weights; got {w.fmt} {w.shape}")
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"linear: x [..., {x.shape[-1]}] and a [{k}, {n}] weight do not contract")
    bk = qgemm.block_k(w.fmt)
    pad = -k % bk  # a ragged fp8 K (the tiny model): zero rows add nothing to any block's dot
    x2 = x.reshape(-1, k)
    values = w.values
    if pad:
        x2, values = jnp.pad(x2, ((0, 0), (0, pad))), jnp.pad(values, ((0, pad), (0, 0)))
    xq, sx = qformats.quantize_rows(x2, w.fmt)
    col_block = jnp.asarray(qformats.fp8_column_blocks(n, w.segments)) if w.fmt == "fp8" else None
    gemm = qgemm.qmatmul if resolve(kernels) == "pallas" else qgemm.qmatmul_ref
    y = gemm(w.fmt, xq, sx, values, w.scales, col_block, out_dtype=x.dtype)
    return y.reshape(x.shape[:-1] + (n,))


def linear_heads(o_bthv, w_hvd, *, kernels="auto"):
    """The output projection of per-head values o [..., H, V] by w [H, V, D] (or its quantized
    GEMM form [H * V, D]) -> [..., D]."""
    if isinstance(w_hvd, QTensor):
        return linear(o_bthv.reshape(o_bthv.shape[:-2] + (-1,)), w_hvd, kernels=kernels)
    return jnp.einsum("...hv,hvd->...d", o_bthv, w_hvd)


def expert_weights(w, dtype):
    """Routed-expert weights for the grouped GEMMs: an array as it is; an MXFP4 `QTensor` (or
    experts in the Hopper kernel's layout, `hopper_mxfp4_experts`) dequantized to `dtype` (exact
    in bf16: e2m1 values times powers of two)."""
    if isinstance(w, moe_mxfp4_hopper.HopperMXFP4):
        return moe_mxfp4_hopper.dequantize(w, moe_mxfp4_hopper.DEFAULT_DECODE).astype(dtype)
    return qformats.dequantize(w).astype(dtype) if isinstance(w, QTensor) else w


def _packed_mxfp4(w, dtype):
    """An MXFP4 `QTensor` the Pallas kernels decode themselves (`pallas_kernels.mxfp4`) for rows of
    a 16-bit dtype, as their `PackedMXFP4`; experts already in the Hopper kernel's layout, for
    bf16 rows, as they are; None for anything else."""
    if isinstance(w, moe_mxfp4_hopper.HopperMXFP4):
        return w if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else None
    if (
        isinstance(w, QTensor)
        and w.fmt == "mxfp4"
        and jnp.dtype(dtype).itemsize == 2
        and w.shape[-2] % 32 == 0
        and w.shape[-1] % 32 == 0
    ):
        return mxfp4_kernels.PackedMXFP4(w.values, w.scales)
    return None


MOE_MXFP4_CHOICES = ("triton", "hopper", "auto")


def moe_mxfp4_impl(compute_capability: str | None) -> str:
    """Which kernel runs MXFP4 routed experts: "hopper" (`pallas_kernels.moe_mxfp4_hopper`: the
    codes decoded in registers as wgmma's A operand, 1.44-1.45x the Triton MXFP4 kernel and
    2.8-3.1x bf16 at a full-scale rank's decode rows on an H100, RESULTS.md) or
    "triton" (`pallas_kernels.moe` with `mxfp4.PackedMXFP4`, any GPU).  ``KIMIK3_MOE_MXFP4``
    chooses: "auto" (the default: "hopper" on a 9.x GPU, where `small`'s MXFP4 experts in the
    Hopper layout serve in the engine as close to fp32 as the Triton ones, tests/gpu),
    "triton" always, and "hopper" (as "auto", and off the GPU in Mosaic GPU's
    interpreter).  The kernel figures are the GEMM's alone: in the FFN the activation between
    the two GEMMs runs as XLA ops (a round trip of the gate / up rows that the Triton kernel's
    epilogue saves), so the layer's gain is yet to be measured."""
    choice = os.environ.get("KIMIK3_MOE_MXFP4", "auto")
    if choice not in MOE_MXFP4_CHOICES:
        raise ValueError(f"KIMIK3_MOE_MXFP4 must be one of {MOE_MXFP4_CHOICES}; got {choice!r}")
    if choice == "triton":
        return "triton"
    if compute_capability is None:
        return "hopper" if choice == "hopper" else "triton"
    return "hopper" if str(compute_capability).startswith("9") else "triton"


def hopper_mxfp4_experts(params, dtype="bfloat16", compute_capability: str | None = None):
    """params with every MXFP4 expert tensor (a `QTensor` [E, K, N] of format "mxfp4") that the
    Hopper kernel tiles (K a multiple of its 256-wide K steps, N of its 128 columns) moved into
    that kernel's layout (`moe_mxfp4_hopper.to_hopper` for its `DEFAULT_DECODE`, the layout
    `expert_weights` and the kernels read: the same codes and scales, reordered), where
    `moe_mxfp4_impl` names "hopper" and the rows are bf16 (`dtype`, the serving dtype: the
    kernel multiplies bf16 rows); else params as they are.  Done once, when serving weights load
    (the model runner): the grouped GEMMs then read the experts as they lie, at 4.25 bits a
    weight.  Pure data movement: every weight keeps its value.  A tree with the periods stacked
    (values [P, E, K, N / 2]) is not moved: a warning says so."""
    cc = compute_capability if compute_capability is not None else device_compute_capability()
    if moe_mxfp4_impl(cc) != "hopper" or jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return params
    stacked = []  # experts of a tree stacked by period, left as they are

    def move(w):
        if not (isinstance(w, QTensor) and w.fmt == "mxfp4" and len(w.shape) == 3):
            return w
        if w.values.ndim != 3:
            stacked.append(w)
            return w
        if w.shape[1] % 256 == 0 and w.shape[2] % 128 == 0:
            return _to_hopper(mxfp4_kernels.PackedMXFP4(w.values, w.scales))
        return w

    out = jax.tree_util.tree_map(move, params, is_leaf=lambda x: isinstance(x, QTensor))
    if stacked:
        logger.warning(
            "KIMIK3_MOE_MXFP4: %d MXFP4 expert tensors are stacked by period (scan_layers='all'); they "
            "stay on the Triton MXFP4 kernels",
            len(stacked),
        )
    return out


_to_hopper = jax.jit(moe_mxfp4_hopper.to_hopper)  # one program: no int8 [E, K, N] temporaries op by op


def grouped_matmul(lhs_mk, rhs_gkn, group_sizes_g, *, kernels="auto"):
    """Routed-expert GEMM: rows [M, K] sorted by group, weights [G, K, N], group_sizes [G] -> [M, N].

    The Hopper kernel on the rows as they are where `moe_gmm_impl` names it
    (`moe_hopper.grouped_matmul`); else Pallas `grouped_matmul` where its tiling fits (K, N multiples of 16, one dtype),
    else `lax.ragged_dot` (the reference).  MXFP4 weights (`QTensor`): on the Pallas path with
    16-bit rows, decoded inside the kernel (`pallas_kernels.moe_mxfp4`: read at 4.25 bits);
    elsewhere dequantized first (exact in the rows' dtype)."""
    packed = _packed_mxfp4(rhs_gkn, lhs_mk.dtype)
    if isinstance(packed, moe_mxfp4_hopper.HopperMXFP4) and resolve(kernels) == "pallas":
        return moe_mxfp4_hopper.grouped_matmul(lhs_mk, packed, group_sizes_g, interpret=jax.default_backend() != "gpu")
    if packed is not None and resolve(kernels) == "pallas":
        return moe_kernels.grouped_matmul(lhs_mk, packed, group_sizes_g)
    rhs_gkn = expert_weights(rhs_gkn, lhs_mk.dtype)
    if (
        resolve(kernels) == "pallas"
        and moe_gmm_impl(lhs_mk.dtype, ((rhs_gkn, False),), lhs_mk.shape[0], device_compute_capability()) == "hopper"
    ):
        return moe_hopper.grouped_matmul(lhs_mk, rhs_gkn, group_sizes_g, interpret=jax.default_backend() != "gpu")
    if (
        resolve(kernels) == "pallas"
        and lhs_mk.dtype == rhs_gkn.dtype
        and moe_kernels.kernel_dims_ok(lhs_mk.shape[1], rhs_gkn.shape[2])
    ):
        return moe_kernels.grouped_matmul(lhs_mk, rhs_gkn, group_sizes_g)
    return moe_kernels.grouped_matmul_ref(lhs_mk, rhs_gkn, group_sizes_g)


def _ffn_weights(x_nl, w_gateup_elf, w_out_efl):
    """The experts' weights as `pallas_kernels.moe.grouped_ffn` takes them (arrays of x's dtype or
    `PackedMXFP4`), or None where it does not tile them."""
    out = []
    if isinstance(w_gateup_elf, moe_mxfp4_hopper.HopperMXFP4) != isinstance(w_out_efl, moe_mxfp4_hopper.HopperMXFP4):
        return None  # `hopper_mxfp4_experts` moved one of the two: the kernels take both or neither
    for w, (k, n) in (
        (w_gateup_elf, (x_nl.shape[1], w_gateup_elf.shape[2])),
        (w_out_efl, (w_out_efl.shape[1], w_out_efl.shape[2])),
    ):
        packed = _packed_mxfp4(w, x_nl.dtype)
        if packed is None and isinstance(w, moe_mxfp4_hopper.HopperMXFP4):
            return None  # rows other than bf16: the per-projection path, dequantized (`expert_weights`)
        if packed is not None and w is w_gateup_elf and (n // 2) % 32:  # the gate/up kernel tiles F = 2F / 2
            return None
        if packed is not None:
            out.append(packed)
        elif not isinstance(w, QTensor) and x_nl.dtype == w.dtype and moe_kernels.kernel_dims_ok(k, n):
            out.append(w)
        else:
            return None
    return tuple(out)


def grouped_ffn_fits(x_nl, w_gateup_elf, w_out_efl, kernels="auto") -> bool:
    """Whether `grouped_ffn` (Pallas) serves these experts: fused gate/up weights in x's dtype or
    MXFP4 (16-bit rows), dims the kernel tiles."""
    return resolve(kernels) == "pallas" and _ffn_weights(x_nl, w_gateup_elf, w_out_efl) is not None


def grouped_ffn(x_nl, ids_nk, w_gateup_elf, w_out_efl, act):
    """Every routed expert FFN in one group-aligned layout (`pallas_kernels.moe.grouped_ffn`):
    rows [N, L], ids [N, k] -> unweighted outputs [N, k, L], on the kernels `moe_gmm_impl`
    names.  Callers check `grouped_ffn_fits`."""
    weights = _ffn_weights(x_nl, w_gateup_elf, w_out_efl)
    return moe_kernels.grouped_ffn(x_nl, ids_nk, *weights, act=act, impl=_ffn_impl(x_nl, weights, ids_nk.size))


def _ffn_impl(x_nl, weights, assignments: int) -> str:
    """grouped_ffn's impl for `_ffn_weights`' weights: "hopper" for experts in the Hopper MXFP4
    layout, else `moe_gmm_impl`'s choice."""
    if isinstance(weights[0], moe_mxfp4_hopper.HopperMXFP4):
        return "hopper"
    return moe_gmm_impl(x_nl.dtype, ((weights[0], True), (weights[1], False)), assignments, device_compute_capability())


MOE_GMM_CHOICES = ("triton", "hopper", "auto")
# Under KIMIK3_MOE_GMM=auto, the fewest (token, slot) assignments the Hopper kernels take: a
# prefill chunk's GEMMs are compute-bound, where wgmma + TMA count; a decode step's few rows per
# expert stay on the Triton kernels (and their one-kernel routing, `routed_ffn`).
HOPPER_MOE_MIN_ASSIGNMENTS = 1024


def moe_gmm_impl(dtype, gemms, assignments: int, compute_capability: str | None) -> str:
    """Which grouped-GEMM kernels run: "hopper" (`pallas_kernels.moe_hopper`: Mosaic GPU, wgmma +
    TMA, persistent, warp-specialized) or "triton" (`pallas_kernels.moe`: any GPU, MXFP4 too).
    Only 16-bit weights of the rows' dtype that `moe_hopper.fits` can go to "hopper".
    ``KIMIK3_MOE_GMM`` chooses.  "auto" (the default) takes "hopper" on a 9.x GPU from
    HOPPER_MOE_MIN_ASSIGNMENTS assignments: there its grouped FFN took 0.70-0.90x the Triton
    one's time (prefill sizes, H100, RESULTS.md).  "hopper" takes it on a 9.x GPU whatever the
    rows (off the GPU, in the interpreter); "triton" never does.  gemms: the (weights [G, K, N],
    act?) the kernels would run (the FFN's gate/up with its activation and down; or one GEMM)."""
    choice = os.environ.get("KIMIK3_MOE_GMM", "auto")
    if choice not in MOE_GMM_CHOICES:
        raise ValueError(f"KIMIK3_MOE_GMM must be one of {MOE_GMM_CHOICES}; got {choice!r}")
    fits = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and all(
        not isinstance(w, (mxfp4_kernels.PackedMXFP4, QTensor))
        and jnp.dtype(w.dtype) == jnp.dtype(dtype)
        and moe_hopper.fits(w.shape[1], w.shape[2], act=act)
        for w, act in gemms
    )
    hopper = compute_capability is not None and str(compute_capability).startswith("9")
    if choice == "triton" or not fits:
        return "triton"
    if choice == "hopper":  # off a GPU (compute capability None) in Mosaic GPU's interpreter
        return "hopper" if hopper or compute_capability is None else "triton"
    return "hopper" if hopper and assignments >= HOPPER_MOE_MIN_ASSIGNMENTS else "triton"


def moe_route_kernel() -> bool:
    """Whether `routed_ffn` may serve a decode step: ``KIMIK3_MOE_ROUTE=kernel`` (the default) or
    ``xla`` (routing and layout as XLA ops; `RESULTS.md` has both on the H200)."""
    choice = os.environ.get("KIMIK3_MOE_ROUTE", "kernel")
    if choice not in ("xla", "kernel"):
        raise ValueError(f"KIMIK3_MOE_ROUTE must be 'xla' or 'kernel'; got {choice!r}")
    return choice == "kernel"


def routed_ffn_fits(x_nl, w_gateup_elf, w_out_efl, top_k: int, kernels="auto") -> bool:
    """Whether `routed_ffn` serves N tokens: `moe_route_kernel` is on, `grouped_ffn` fits and the
    routing is one `moe_route.route_layout` program (powers of two; a decode step's few tokens)."""
    return (
        moe_route_kernel()
        and grouped_ffn_fits(x_nl, w_gateup_elf, w_out_efl, kernels)
        and moe_route.route_layout_fits(x_nl.shape[0], w_gateup_elf.shape[0], top_k)
        and moe_combine.combine_norm_fits(x_nl.shape[1])
    )


def routed_ffn(x_nl, logits_ne, bias_e, real_n, w_gateup_elf, w_out_efl, act, top_k: int, latent_norm_l, eps: float):
    """Routed experts from router logits, to the latent norm: `moe_route.route_layout` (sigmoid
    routing and the group-aligned layout in one kernel), `grouped_ffn` on that layout, then
    `moe_combine.combine_norm` (the routing-weighted sum of each token's rows and the latent
    RMSNorm in one kernel, reading the rows where they lie).  x [N, L], logits [N, E] fp32,
    real [N] or None -> rms_norm(combine) [N, L].  Callers check `routed_ffn_fits`."""
    weights, dest, tiles = moe_route.route_layout(logits_ne, bias_e, real_n, top_k=top_k)
    experts = _ffn_weights(x_nl, w_gateup_elf, w_out_efl)
    hopper_mx = isinstance(experts[0], moe_mxfp4_hopper.HopperMXFP4)  # else the Triton kernels: a step's few rows
    y_rows, dest = moe_kernels.grouped_ffn(
        x_nl, None, *experts, act=act, layout=(dest, tiles), gather=False, impl="hopper" if hopper_mx else "triton"
    )
    return moe_combine.combine_norm(y_rows, dest, weights, latent_norm_l, eps=eps)


def kda_export_mask(export_at, t: int, chunk_size: int):
    """Which entries of a KDA export_at [E] name a state that a pass over t tokens exports."""
    return kda_kernels.export_mask(export_at, t, chunk_size)


def _pages_for(length: int) -> int | None:
    """Page size to view a contiguous [B, S, D] cache as pages, or None if S has no usable divisor."""
    for page in (128, 64, 32, 16):
        if length % page == 0:
            return page
    return None


def mla_attention(
    q_bthd,
    latent_bsr,
    w_kb_rhn,
    w_vb_rhv,
    *,
    kv_lora: int,
    scale: float,
    q_pos_bt,
    k_pos_bs,
    absorbed: bool,
    contiguous_cache: bool,
    paged=None,
    kernels="auto",
):
    """MLA attention of queries [B, T, H, nope + rope] over latent rows [B, S, kv_lora + rope] -> [B, T, H, v].

    `absorbed` picks the form (latent MQA vs expanded heads).  On the Pallas path, over a
    cache viewed as pages: the absorbed form (decode, speculative verify) runs the paged
    decode kernel (`mla_decode_impl`: Hopper or Triton); the expanded form (a prefill chunk
    continuing a cache, whose prefix length may be traced, as in the serving engine's jitted
    steps) runs `mla_prefill_chunk`: the prefix expanded from its pages, the chunk causal.
    The absorbed kernel would serve a chunk too, but at 2 x (kv_lora + rope + kv_lora) FLOPs
    per query-key pair and head against the expanded form's 2 x (nope + rope + v): 3.4x at
    the model's dims.  Fresh tokens (no cache) run `mla_prefill` (Hopper or Triton,
    `mla_prefill_impl`).
    """
    rope = latent_bsr.shape[-1] - kv_lora
    b, t, h, _ = q_bthd.shape
    if resolve(kernels) == "pallas":
        page = _pages_for(latent_bsr.shape[1])
        if contiguous_cache and (page or paged is not None) and _kernel_dims_ok(kv_lora, rope):
            if paged is not None:
                pages, table = paged
            else:
                s = latent_bsr.shape[1]
                pages = latent_bsr.reshape(b * s // page, page, latent_bsr.shape[-1])
                table = jnp.arange(b * s // page, dtype=jnp.int32).reshape(b, s // page)
            if not absorbed:
                # the chunk's own rows; "clip": the pad tokens of a padded chunk may sit past the
                # table, and a NaN fill there would reach real rows through 0 * NaN in P @ V
                chunk = jnp.take_along_axis(latent_bsr, q_pos_bt[..., None], axis=1, mode="clip")
                k, v = mla_forms.expand_heads(chunk, w_kb_rhn, w_vb_rhv)
                prefix = mla_kernels.LatentPrefix(pages, table, q_pos_bt[:, 0], w_kb_rhn, w_vb_rhv)
                if mla_chunk_impl(k.dtype, k.shape[-1], v.shape[-1], device_compute_capability(), t) == "hopper":
                    o, _ = mla_hopper.mla_prefill_chunk_hopper(
                        q_bthd.astype(k.dtype),
                        k,
                        v,
                        prefix,
                        scale=scale,
                        block_kv=mla_hopper.prefill_block_kv(k.shape[-1], v.shape[-1]),
                    )
                else:
                    o, _ = mla_kernels.mla_prefill_chunk(
                        q_bthd.astype(k.dtype), k, v, prefix, scale=scale, rope_dim=rope
                    )
                return o
            # the queries take the pages' dtype, never the pages the queries': an fp32 draft
            # head on a bf16 pool would otherwise convert the whole pool at every call
            q_latent, q_pe = mla_forms.absorb_query(q_bthd, w_kb_rhn)
            out_dtype, q_latent = q_latent.dtype, q_latent.astype(pages.dtype)
            impl = mla_decode_impl(
                q_latent.dtype,
                kv_lora,
                rope,
                pages.shape[1],
                t * h,
                table.shape[1] * pages.shape[1],
                device_compute_capability(),
            )
            decode = mla_decode_hopper.mla_decode_hopper if impl == "hopper" else mla_kernels.mla_decode
            o_latent, _ = decode(q_latent, q_pe.astype(q_latent.dtype), pages, table, q_pos_bt[:, -1] + 1, scale=scale)
            return mla_forms.unabsorb(o_latent.astype(out_dtype), w_vb_rhv)
        if not absorbed and not contiguous_cache:
            k, v = mla_forms.expand_heads(latent_bsr, w_kb_rhn, w_vb_rhv)
            pack = lambda x: x.reshape((b * t,) + x.shape[2:])
            args = (pack(q_bthd.astype(k.dtype)), pack(k), pack(v))
            cu = [i * t for i in range(b + 1)]
            if mla_prefill_impl(k.dtype, k.shape[-1], v.shape[-1], device_compute_capability()) == "hopper":
                o, _ = mla_hopper.mla_prefill_hopper(
                    *args, cu_seqlens=cu, scale=scale, block_kv=mla_hopper.prefill_block_kv(k.shape[-1], v.shape[-1])
                )
            else:
                o, _ = mla_kernels.mla_prefill(*args, cu_seqlens=cu, scale=scale, rope_dim=rope)
            return o.reshape(b, t, h, -1)
    form = mla_forms.mla_absorbed if absorbed else mla_forms.mla_naive
    return form(q_bthd, latent_bsr, w_kb_rhn, w_vb_rhv, scale=scale, q_pos_bt=q_pos_bt, k_pos_bs=k_pos_bs)


def device_compute_capability() -> str | None:
    """The first device's CUDA compute capability ("9.0"), or None off NVIDIA GPUs."""
    device = jax.devices()[0]
    return getattr(device, "compute_capability", None) if device.platform == "gpu" else None


def mla_prefill_impl(dtype, dqk: int, dv: int, compute_capability: str | None) -> str:
    """Which Pallas prefill kernel runs: "hopper" (Mosaic GPU, wgmma + TMA: faster than cuDNN
    doing the same work, and about twice the Triton kernel's speed on Hopper: RESULTS.md, MLA
    kernels) for 16-bit inputs with head dims that are multiples of 64 on a compute capability
    9.x GPU, else "triton" (any dims and dtypes, any GPU; interpret mode on CPU)."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    hopper = compute_capability is not None and str(compute_capability).startswith("9")
    return "hopper" if hopper and sixteen_bit and mla_hopper.supports(dqk, dv) else "triton"


MLA_CHUNK_CHOICES = ("triton", "hopper", "auto")
# Under KIMIK3_MLA_CHUNK=auto, the fewest new tokens a chunk takes the Hopper kernel at: one tile
# of its two compute warpgroups' rows (2 x 64).  A shorter chunk pads that tile (a 64-token
# chunk: half of it), and each program holding the kernel pays its Mosaic GPU lowering, seconds
# of Python (RESULTS.md, serving): a serving engine's short-chunk bucket
# (`serving.model_runner.prefill_buckets`: 64 tokens) stays on the Triton kernel.
HOPPER_CHUNK_MIN_TOKENS = 128


def mla_chunk_impl(dtype, dqk: int, dv: int, compute_capability: str | None, chunk_tokens: int) -> str:
    """Which kernel runs a prefill chunk of `chunk_tokens` new tokens (padded) continuing a cache
    (the expanded form): "hopper" (`mla_hopper.mla_prefill_chunk_hopper`, 128-key blocks where
    they fit) or "triton" (`mla.mla_prefill_chunk`).  ``KIMIK3_MLA_CHUNK`` chooses: "auto" (the
    default: "hopper" where `mla_prefill_impl` picks it and the chunk has at least
    HOPPER_CHUNK_MIN_TOKENS tokens), "triton", and "hopper" (whatever the chunk's length, and
    off the GPU in Mosaic GPU's interpreter).  The Hopper kernel's rows pass on the GPU, and in
    `small`'s model its chunk logits are as close to fp32 as the Triton kernel's (`tests/gpu`,
    RESULTS.md)."""
    choice = os.environ.get("KIMIK3_MLA_CHUNK", "auto")
    if choice not in MLA_CHUNK_CHOICES:
        raise ValueError(f"KIMIK3_MLA_CHUNK must be one of {MLA_CHUNK_CHOICES}; got {choice!r}")
    if choice == "triton" or (choice == "auto" and chunk_tokens < HOPPER_CHUNK_MIN_TOKENS):
        return "triton"
    if choice == "hopper" and compute_capability is None:  # the interpreter, off the GPU: Hopper's rules
        compute_capability = "9.0"
    return mla_prefill_impl(dtype, dqk, dv, compute_capability)


def mla_decode_impl(
    dtype, kv_lora: int, rope: int, page: int, rows: int, max_keys: int, compute_capability: str | None
) -> str:
    """Which Pallas absorbed decode runs: "hopper" (Mosaic GPU, FlashMLA's layout on wgmma:
    several times the Triton kernel's speed at 96-128 heads, and faster at 16 heads once
    contexts reach 8k: RESULTS.md, MLA kernels) for 16-bit inputs with kv_lora % 128 == 0,
    rope % 64 == 0 and 32-token-aligned pages on a compute capability 9.x GPU, when heads x
    query tokens (`rows`) fill a 64-row wgmma tile or the block table spans >= 16k keys
    (`max_keys`); else "triton" (16-row blocks: faster for few rows over short contexts,
    where a launch's fixed cost dominates)."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    hopper = compute_capability is not None and str(compute_capability).startswith("9")
    dims = kv_lora % 128 == 0 and rope % 64 == 0 and page % 32 == 0
    enough = rows >= 64 or max_keys >= 16384
    return "hopper" if hopper and sixteen_bit and dims and enough else "triton"


def _kernel_dims_ok(kv_lora: int, rope: int) -> bool:
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    return pow2(kv_lora) and pow2(rope)
