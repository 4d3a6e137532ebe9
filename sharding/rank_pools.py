"""Pools owned per rank under DP decode: each rank's own paged pools, one global array for the step.

A DP decode engine keeps, on each rank's device, a complete set of paged pools
(`serving.kv_pools.KVPools`: MLA pages with their own null page 0, KDA slots with their own
scratch slot, KDA snapshots), and a cache manager over them.  Everything that touches one
request (admission, prefix hits, host-tier loads, prefill chunks, offloads, handoffs) runs on
its rank's pools alone.  The decode step runs all ranks at once (`sharding.decode.PagedDecode`);
for it the ranks' pools are viewed as one array per pool leaf::

    pools  = assemble([pools_0, .., pools_{dp-1}], mesh)   leaf [dp * N, ...], split over the mesh
                                                           (rank r's shard = pools_r, no copy)
    logits, pools = PagedDecode(cfg, mesh)(params, pools, tokens, tables, slots, lengths)
    pools_0, .. = split(pools, mesh)                       each rank's shard back (no copy)

Nothing moves between devices: assembling and splitting only re-label the ranks' buffers.

In a process group (`sharding.distributed`) whose decode mesh spans every process, each process
holds the pools of its own devices' ranks only (`local_ranks`): it assembles and splits those,
and its batch rows enter and leave the step through `rows_in` / `rows_out` (its ranks' rows of
the global batch).  With one process, every rank is local.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.rules import ALL


def rank_devices(mesh: Mesh) -> list:
    """The devices of a decode mesh in rank order (rank = replica * ep + expert)."""
    return list(mesh.devices.flat)


def local_ranks(mesh: Mesh) -> list[int]:
    """The ranks whose device belongs to this process, ascending (every rank with one process).
    A process's ranks must be consecutive: the global batch is split over ranks in order, and a
    process supplies its own rows as one block."""
    me = jax.process_index()
    ranks = [r for r, d in enumerate(rank_devices(mesh)) if d.process_index == me]
    if ranks and ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        raise ValueError(
            f"this process's devices are ranks {ranks} of the decode mesh; they must be consecutive "
            f"(order the mesh's devices by process)"
        )
    return ranks


def pool_sharding(mesh: Mesh) -> NamedSharding:
    """A pool leaf split on axis 0 over the whole mesh: rank r holds rows r*N .. r*N + N - 1."""
    return NamedSharding(mesh, P(ALL))


def assemble(rank_pools: Sequence, mesh: Mesh):
    """One global pytree from this process's ranks' pools (`local_ranks` order; same structure and
    shapes; rank r's on its device, `rank_devices(mesh)[r]`): each leaf [dp * N, ...] split over
    the mesh, no copy."""
    all_devices = rank_devices(mesh)
    ranks = local_ranks(mesh)
    if len(rank_pools) != len(ranks):
        raise ValueError(
            f"{len(rank_pools)} ranks' pools for the {len(ranks)} ranks of this process "
            f"(of {len(all_devices)} in the mesh)"
        )
    sharding = pool_sharding(mesh)

    def leaf(*parts):
        for r, x in zip(ranks, parts):
            if x.devices() != {all_devices[r]}:
                raise ValueError(
                    f"rank {r}'s pool is on {sorted(map(str, x.devices()))}, not its device {all_devices[r]}"
                )
        shape = (parts[0].shape[0] * len(all_devices),) + parts[0].shape[1:]
        return jax.make_array_from_single_device_arrays(shape, sharding, list(parts))

    return jax.tree_util.tree_map(leaf, *rank_pools)


def rows_in(local, mesh: Mesh):
    """A global batch array split over the ranks from this process's rows of it (numpy
    [len(local_ranks) * b, ...], its ranks' blocks in order)."""
    local = np.asarray(local)
    shape = (local.shape[0] // len(local_ranks(mesh)) * mesh.devices.size,) + local.shape[1:]
    return jax.make_array_from_process_local_data(pool_sharding(mesh), local, shape)


def rows_out(x, mesh: Mesh) -> np.ndarray:
    """This process's rows of a global batch array split over the ranks (`rows_in`'s inverse)."""
    order = {d: r for r, d in enumerate(rank_devices(mesh))}
    return np.concatenate([np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: order[s.device])])


def split(pools, mesh: Mesh) -> list:
    """This process's ranks' pools back from a global pytree (`assemble`'s inverse), in rank order."""
    order = {d: r for r, d in enumerate(rank_devices(mesh))}

    def shards(x):
        return [s.data for s in sorted(x.addressable_shards, key=lambda s: order[s.device])]

    per_leaf = jax.tree_util.tree_map(shards, pools)
    treedef = jax.tree_util.tree_structure(pools)
    leaves = treedef.flatten_up_to(per_leaf)
    n = len(leaves[0]) if leaves else 0
    return [jax.tree_util.tree_unflatten(treedef, [leaf[r] for leaf in leaves]) for r in range(n)]


__all__ = ["rank_devices", "local_ranks", "pool_sharding", "assemble", "split", "rows_in", "rows_out"]
