"""The group-aligned row layout every grouped expert GEMM runs on, and the bookkeeping that builds it.

Rows arrive sorted by group (group g owns ``group_sizes[g]`` consecutive rows), or as routed
(token, slot) assignments with an expert each.  The layout places each group's rows from a
`block_m` boundary on, so every row tile belongs to one group (`padded_layout`,
`assignment_layout`), and `through_padded_layout` runs a kernel there and gathers the outputs
back.  The Triton kernels (`pallas_kernels.moe`) and the Hopper kernels
(`pallas_kernels.moe_hopper`, `pallas_kernels.moe_mxfp4_hopper`) share it.
"""

from __future__ import annotations

import jax.numpy as jnp


def group_of_rows(group_sizes_g, m: int):
    """int32 [M]: the group that row r of a sorted [M, ...] belongs to (G past the last row of
    every group: those rows belong to none)."""
    ends = running_sum(group_sizes_g.astype(jnp.int32))
    rows = jnp.arange(m, dtype=jnp.int32)
    return jnp.searchsorted(ends, rows, side="right", method="compare_all").astype(jnp.int32)


def layout_tiles(rows: int, groups: int, block_m: int) -> int:
    """Row tiles of the group-aligned layout: every group that holds a row may leave up to
    block_m - 1 rows of its last tile empty, and at most min(groups, rows) groups hold one
    (a decode step's few rows over many experts: the kernels' grids and the layout's buffers
    stay as small as the rows need, not as the experts' count).  At least one tile."""
    return max(1, -(-(rows + min(groups, rows) * (block_m - 1)) // block_m))


# Up to this many entries a running sum (or an assignment's rank) is a masked sum over an [n, n]
# compare: one parallel reduce.  XLA:GPU lowers cumsum to a reduce-window whose serial window
# took 7.6 us of one decode-step MoE layer's bookkeeping on the H200, more than its GEMMs' share.
PAIRWISE_LIMIT = 1024


def running_sum(x_n):
    """Inclusive cumsum of a 1-D int array; a masked [n, n] sum for n <= PAIRWISE_LIMIT."""
    n = x_n.shape[0]
    if n > PAIRWISE_LIMIT:
        return jnp.cumsum(x_n)
    upto = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
    return jnp.sum(jnp.where(upto, x_n[None, :], 0), axis=1).astype(x_n.dtype)


def _group_tiles(sizes, block_m: int, n_tiles: int):
    """(first padded row of each group [G], the group of each row tile [n_tiles], -1 past the
    last group) of groups of `sizes` rows, each starting on a block_m boundary."""
    padded = (sizes + block_m - 1) // block_m * block_m
    padded_ends = running_sum(padded)
    tile_start = jnp.arange(n_tiles, dtype=jnp.int32) * block_m
    # compare_all: one fused compare-and-count.  The default scan method is an XLA while loop
    # (several launches and a host round trip per iteration; 30 loops in a `small` decode step).
    tile_group = jnp.searchsorted(padded_ends, tile_start, side="right", method="compare_all").astype(jnp.int32)
    return padded_ends - padded, jnp.where(tile_group < sizes.shape[0], tile_group, -1)


def padded_layout(group_sizes, m: int, block_m: int, n_tiles: int):
    """Where each sorted row goes in the group-aligned layout, and each tile's group.

    Returns (dest [M] int32: padded row of row r, or -1 for rows past the groups' sum;
    tile_group [n_tiles] int32: the group of tile i, -1 past the last group)."""
    sizes = group_sizes.astype(jnp.int32)
    starts, tile_group = _group_tiles(sizes, block_m, n_tiles)
    ends = running_sum(sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    group_of_row = group_of_rows(sizes, m)
    valid = group_of_row < sizes.shape[0]
    gr = jnp.minimum(group_of_row, sizes.shape[0] - 1)
    dest = starts[gr] + rows - (ends - sizes)[gr]
    return jnp.where(valid, dest, -1), tile_group


def layout_sources(dest_a, n_rows: int):
    """int32 [n_rows]: the entry a whose dest_a[a] each row of a layout is, or len(dest_a) where
    none is (an entry whose dest lies outside [0, n_rows) goes nowhere).  Rows are moved into a
    layout by a gather through this map (`jnp.take(..., mode="fill")`), not by scattering them to
    dest: XLA:GPU scatters 16-bit rows element by element with atomic compare-and-swap loops
    where it cannot prove the indices unique, and the scatter in took longer than the Hopper
    kernel itself (RESULTS.md); this scatters one int32 per entry."""
    a = dest_a.shape[0]
    dest = jnp.where((dest_a >= 0) & (dest_a < n_rows), dest_a, n_rows)  # a -1 would wrap to the last row
    return jnp.full((n_rows,), a, jnp.int32).at[dest].set(jnp.arange(a, dtype=jnp.int32), mode="drop")


def layout_block_m(rows: int) -> int:
    """Rows per tile of the group-aligned layout for this many rows ((token, slot) assignments)."""
    return 16 if rows <= 512 else 64  # a decode step's few rows per expert; prefill's many


def through_padded_layout(lhs_mk, group_sizes_g, block_m: int, run):
    """A grouped GEMM's contract by a kernel on the group-aligned layout: lhs [M, K] rows sorted
    by group, group_sizes [G] -> run(tile_group [n_tiles], x_pad [n_tiles * block_m, K]) ->
    [n_tiles * block_m, N] -> [M, N] in lhs's dtype (rows past the groups' sum give 0): the
    rows gathered in (`layout_sources`), the outputs gathered back."""
    m = lhs_mk.shape[0]
    n_tiles = layout_tiles(m, group_sizes_g.shape[0], block_m)
    dest, tile_group = padded_layout(group_sizes_g, m, block_m, n_tiles)
    x_pad = jnp.take(lhs_mk, layout_sources(dest, n_tiles * block_m), axis=0, mode="fill", fill_value=0)
    out = run(tile_group, x_pad)
    return jnp.where((dest >= 0)[:, None], out[jnp.maximum(dest, 0)], 0).astype(lhs_mk.dtype)


# Above this many (assignment x expert) pairs the rank of each assignment within its expert comes
# from a sort; below it from a one-hot running count (no sort), and for at most PAIRWISE_LIMIT
# assignments (a decode step) from a count of the earlier assignments to the same expert.
_ONE_HOT_RANK_LIMIT = 1 << 22


def assignment_layout(flat_ids_m, n_experts: int, block_m: int):
    """Where each routed assignment goes in the group-aligned layout, with no sorted copy of the rows.

    flat_ids_m [M] int32 expert of each (token, slot) assignment -> (dest [M]: its padded row,
    tile_group [n_tiles]: the expert of each row tile, -1 past the last, n_tiles static).
    Assignments of one expert keep their order (a stable sort's).  An id outside [0, E) names no
    expert: its dest is n_tiles * block_m, past the layout (writes there are dropped)."""
    m = flat_ids_m.shape[0]
    n_tiles = layout_tiles(m, n_experts, block_m)
    if m <= PAIRWISE_LIMIT:
        sizes = jnp.sum(flat_ids_m[:, None] == jnp.arange(n_experts, dtype=jnp.int32)[None], axis=0)
        earlier = jnp.arange(m)[None, :] < jnp.arange(m)[:, None]
        rank = jnp.sum((flat_ids_m[None, :] == flat_ids_m[:, None]) & earlier, axis=1)
    elif m * n_experts <= _ONE_HOT_RANK_LIMIT:
        onehot = (flat_ids_m[:, None] == jnp.arange(n_experts, dtype=jnp.int32)[None]).astype(jnp.int32)
        sizes = onehot.sum(0)
        rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    else:
        order = jnp.argsort(flat_ids_m, stable=True)
        sizes = jnp.zeros((n_experts,), jnp.int32).at[flat_ids_m].add(1, mode="drop")
        starts = running_sum(sizes) - sizes
        rank = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32) - starts[flat_ids_m[order]])
    starts, tile_group = _group_tiles(sizes.astype(jnp.int32), block_m, n_tiles)
    named = (flat_ids_m >= 0) & (flat_ids_m < n_experts)
    dest = starts[jnp.clip(flat_ids_m, 0, n_experts - 1)] + rank
    return jnp.where(named, dest, n_tiles * block_m).astype(jnp.int32), tile_group, n_tiles
