"""The bf16 grouped expert GEMM as a Hopper kernel (Mosaic GPU): TMA, wgmma, a producer
warpgroup, persistent over the SMs, the gate/up activation in the epilogue.

The Triton kernel (`moe._gmm_kernel`) is the portable one and the decode step's: a handful of
rows per expert, where reading the weights once is all that counts.  At prefill sizes the GEMMs
are compute-bound and Triton's MMA pipeline on Hopper (no wgmma from shared memory fed by TMA,
no warp specialization) ran 2.5-4x slower than JAX's own `ragged_dot_mgpu` (RESULTS.md, "MoE
grouped expert GEMM").  This kernel is built the way JAX's Hopper matmul is
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, learned from, not copied):

* one CTA per SM, looping over (row tile, column tile) work items in a planar snake so that
  consecutive SMs share weight tiles in L2;
* three warpgroups: a producer issuing TMA copies `steps` K-blocks ahead, and two consumers, each
  owning ``tile_n`` of the CTA's ``2 * tile_n`` columns with its own fp32 wgmma accumulator;
* the epilogue rounds to bf16 and stores through shared memory in 64-row tiles, double-buffered,
  so a tile's stores overlap the next tile's main loop.

Two row layouts.  `gmm_padded`: the group-aligned layout `moe_layout.padded_layout` builds (every
group starts on a ``block_m`` boundary; ``tile_m`` divides ``block_m``), so a row tile belongs to
one group and reads that group's weights; tiles past the groups (``tile_group`` -1) are skipped
and their rows left unwritten (no caller reads them).  `gmm_ragged`: rows sorted by group as
they are (no padded copy): a group's work items start at its first row rounded down to a
multiple of 8 (the row tiling of the shared-memory tiles TMA fills) and step by ``tile_m``, so
each group computes the tiles the padded layout would give it, plus at most 7 rows of the group
before, and no block is computed once for each of two groups; a full item stores through the
padded path's swizzled epilogue, a group's partial first or last item only its rows (TMA stores
in power-of-two runs).  Each CTA derives its items from the group sizes (`ragged_item`; `ragged_work` lists
them as a table, the reference), as `ragged_dot_mgpu` does: no XLA ops before the kernel.  With ``act`` the weights are gate ++ up [G, K, 2F]: each
consumer holds a gate and an up accumulator for the same F columns and writes act(gate, up) [.., F]
(each rounded to bf16 first, as an unfused activation would read them), so the [rows, 2F]
intermediate never reaches HBM.

Its arithmetic is checked on the CPU in Mosaic GPU's interpret mode (`interpret=True`,
tests/pallas_kernels/test_moe_hopper.py) and on the GPU against the reference
(tests/gpu/test_moe_hopper.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import moe_layout


@dataclasses.dataclass(frozen=True)
class HopperTiling:
    """A program's shape.  tile_m: rows of a work item (divides the layout's block_m; a multiple
    of 64, wgmma's M); tile_n: columns per consumer warpgroup (the CTA's work item is 2 * tile_n
    wide; with act, F columns of gate and of up each); tile_k: K per pipeline step; steps: K
    blocks in flight; grid_width: the planar snake's band width (work items along the minor axis
    before it turns); m_minor: walk row tiles fastest (consecutive SMs read the same weight
    columns of one group) or column tiles fastest (the same rows)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    steps: int = 4
    grid_width: int = 8
    m_minor: bool = True

    @property
    def label(self) -> str:
        """Short name: m128 n128 k64 s4 w8 (M: row tiles fastest, N: column tiles fastest)."""
        return (
            f"m{self.tile_m} n{self.tile_n} k{self.tile_k} s{self.steps} w{self.grid_width} "
            f"{'M' if self.m_minor else 'N'}"
        )

    @property
    def epi_m(self) -> int:
        return min(64, self.tile_m)

    @property
    def epi_n(self) -> int:
        return min(64, self.tile_n)


