"""Grouped (ragged) expert GEMM for the MoE, and its reference.

``out[r] = lhs[r] @ rhs[g(r)]`` where rows arrive sorted by group and group g
owns ``group_sizes[g]`` consecutive rows: what `jax.lax.ragged_dot` computes,
and what every routed-expert projection of LatentMoE is.  On the H200,
`lax.ragged_dot` runs 15-39x slower than a Pallas grouped kernel, and the
routed experts are most of the weights a decode step reads.

`grouped_matmul` (Pallas, Triton backend) first scatters the rows into a padded
layout where every group starts on a `block_m` boundary, so each row tile
belongs to one group; the kernel then runs one (row tile, column tile) program
each, reading that group's weight slice once per tile (a decode step with a few
rows per expert reads each active expert's weights once), and tiles past the
last group write zeros.  The scatter / gather around it moves only activations.
The layout and its bookkeeping: `pallas_kernels.moe_layout`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dots, moe_hopper, moe_mxfp4_hopper, mxfp4
from pallas_kernels.moe_layout import (
    assignment_layout,
    group_of_rows,
    layout_block_m,
    layout_sources,
    layout_tiles,
    through_padded_layout,
)


# `grouped_matmul_ref` gathers each row's expert weights while the gathered copy is at most
# this many times the weights (M <= ratio * G rows: a decode step's few tokens); past it,
# `lax.ragged_dot`.  XLA:CPU expands ragged_dot into one dense GEMM over every group with a
# transposed copy of the weights: G times the FLOPs of the rows' own experts (on `small`'s
# B8 decode step, 32x, and 2.2 GB of weight copies: most of a 3.5 s CPU step; 1.0 s gathered).
GATHER_ROWS_PER_GROUP = 2
# Past this many bytes of gathered fp32 weights (XLA:CPU upcasts a bf16 batched dot's operands),
# the few rows run one by one, each reading its group's weights in place: `small`'s B8 decode
# gathered 32 x 4.5 MB of fp32 expert weights per layer, written and read again each step.
GATHER_BYTES_LIMIT = 32 << 20


def grouped_matmul_ref(lhs_mk, rhs_gkn, group_sizes_g):
    """Reference: ``out[r] = lhs[r] @ rhs[g(r)]`` with fp32 accumulation, what `jax.lax.ragged_dot`
    computes.  lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (rows past their sum give 0)
    -> [M, N] in lhs's dtype.  A few rows (M <= GATHER_ROWS_PER_GROUP * G) gather their groups'
    weights and run one batched dot (one dot per row where that copy would pass
    GATHER_BYTES_LIMIT); more run `lax.ragged_dot`."""
    m, g = lhs_mk.shape[0], rhs_gkn.shape[0]
    precision = jax.lax.Precision.HIGHEST if lhs_mk.dtype == jnp.float32 else None
    if m <= GATHER_ROWS_PER_GROUP * g:
        group = group_of_rows(group_sizes_g, m)
        if m * rhs_gkn.shape[1] * rhs_gkn.shape[2] * 4 <= GATHER_BYTES_LIMIT:
            w_mkn = rhs_gkn[jnp.minimum(group, g - 1)]
            out = jnp.einsum("mk,mkn->mn", lhs_mk, w_mkn, preferred_element_type=jnp.float32, precision=precision)
        else:  # row by row, each row's weights read in place
            out = jax.lax.map(
                lambda a: jnp.dot(
                    a[0][None],
                    rhs_gkn[jnp.minimum(a[1], g - 1)],
                    preferred_element_type=jnp.float32,
                    precision=precision,
                )[0],
                (lhs_mk, group),
            )
        out = jnp.where((group < g)[:, None], out, 0.0)
    else:
        out = jax.lax.ragged_dot(
            lhs_mk, rhs_gkn, group_sizes_g.astype(jnp.int32), preferred_element_type=jnp.float32, precision=precision
        )
    return out.astype(lhs_mk.dtype)


def _pick(n: int, choices) -> int | None:
    return next((c for c in choices if n % c == 0), None)


def kernel_dims_ok(k: int, n: int) -> bool:
    """Whether `grouped_matmul` tiles these dims (K by 64/32/16, N by 128/64/32/16)."""
    return _pick(k, (64, 32, 16)) is not None and _pick(n, (128, 64, 32, 16)) is not None


def _gmm_kernel(tile_group_ref, *refs, block_k, n_k, precision, act=None, top_k=None, mx_ptx=None):
    """One (row tile, column tile).  act: None, or the output is act(gate, up) of the weights'
    two halves (w [G, K, 2F] gate ++ up; this program's columns j of each, o [.., F]).
    top_k: None, the rows come in the layout (x_pad [R, K]); else refs start with dest [A]
    (each (token, slot) assignment's layout row) and x is the tokens' rows [N, K]: the program
    finds which assignment sits in each of its rows and loads that token's row (masked: empty
    rows read zeros), so no padded copy of x is written first.
    mx_ptx: None, w is [G, K, N] in x's dtype; else the weights are MXFP4 (`mxfp4.PackedMXFP4`:
    refs hold its packed values [G, K, N / 2] and scale bits [G, K / 32, N] uint8 in place of w)
    and each 32-K step decodes its tile (`mxfp4.decode_tile`, in PTX if mx_ptx) into the even
    and odd columns' values: two accumulators a column group, stored to the even and odd columns."""
    dest_ref = None if top_k is None else refs[0]
    if mx_ptx is None:
        x_ref, w_ref, o_ref = refs[-3:]
    else:
        x_ref, wp_ref, ws_ref, o_ref = refs[-4:]
        w_ref = ws_ref  # its last dim is N
    i, j = pl.program_id(0), pl.program_id(1)
    bm, bn = o_ref.shape
    g = tile_group_ref[i]
    cols = (0,) if act is None else (0, w_ref.shape[2] // 2)  # where each accumulator's columns start

    @pl.when(g >= 0)
    def _():
        if dest_ref is None:
            load_x = lambda start, width: x_ref[pl.ds(i * bm, bm), pl.ds(start, width)]
        else:
            dest = dest_ref[...]  # [A]
            a = dest.shape[0]
            hit = dest[None, :] == i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, a), 0)  # [bm, A]
            token = jnp.sum(jnp.where(hit, jax.lax.broadcasted_iota(jnp.int32, (bm, a), 1) // top_k, 0), axis=1)
            filled = jnp.sum(hit.astype(jnp.int32), axis=1) > 0

            def load_x(start, width):
                column = jax.lax.broadcasted_iota(jnp.int32, (bm, width), 1)
                return pltriton.load(
                    x_ref.at[jnp.broadcast_to(token[:, None], (bm, width)), start + column],
                    mask=jnp.broadcast_to(filled[:, None], (bm, width)),
                    other=0,
                )

        if mx_ptx is None:

            def body(kk, accs):
                xs = load_x(kk * block_k, block_k)
                return tuple(
                    acc
                    + jnp.dot(
                        xs,
                        w_ref[g, pl.ds(kk * block_k, block_k), pl.ds(c + j * bn, bn)],
                        preferred_element_type=jnp.float32,
                        precision=precision,
                    )
                    for acc, c in zip(accs, cols)
                )

            n_acc, width = len(cols), bn
        else:
            half_cols = jax.lax.broadcasted_iota(jnp.int32, (bn // 2,), 0)

            def body(kk, accs):
                accs = list(accs)
                for sub in range(block_k // mxfp4.MX_BLOCK):  # one scale row per 32 K
                    k0 = kk * block_k + sub * mxfp4.MX_BLOCK
                    xs = load_x(k0, mxfp4.MX_BLOCK)
                    for a, c in enumerate(cols):
                        packed = wp_ref[g, pl.ds(k0, mxfp4.MX_BLOCK), pl.ds(c // 2 + j * (bn // 2), bn // 2)]
                        s_row = kk * (block_k // mxfp4.MX_BLOCK) + sub
                        s_even, s_odd = (
                            pltriton.load(ws_ref.at[g, s_row, c + j * bn + 2 * half_cols + h]).astype(jnp.int32)
                            for h in (0, 1)
                        )
                        for h, w in enumerate(mxfp4.decode_tile(packed, s_even, s_odd, xs.dtype, ptx=mx_ptx)):
                            accs[2 * a + h] = accs[2 * a + h] + jnp.dot(xs, w, preferred_element_type=jnp.float32)
                return tuple(accs)

            n_acc, width = 2 * len(cols), bn // 2

        accs = jax.lax.fori_loop(0, n_k, body, tuple(jnp.zeros((bm, width), jnp.float32) for _ in range(n_acc)))
        # the GEMM's output rounds to the rows' dtype, as an unfused act would read it; act runs in fp32
        rounded = lambda v: v.astype(o_ref.dtype).astype(jnp.float32)
        phases = 1 if mx_ptx is None else 2
        outs = [accs[h] if act is None else act(rounded(accs[h]), rounded(accs[phases + h])) for h in range(phases)]
        if mx_ptx is None:
            o_ref[...] = outs[0].astype(o_ref.dtype)
        else:  # even and odd columns
            rows = jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
            for h, v in enumerate(outs):
                pltriton.store(o_ref.at[rows, 2 * half_cols[None, :] + h], v.astype(o_ref.dtype))

    @pl.when(g < 0)
    def _():
        o_ref[...] = jnp.zeros((bm, bn), o_ref.dtype)


def _check_gmm(what: str, k: int, lhs_dtype, rhs_gkn):
    """ValueError before any launch unless rows [.., K] of lhs_dtype meet weights [G, K, N] (an
    array of lhs_dtype, or `mxfp4.PackedMXFP4` with 16-bit rows) the kernel tiles."""
    if rhs_gkn.shape[1] != k:
        raise ValueError(f"{what}: lhs rows of {k} and rhs {tuple(rhs_gkn.shape)} do not match ([M, K], [G, K, N])")
    if isinstance(rhs_gkn, mxfp4.PackedMXFP4):
        mxfp4.check(rhs_gkn, what)
        if jnp.dtype(lhs_dtype).itemsize != 2:
            raise ValueError(f"{what}: MXFP4 weights multiply 16-bit rows; got {lhs_dtype}")
        if k % 32 or rhs_gkn.shape[2] % 32:
            raise ValueError(f"{what}: MXFP4 K={k} and N={rhs_gkn.shape[2]} must be multiples of 32")
        return
    if lhs_dtype != rhs_gkn.dtype:
        raise ValueError(f"{what}: lhs {lhs_dtype} and rhs {rhs_gkn.dtype} must share a dtype")
    if not kernel_dims_ok(k, rhs_gkn.shape[2]):
        raise ValueError(f"{what}: K={k} and N={rhs_gkn.shape[2]} must be multiples of 16")


# (block_n, block_k, num_warps, num_stages) of one grouped GEMM: None picks by shape (`_tiling`)
Tiling = tuple[int, int, int, int]


def _tiling(k: int, n: int, tiling: Tiling | None, mx: tuple[int, int, bool] | None = None) -> Tiling:
    """The kernel's tiling for [K] rows times [G, K, N]: `tiling` checked, or the widest tiles
    that divide (every tiling within 5% of these at decode; the moe_ffn benchmark's `tiling_sweep`
    variant times them).
    mx: an MXFP4 GEMM's (assignments, block_m, act) (`mx_tiling`'s defaults; block_n and block_k
    multiples of 32)."""
    if tiling is not None:
        bn, bk = tiling[:2]
        if n % bn or k % bk or (mx is not None and (bk % 32 or bn % 32)):
            raise ValueError(
                f"grouped GEMM tiling {tiling}: block_n {bn} / block_k {bk} must divide N={n} / K={k}"
                + ("" if mx is None else " and be multiples of 32 (MXFP4)")
            )
        return tiling
    if mx is not None:
        return mx_tiling(*mx, k, n)
    return (_pick(n, (128, 64, 32, 16)), _pick(k, (64, 32, 16)), 4, 3)


def mx_tiling(assignments: int, block_m: int, act: bool, k: int, n: int) -> Tiling:
    """MXFP4 weights: each program decodes its [block_k, block_n] weight tile 32 K at a time (ALU
    work the bf16 kernel does not have).  Wide column tiles (fewer decodes of the shared x rows,
    long runs of packed bytes) win from a few dozen assignments up; a handful of assignments
    (<= 16: a few experts) take narrow ones to spread each expert over more programs; 64-row
    tiles with the activation's two halves (four fp32 accumulators) stay at 128 columns.
    Chosen on the H200; the mxfp4_experts benchmark's `triton_sweep` variant times the others."""
    if assignments <= 16:
        bn = (64, 32)
    elif act and block_m > 16:
        bn = (128, 64, 32)
    else:
        bn = (256, 128, 64, 32)
    return (_pick(n, bn), _pick(k, (64, 32)), 4, 3)


# A decode step of a few tokens (<= this many (token, slot) assignments) holds its rows in a few
# experts: at the widest tiles one expert's columns make 6 programs, and 4 experts leave most of
# the 132 SMs idle.  Narrow column tiles with long K steps spread each expert over more programs
# (B8 one request: 24.5 -> ~20 us a layer; the moe_ffn benchmark's `tiling_sweep` variant times
# them); at B32 the wide tiles win.
FEW_ROWS = 32


def few_rows_tiling(rows: int, k: int, n: int, dtype, act: bool) -> Tiling | None:
    """The tiling for `rows` assignments of a 2-byte dtype times [G, K, N] (N: each of gate and
    up's columns with act), or None (`_tiling`'s default) past FEW_ROWS or for wider dtypes."""
    if rows > FEW_ROWS or jnp.dtype(dtype).itemsize != 2:
        return None
    bn, bk = _pick(n, (32, 16) if act else (16, 32)), _pick(k, (256, 128, 64, 32, 16) if act else (128, 64, 32, 16))
    if bn is None or bk is None:
        return None
    return (bn, bk, 4, 4) if act else (bn, bk, 2, 3)


def _gmm_padded(
    tile_group,
    x_pad,
    rhs_gkn,
    block_m: int,
    interpret: bool,
    tiling: Tiling | None = None,
    act=None,
    gather=None,
    assignments: int | None = None,
):
    """The kernel on rows already in the group-aligned layout: x_pad [n_tiles * block_m, K],
    tile_group [n_tiles] (-1: a tile past the groups, written as zeros) -> [n_tiles * block_m, N],
    or with act (rhs [G, K, 2F], gate ++ up) act(gate, up) in the kernel's epilogue, [.., F].
    rhs: an array in x's dtype or `mxfp4.PackedMXFP4`.
    gather: (dest [A] int32, top_k, n_tiles): x_pad is instead the tokens' rows [A / top_k, K]
    and each program loads its layout rows from them (`_gmm_kernel`)."""
    k, n = rhs_gkn.shape[1:]
    n = n if act is None else n // 2
    rows = x_pad.shape[0] if gather is None else gather[2] * block_m
    mx = isinstance(rhs_gkn, mxfp4.PackedMXFP4)
    mx_case = (rows if assignments is None else assignments, block_m, act is not None) if mx else None
    block_n, block_k, num_warps, num_stages = _tiling(k, n, tiling, mx=mx_case)
    if act is not None and tiling is None and x_pad.dtype.itemsize > 2:
        # two fp32 weight tiles a stage: half as wide, the shared memory of one unfused tile (Hopper: 227 KiB)
        block_n, num_stages = (block_n // 2, num_stages) if block_n >= 32 else (block_n, 2)
    precision = dots.fp32_precision(interpret) if x_pad.dtype == jnp.float32 else None
    weights = (rhs_gkn.values, jax.lax.bitcast_convert_type(rhs_gkn.scales, jnp.uint8)) if mx else (rhs_gkn,)
    return pl.pallas_call(
        functools.partial(
            _gmm_kernel,
            block_k=block_k,
            n_k=k // block_k,
            precision=precision,
            act=act,
            top_k=None if gather is None else gather[1],
            mx_ptx=(not interpret) if mx else None,
        ),
        grid=(rows // block_m, n // block_n),
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x_pad.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="moe_grouped_matmul_mxfp4" if mx else "moe_grouped_matmul",
    )(tile_group, *(() if gather is None else (gather[0],)), x_pad, *weights)


# Up to this many (token, slot) assignments (a power of two: Triton tiles the whole dest array)
# the gate/up kernel loads its rows from the tokens' own rows; past it, a padded copy is written.
# 1024 is the limit it was written for (Triton tiles dest whole); its GPU check: RESULTS.md.
GATHER_LIMIT = 1024
GATHER_LIMIT_WRITTEN_FOR = 1024


def _gathers(assignments: int) -> bool:
    return assignments <= GATHER_LIMIT and assignments & (assignments - 1) == 0


def _interpret(interpret):
    return jax.default_backend() != "gpu" if interpret is None else interpret


@functools.partial(jax.jit, static_argnames=("block_m", "interpret", "tiling"))
def grouped_matmul(lhs_mk, rhs_gkn, group_sizes_g, *, block_m=None, interpret=None, tiling: Tiling | None = None):
    """Pallas grouped GEMM, the contract of `grouped_matmul_ref`.

    lhs [M, K] rows sorted by group; rhs [G, K, N] (same dtype, or `mxfp4.PackedMXFP4` with
    16-bit rows: decoded in the kernel, read at 4.25 bits); group_sizes [G] int32.  block_m: rows per tile (default 16 for M <= 512, a decode step's
    few rows per expert; else 64).  K must divide by 16 and N by 16
    (`kernel_dims_ok`).  fp32 inputs multiply in 3xTF32 on the GPU (exact fp32
    in interpret mode), bf16 inputs on bf16 tensor cores, accumulating in fp32.
    """
    m = lhs_mk.shape[0]
    g = rhs_gkn.shape[0]
    _check_gmm("grouped_matmul", lhs_mk.shape[1], lhs_mk.dtype, rhs_gkn)
    if group_sizes_g.shape != (g,):
        raise ValueError(
            f"grouped_matmul: group_sizes {group_sizes_g.shape} and rhs {rhs_gkn.shape} do not match ([G], [G, K, N])"
        )
    block_m = block_m or layout_block_m(m)
    return through_padded_layout(
        lhs_mk,
        group_sizes_g,
        block_m,
        lambda tile_group, x_pad: _gmm_padded(
            tile_group, x_pad, rhs_gkn, block_m, _interpret(interpret), tiling, assignments=m
        ),
    )


def _ffn_weight_kinds(impl: str, w_gateup_elf, w_out_efl) -> tuple[bool, bool]:
    """(hopper, hopper_mx) for `grouped_ffn`: whether impl is "hopper", and whether both weights
    are `moe_mxfp4_hopper.HopperMXFP4` (allowed only together and only on impl="hopper")."""
    if impl not in ("triton", "hopper"):
        raise ValueError(f"grouped_ffn: impl must be 'triton' or 'hopper'; got {impl!r}")
    hopper = impl == "hopper"
    mx_hopper = [isinstance(w, moe_mxfp4_hopper.HopperMXFP4) for w in (w_gateup_elf, w_out_efl)]
    if any(mx_hopper) and not (all(mx_hopper) and hopper):
        raise ValueError(
            "grouped_ffn: Hopper-layout MXFP4 experts (`moe_mxfp4_hopper.HopperMXFP4`) run on "
            "impl='hopper', gate/up and down both in that layout"
        )
    return hopper, all(mx_hopper)


def _check_ffn_weights(x_nl, w_gateup_elf, w_out_efl, hopper: bool, hopper_mx: bool) -> None:
    """`grouped_ffn`'s weight checks: w_gateup [E, L, 2F] and w_out [E, F, L] agree, and each
    suits its kernel (the Triton GEMM's `_check_gmm`, or 16-bit weights at `moe_hopper.fits`
    dims on Hopper; `moe_mxfp4_hopper.gmm_padded` checks its own weights)."""
    e, l, f2 = w_gateup_elf.shape
    if hopper and not hopper_mx:
        if isinstance(w_gateup_elf, mxfp4.PackedMXFP4) or isinstance(w_out_efl, mxfp4.PackedMXFP4):
            raise ValueError("grouped_ffn (Hopper) takes 16-bit weights; MXFP4 experts run on impl='triton'")
        if not (moe_hopper.fits(l, f2, act=True) and moe_hopper.fits(f2 // 2, l, act=False)):
            raise ValueError(
                f"grouped_ffn (Hopper): L={l} and F={f2 // 2} must be multiples of 128 (`moe_hopper.fits`)"
            )
    elif not hopper:
        _check_gmm("grouped_ffn gate/up", x_nl.shape[1], x_nl.dtype, w_gateup_elf)
    if w_out_efl.shape != (e, f2 // 2, l) or f2 % 2:
        raise ValueError(
            f"grouped_ffn: w_out {w_out_efl.shape} must be [E={e}, F={f2 // 2}, L={l}] for gate/up {w_gateup_elf.shape}"
        )
    if not hopper:
        _check_gmm("grouped_ffn down", f2 // 2, x_nl.dtype, w_out_efl)


def _ffn_layout(ids_nk, layout, n: int, k: int, e: int, block_m: int):
    """(dest int32 [N * k], tile_group int32 [>= n_tiles], n_tiles): each assignment's row in the
    group-aligned layout, built from ids_nk [N, k] (`assignment_layout`) or taken from a
    precomputed `layout` (dest [N, k], tile_group), whose tile count is checked."""
    if layout is None:
        return assignment_layout(ids_nk.reshape(-1).astype(jnp.int32), e, block_m)
    dest, tile_group, n_tiles = layout[0].reshape(-1), layout[1], layout_tiles(n * k, e, block_m)
    if tile_group.shape[0] < n_tiles:
        raise ValueError(f"grouped_ffn: layout's tile_group has {tile_group.shape[0]} tiles, the layout {n_tiles}")
    return dest, tile_group, n_tiles


def _triton_ffn(
    x_nl, scattered, dest, tile_group, n_tiles, w_gateup_elf, w_out_efl, *, n, k, block_m, interpret, tiling, act
):
    """Both GEMMs of `grouped_ffn` on the Triton kernels: the layout's output rows [R, L].

    scattered() gives x's rows [n_tiles * block_m, L] in the layout; for a decode step's few
    assignments (`_gathers`) the gate/up kernel reads x_nl [N, L] where it lies instead.  Dense
    weights without a given tiling get `few_rows_tiling` (MXFP4 weights pick `mx_tiling`)."""
    l, f = w_gateup_elf.shape[1], w_gateup_elf.shape[2] // 2
    dense = lambda w: not isinstance(w, mxfp4.PackedMXFP4)  # MXFP4 weights: `mx_tiling`
    t_gu = tiling[0] or (few_rows_tiling(n * k, l, f, x_nl.dtype, act=True) if dense(w_gateup_elf) else None)
    t_down = tiling[1] or (few_rows_tiling(n * k, f, l, x_nl.dtype, act=False) if dense(w_out_efl) else None)
    if _gathers(n * k):  # a decode step's few assignments: the kernel reads x's rows where they are
        h = _gmm_padded(
            tile_group,
            x_nl,
            w_gateup_elf,
            block_m,
            interpret,
            t_gu,
            act=act,
            gather=(dest, k, n_tiles),
            assignments=n * k,
        )
    else:
        h = _gmm_padded(
            tile_group, scattered(), w_gateup_elf, block_m, interpret, t_gu, act=act, assignments=n * k
        )  # [.., F]
    return _gmm_padded(tile_group, h, w_out_efl, block_m, interpret, t_down, assignments=n * k)


@functools.partial(jax.jit, static_argnames=("act", "block_m", "interpret", "tiling", "gather", "impl"))
def grouped_ffn(
    x_nl,
    ids_nk,
    w_gateup_elf,
    w_out_efl,
    *,
    act,
    block_m=None,
    interpret=None,
    tiling: tuple[Tiling | None, Tiling | None] = (None, None),
    layout=None,
    gather: bool = True,
    impl: str = "triton",
):
    """Every routed expert FFN of a batch in one group-aligned layout (Pallas).

    x_nl [N, L] rows, ids_nk [N, k] int32 experts (an id outside [0, E): no expert, output 0);
    w_gateup_elf [E, L, 2F] (gate ++ up),
    w_out_efl [E, F, L] (each an array of x's dtype, or `mxfp4.PackedMXFP4` with 16-bit rows:
    decoded in the kernels, read at 4.25 bits); act(gate [.., F], up [.., F]) -> [.., F] elementwise with
    act(0, 0) == 0 (padding rows stay zero), called on fp32 values (the GEMM's output rounded
    to x's dtype) inside the kernel.  Returns y [N, k, L]: expert ids[n, j]'s
    output for row n (unweighted), in x's dtype.  tiling: (gate/up, down) kernel tilings
    (`Tiling`; None: by shape, `few_rows_tiling` for a decode step's few rows).  layout: (dest
    [N, k] int32, tile_group [>= n_tiles] int32) as `pallas_kernels.moe_route.route_layout` gives them (at block_m = `layout_block_m(N * k)`), in
    place of ids (pass ids_nk None).  gather=False: (the layout's output rows [R, L], dest [N, k]
    int32, >= R for no expert) instead of y, for a consumer that reads them where they lie
    (`pallas_kernels.moe_combine`).

    Where `grouped_matmul` twice would gather the rows into expert order, scatter them into
    the padded layout, gather the gate/up result back, scatter it again for the down
    projection and gather once more, this places each (row, slot) straight into the layout
    (`assignment_layout`: no sort for a decode step's few rows), runs both GEMMs there (the
    activation in the gate/up kernel's epilogue: a program holds a gate and an up tile of the
    same columns), and gathers once.

    impl: "triton" (these kernels, any GPU; interpret mode on the CPU) or "hopper"
    (`pallas_kernels.moe_hopper`: wgmma + TMA, bf16 / fp16 weights, dims `moe_hopper.fits`;
    block_m defaults to its 128-row tiles; tiling: its `HopperTiling`s; Mosaic GPU's interpret
    mode on the CPU).  Both weights `moe_mxfp4_hopper.HopperMXFP4` (bf16 rows): the Hopper MXFP4
    kernel for each GEMM (`moe_mxfp4_hopper.gmm_padded`, its default tiling, at the Triton
    kernels' `layout_block_m` rows a tile), the activation between them as XLA ops on the gate /
    up outputs rounded to x's dtype (the Triton epilogue's numbers)."""
    hopper, hopper_mx = _ffn_weight_kinds(impl, w_gateup_elf, w_out_efl)
    n, k = (ids_nk if layout is None else layout[0]).shape
    e, l, f2 = w_gateup_elf.shape
    # (with hopper_mx, `moe_mxfp4_hopper.gmm_padded` checks the weights and the rows)
    _check_ffn_weights(x_nl, w_gateup_elf, w_out_efl, hopper, hopper_mx)
    block_m = block_m or (128 if hopper and not hopper_mx else layout_block_m(n * k))
    interpret = _interpret(interpret)
    dest, tile_group, n_tiles = _ffn_layout(ids_nk, layout, n, k, e, block_m)

    def scattered():  # x's rows in the layout: assignment a is row a // k
        return jnp.take(x_nl, layout_sources(dest, n_tiles * block_m) // k, axis=0, mode="fill", fill_value=0)

    if hopper_mx:
        tile_group = tile_group[:n_tiles]
        gu = moe_mxfp4_hopper.gmm_padded(tile_group, scattered(), w_gateup_elf, block_m, interpret=interpret)
        f = f2 // 2
        h = act(gu[:, :f].astype(jnp.float32), gu[:, f:].astype(jnp.float32)).astype(x_nl.dtype)
        y = moe_mxfp4_hopper.gmm_padded(tile_group, h, w_out_efl, block_m, interpret=interpret)
    elif hopper:  # (`moe_hopper.gmm_padded`: the activation in the gate/up epilogue)
        t_gu, t_down = tiling
        tile_group = tile_group[:n_tiles]
        h = moe_hopper.gmm_padded(
            tile_group, scattered(), w_gateup_elf, block_m, act=act, tiling=t_gu, interpret=interpret
        )
        y = moe_hopper.gmm_padded(tile_group, h, w_out_efl, block_m, tiling=t_down, interpret=interpret)
    else:
        y = _triton_ffn(
            x_nl,
            scattered,
            dest,
            tile_group,
            n_tiles,
            w_gateup_elf,
            w_out_efl,
            n=n,
            k=k,
            block_m=block_m,
            interpret=interpret,
            tiling=tiling,
            act=act,
        )
    if not gather:
        return y, dest.reshape(n, k)
    return jnp.take(y, dest, axis=0, mode="fill", fill_value=0).reshape(n, k, l)