def default_tiling(n: int, act: bool) -> HopperTiling:
    """The default work item for N output columns (F with act): 128 x 256 (two consumers of 128
    columns) where 256 divides N, else 128 x 128; with act two fp32 accumulators per consumer, so
    64 columns each (128 x 64 x 2 fp32 = 128 registers a thread)."""
    return HopperTiling(tile_n=128 if n % 256 == 0 and not act else 64)


def fits(k: int, n: int, act: bool) -> bool:
    """Whether the default tiling takes [.., K] rows times [G, K, N] weights (N = 2F with act)."""
    n_out = n // 2 if act else n
    return k % 64 == 0 and n_out % 128 == 0 and (not act or n % 2 == 0)


def _check(x_pad, w_gkn, block_m: int | None, t: HopperTiling, act) -> int:
    """ValueError naming the mismatch, before any launch; returns the output columns.  block_m
    None: ragged rows (any count)."""
    rows, k = x_pad.shape
    if w_gkn.ndim != 3 or w_gkn.shape[1] != k:
        raise ValueError(f"grouped GEMM (Hopper): weights must be [G, K={k}, N]; got {w_gkn.shape}")
    if x_pad.dtype not in (jnp.bfloat16, jnp.float16) or w_gkn.dtype != x_pad.dtype:
        raise ValueError(
            f"grouped GEMM (Hopper) multiplies 16-bit rows by weights of their dtype; got {x_pad.dtype} x {w_gkn.dtype}"
        )
    n = w_gkn.shape[2]
    if act is not None:
        if n % 2:
            raise ValueError(f"grouped GEMM (Hopper) with act: weights must be gate ++ up [G, K, 2F]; N={n} is odd")
        n //= 2
    block = t.tile_m if block_m is None else block_m
    if (
        t.tile_m % 64
        or block % t.tile_m
        or (block_m is not None and rows % block_m)
        or n % (2 * t.tile_n)
        or t.tile_n % 64
        or k % t.tile_k
        or t.tile_k % 64
    ):
        raise ValueError(
            f"grouped GEMM (Hopper): tile_m {t.tile_m} (a multiple of 64) must divide block_m "
            f"{block_m}, which divides rows {rows}; 2 x tile_n {t.tile_n} (tile_n a multiple of 64) "
            f"must divide N {n}; tile_k {t.tile_k} (a multiple of 64) must divide K {k}"
        )
    return n


def _kernel(
    work_gmem,
    x_gmem,
    w_gmem,
    out_gmem,
    *,
    t: HopperTiling,
    block_m: int | None,
    n_out: int,
    act,
    m_iters: int,
    n_iters: int,
):
    """One CTA's loop over work items.  block_m an int: the group-aligned layout, work_gmem its
    tile_group (a work item is the row tile mi, whole); None: rows sorted by group, work_gmem
    the group sizes [G], from which `ragged_item` gives item mi (group, first row, lo, hi), or
    (many groups) `ragged_work`'s [4, n] table of them: an item computes tile_m rows from its
    first and stores its own, [lo, hi) of them (all: the padded path's epilogue; fewer:
    row-exactly)."""
    dtype = x_gmem.dtype
    ragged = block_m is None
    halves = 1 if act is None else 2
    cta_n = 2 * t.tile_n
    swizzle = plgpu.find_swizzle(t.tile_k * jnp.dtype(dtype).itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(t.epi_n * jnp.dtype(dtype).itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(out_swizzle),
    )
    epi_tiles = [(i, j) for i in range(t.tile_m // t.epi_m) for j in range(t.tile_n // t.epi_n)]

    def pipeline(body, context):
        spec = lambda shape, index: plgpu.BlockSpec(shape, index, transforms=transforms, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(w_gmem.shape[1] // t.tile_k,),
            memory_registers=40,
            max_concurrent_steps=t.steps,
            wg_axis="wg",
            num_compute_wgs=2,
            compute_context=context,
            in_specs=[spec((t.tile_m, t.tile_k), lambda k: (0, k))]
            + [spec((t.tile_k, cta_n), lambda k: (k, 0))] * halves,
        )

    ignore = lambda *_, **__: None
    w0 = w_gmem.at[0]
    reps = [x_gmem.at[pl.ds(0, t.tile_m)]] + [w0.at[:, pl.ds(0, cta_n)]] * halves
    # 64-row epilogue tiles, swizzled, double-buffered; ragged items of fewer rows use the same
    # bytes as each consumer's whole row block of epi_n columns, unswizzled so that any row range
    # of it can be stored.  A consumer's two views are never live at once (each path first waits
    # for its own stores reading them), and both views give each consumer the same bytes
    # (rows_per_wg x epi_n, consumer-major): the consumers may be an item apart in their
    # epilogues, and a store of one may not read what the other writes.
    rows_per_wg = max(t.tile_m, 2 * t.epi_m)
    tiles_smem = plgpu.SMEM(
        (2, rows_per_wg // t.epi_m if ragged else 2, t.epi_m, t.epi_n), dtype, transforms=out_transforms
    )
    out_smem_type = plgpu.RefUnion(tiles_smem, plgpu.SMEM((2, rows_per_wg, t.epi_n), dtype)) if ragged else tiles_smem

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(*reps),
        out_smem=out_smem_type,
        collective_axes="wg",
    )
    def _(allocs, out_smem):
        tiles_out, rows_out = out_smem if ragged else (out_smem, None)
        wg = lax.axis_index("wg")
        wg_cols = pl.ds(wg * t.tile_n, t.tile_n)

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _(loop_info):
            (lin,) = loop_info.index
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 0 if t.m_minor else 1, t.grid_width)
            if ragged:
                if work_gmem.ndim == 1:  # the group sizes: the item from them (`ragged_item`)
                    group, row0, lo, hi = ragged_item(
                        lambda i: work_gmem[i], w_gmem.shape[0], x_gmem.shape[0], t.tile_m, mi, zero_tail=True
                    )
                else:  # many groups: `ragged_work`'s table, built before the kernel
                    group, row0, lo, hi = (work_gmem[r, mi] for r in range(4))
                row0 = pl.multiple_of(row0, 8)  # a multiple of 8: what the tiled TMA copies need
            else:
                group, row0 = work_gmem[(mi * t.tile_m) // block_m], mi * t.tile_m
            rows = pl.ds(row0, t.tile_m)
            col0 = ni * cta_n + wg * t.tile_n  # this consumer's first output column

            def store_tiles(h):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last work item's stores left out_smem
                for e, (ei, ej) in enumerate(epi_tiles):
                    slot = e % 2
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    tiles_out[wg, slot] = h[ei * t.epi_m : (ei + 1) * t.epi_m, ej * t.epi_n : (ej + 1) * t.epi_n]
                    plgpu.commit_smem()
                    dst = out_gmem.at[pl.ds(row0 + ei * t.epi_m, t.epi_m), pl.ds(col0 + ej * t.epi_n, t.epi_n)]
                    plgpu.copy_smem_to_gmem(tiles_out.at[wg, slot], dst)

            def store_rows(h):
                # TMA stores take static sizes: rows [lo, hi) go out as a ladder of power-of-two
                # runs (tile_m / 2, .., 1 rows: a full item takes `store_tiles`), each issued
                # where hi - lo has that bit
                for ej in range(t.tile_n // t.epi_n):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    rows_out[wg, pl.ds(0, t.tile_m)] = h[:, ej * t.epi_n : (ej + 1) * t.epi_n]
                    plgpu.commit_smem()
                    start, size = lo, t.tile_m // 2
                    while size >= 1:

                        def put(start=start, size=size):
                            plgpu.copy_smem_to_gmem(
                                rows_out.at[wg, pl.ds(start, size)],
                                out_gmem.at[pl.ds(row0 + start, size), pl.ds(col0 + ej * t.epi_n, t.epi_n)],
                            )

                        pl.when((hi - lo) & size != 0)(put)
                        start = start + ((hi - lo) & size)
                        size //= 2

            def store(h):
                if not ragged:
                    return store_tiles(h)
                full = hi - lo == t.tile_m
                pl.when(full)(lambda: store_tiles(h))
                pl.when(~full)(lambda: store_rows(h))

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, accs=[plgpu.ACC((t.tile_m, t.tile_n), jnp.float32)] * halves)
                def _(accs):
                    eval_pipeline(tuple(accs))
                    if act is None:
                        h = accs[0][...]
                    else:  # each half rounded to the rows' dtype, as an unfused act would read it
                        rounded = lambda a: a[...].astype(dtype).astype(jnp.float32)
                        h = act(rounded(accs[0]), rounded(accs[1]))
                    store(h.astype(dtype))

            def body(_, x_smem, *refs):
                *w_smems, accs = refs
                for acc, w_smem in zip(accs, w_smems):
                    plgpu.wgmma(acc, x_smem, w_smem.at[:, wg_cols])
                plgpu.wgmma_wait(0)
                return accs

            n_groups = w_gmem.shape[0]
            if ragged:  # `ragged_item(zero_tail=True)`'s group G: rows past the groups' sum get zeros

                @pl.when((group == n_groups) & (wg < 2))  # the two consumers, each its columns
                def _():
                    store(jnp.zeros((t.tile_m, t.tile_n), dtype))

            @pl.when((group >= 0) & (group < n_groups))  # row tiles past the groups: no row anyone reads
            def _():
                w_g = w_gmem.at[group]
                srcs = [w_g.at[:, pl.ds(h * n_out + ni * cta_n, cta_n)] for h in range(halves)]
                pipeline(body, context)(x_gmem.at[rows], *srcs, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def num_sms() -> int:
    """Streaming multiprocessors of the first device (132 on an H100 / H200 SXM: the count the
    kernel is lowered for off the GPU)."""
    device = jax.devices()[0]
    return getattr(device, "core_count", 132) if device.platform == "gpu" else 132


def gmm_padded(
    tile_group,
    x_pad,
    w_gkn,
    block_m: int,
    *,
    act=None,
    tiling: HopperTiling | None = None,
    sms: int | None = None,
    interpret: bool = False,
):
    """Rows already in the group-aligned layout (`moe_layout.padded_layout`): x_pad [n_tiles * block_m,
    K], tile_group [n_tiles] int32 (-1: past the groups), w [G, K, N] of x's 16-bit dtype ->
    [n_tiles * block_m, N]; with act (w gate ++ up, [G, K, 2F]) act(gate, up) [.., F], act taking
    and returning fp32 values elementwise.  Rows of tiles past the groups are not written.
    sms: CTAs at most (default `num_sms()`; never more than work items); interpret: run in Mosaic GPU's interpret mode (CPU)."""

    t = tiling or default_tiling(w_gkn.shape[2] // (1 if act is None else 2), act is not None)
    n_out = _check(x_pad, w_gkn, block_m, t, act)
    rows = x_pad.shape[0]
    if tile_group.shape != (rows // block_m,):
        raise ValueError(
            f"grouped GEMM (Hopper): tile_group {tile_group.shape} must be [{rows // block_m}] "
            f"(rows {rows} / block_m {block_m})"
        )
    return _launch(
        tile_group.astype(jnp.int32),
        x_pad,
        w_gkn,
        t=t,
        block_m=block_m,
        n_out=n_out,
        act=act,
        m_iters=rows // t.tile_m,
        sms=sms,
        interpret=interpret,
    )


def _launch(work, x, w_gkn, *, t, block_m, n_out, act, m_iters, sms, interpret):
    n_iters = n_out // (2 * t.tile_n)
    kernel = plgpu.kernel(
        functools.partial(_kernel, t=t, block_m=block_m, n_out=n_out, act=act, m_iters=m_iters, n_iters=n_iters),
        out_type=jax.ShapeDtypeStruct((x.shape[0], n_out), x.dtype),
        grid=(min(sms or num_sms(), m_iters * n_iters),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    if interpret:
        with force_gpu_interpret_mode(InterpretGPUParams()):
            return kernel(work, x, w_gkn)
    return kernel(work, x, w_gkn)


INKERNEL_GROUPS = 64  # `gmm_ragged`: groups up to which the kernel derives its work items itself


def ragged_item(size_of, n_groups: int, m: int, tile_m: int, item, zero_tail: bool = False):
    """Work item `item` of rows sorted by group (the table `ragged_work` lists; written once for
    it and for the kernel, which derives its items from the group sizes as it goes, with no table
    built before it): (group, first row, lo, hi), the item computing rows [first, first + tile_m)
    and storing [first + lo, first + hi).  A group's items start at its first row rounded down to
    a multiple of 8 (the tiled TMA copies' row granularity) and step by tile_m: the row tiles the
    group-aligned layout would give it, without the padded copy, each block computed for one
    group only.  Group -1 past the last item; with zero_tail the rows past the groups' sum are
    one more group, G, whose items store zeros.  size_of(i): group i's size (an int32 scalar;
    a scalar load in the kernel); item: int32, a scalar or an array (the result then its shape).
    The groups are few, so the loop over them is unrolled: selects, no early exit (as
    `ragged_dot_mgpu`'s group bookkeeping)."""
    zero = jnp.zeros_like(item)
    group, row0, g_start, g_end = zero - 1, zero, zero, zero
    end = c_end = jnp.int32(0)
    for i in range(n_groups + int(zero_tail)):
        size = size_of(i) if i < n_groups else jnp.maximum(m - end, 0)
        start, end = end, end + size
        first = start & -8
        count = lax.select(size > 0, lax.div(end - first + tile_m - 1, jnp.int32(tile_m)), jnp.int32(0))
        c_start, c_end = c_end, c_end + count
        here = (c_start <= item) & (item < c_end)
        group = jnp.where(here, i, group)
        row0 = jnp.where(here, first + (item - c_start) * tile_m, row0)
        g_start, g_end = jnp.where(here, start, g_start), jnp.where(here, end, g_end)
    return group, row0, jnp.maximum(g_start - row0, 0), jnp.minimum(g_end - row0, tile_m)


def ragged_items(n_groups: int, m: int, tile_m: int, zero_tail: bool = False) -> int:
    """The static count of work items `ragged_item` can give: cdiv(M + 7 G, tile_m) + G (G + 1
    groups with zero_tail): each group adds at most one partial tile and 7 rows before it."""
    g = n_groups + int(zero_tail)
    return -(-(m + 7 * g) // tile_m) + g


def ragged_work(group_sizes_g, m: int, tile_m: int, zero_tail: bool = False):
    """Every work item of rows sorted by group as a table: int32 [4, n] (group, first row, lo,
    hi), n = `ragged_items`, the items `ragged_item` gives (tested equal); -1 groups past the
    last item.  zero_tail: the rows past the groups' sum as group G (`lax.ragged_dot`'s contract
    without a pass over the output).  Written with running sums over the groups, a few XLA ops
    whatever G (`ragged_item`'s unrolled loop is the kernel's form, for few groups): the table
    `gmm_ragged` builds past `INKERNEL_GROUPS` groups, and the reference of the kernel's items."""
    g = group_sizes_g.shape[0]
    sizes = group_sizes_g.astype(jnp.int32)
    if zero_tail:  # the rows past the groups' sum as one more group, G: its items store zeros
        sizes = jnp.concatenate([sizes, jnp.maximum(m - jnp.sum(sizes), 0)[None]])
        g += 1
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // 8 * 8
    count = jnp.where(sizes > 0, (ends - first + tile_m - 1) // tile_m, 0)
    c_end = jnp.cumsum(count)
    c_start = c_end - count
    item = jnp.arange(ragged_items(g - int(zero_tail), m, tile_m, zero_tail), dtype=jnp.int32)
    grp = jnp.sum(item[:, None] >= c_end[None, :], axis=1).astype(jnp.int32)  # the group whose items hold it
    gc = jnp.minimum(grp, g - 1)
    row0 = first[gc] + (item - c_start[gc]) * tile_m
    lo = jnp.maximum(starts[gc] - row0, 0)
    hi = jnp.minimum(ends[gc] - row0, tile_m)
    return jnp.stack([jnp.where(grp < g, gc, -1), row0, lo, hi]).astype(jnp.int32)


def gmm_ragged(
    lhs_mk,
    w_gkn,
    group_sizes_g,
    *,
    act=None,
    tiling: HopperTiling | None = None,
    sms: int | None = None,
    interpret: bool = False,
):
    """Rows sorted by group, as they are (no padded copy): lhs [M, K] of a 16-bit dtype, w [G, K,
    N] of its dtype, group_sizes [G] -> [M, N] (act: as `gmm_padded`); rows past the groups' sum
    are zeros, stored by the kernel's own items (`ragged_item(zero_tail=True)`), not by a pass
    over the output.  Loads of a partial last block read past M (TMA fills zeros), stores write
    only each item's rows."""
    t = tiling or default_tiling(w_gkn.shape[2] // (1 if act is None else 2), act is not None)
    n_out = _check(lhs_mk, w_gkn, None, t, act)
    g = w_gkn.shape[0]
    if group_sizes_g.shape != (g,):
        raise ValueError(
            f"grouped GEMM (Hopper): group_sizes {group_sizes_g.shape} and weights {w_gkn.shape} "
            f"do not match ([G], [G, K, N])"
        )
    # up to INKERNEL_GROUPS groups each CTA finds its items itself (a loop over the groups,
    # unrolled, per item); past that the table is built once before the kernel
    work = (
        group_sizes_g.astype(jnp.int32)
        if g <= INKERNEL_GROUPS
        else ragged_work(group_sizes_g, lhs_mk.shape[0], t.tile_m, zero_tail=True)
    )
    return _launch(
        work,
        lhs_mk,
        w_gkn,
        t=t,
        block_m=None,
        n_out=n_out,
        act=act,
        m_iters=ragged_items(g, lhs_mk.shape[0], t.tile_m, zero_tail=True),
        sms=sms,
        interpret=interpret,
    )


def grouped_matmul(
    lhs_mk,
    rhs_gkn,
    group_sizes_g,
    *,
    layout: str = "ragged",
    block_m: int = 128,
    tiling: HopperTiling | None = None,
    sms: int | None = None,
    interpret: bool = False,
):
    """`moe.grouped_matmul`'s contract: lhs [M, K] rows sorted by group, rhs [G, K, N] of lhs's
    16-bit dtype, group_sizes [G] -> [M, N] (rows past the groups' sum give 0).  layout "ragged":
    the rows as they are (`gmm_ragged`); "padded": through the group-aligned layout (a scatter
    of the rows in, a gather of the outputs back: `gmm_padded`)."""
    g = rhs_gkn.shape[0]
    if group_sizes_g.shape != (g,):
        raise ValueError(
            f"grouped GEMM (Hopper): group_sizes {group_sizes_g.shape} and rhs {rhs_gkn.shape} "
            f"do not match ([G], [G, K, N])"
        )
    if layout == "ragged":  # rows past the groups' sum: zeros from the kernel itself
        return gmm_ragged(lhs_mk, rhs_gkn, group_sizes_g, tiling=tiling, sms=sms, interpret=interpret)
    if layout != "padded":
        raise ValueError(f"grouped GEMM (Hopper): layout must be 'ragged' or 'padded'; got {layout!r}")
    return moe_layout.through_padded_layout(
        lhs_mk,
        group_sizes_g,
        block_m,
        lambda tile_group, x_pad: gmm_padded(
            tile_group, x_pad, rhs_gkn, block_m, tiling=tiling, sms=sms, interpret=interpret
        ),
    )
