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
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.rules import ALL


def rank_devices(mesh: Mesh) -> list:
    """The devices of a decode mesh in rank order (rank = replica * ep + expert)."""
    return list(mesh.devices.flat)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    """A pool leaf split on axis 0 over the whole mesh: rank r holds rows r*N .. r*N + N - 1."""
    return NamedSharding(mesh, P(ALL))


def assemble(rank_pools: Sequence, mesh: Mesh):
    """One global pytree from the ranks' pools (same structure and shapes; rank r's on its
    device, `rank_devices(mesh)[r]`): each leaf [dp * N, ...] split over the mesh, no copy."""
    devices = rank_devices(mesh)
    if len(rank_pools) != len(devices):
        raise ValueError(f"{len(rank_pools)} ranks' pools for a mesh of {len(devices)} devices")
    sharding = pool_sharding(mesh)

    def leaf(*parts):
        for r, (x, d) in enumerate(zip(parts, devices)):
            if x.devices() != {d}:
                raise ValueError(f"rank {r}'s pool is on {sorted(map(str, x.devices()))}, not its device {d}")
        shape = (sum(x.shape[0] for x in parts),) + parts[0].shape[1:]
        return jax.make_array_from_single_device_arrays(shape, sharding, list(parts))

    return jax.tree_util.tree_map(leaf, *rank_pools)


def split(pools, mesh: Mesh) -> list:
    """The ranks' pools back from a global pytree (`assemble`'s inverse), in rank order."""
    order = {d: r for r, d in enumerate(rank_devices(mesh))}

    def shards(x):
        return [s.data for s in sorted(x.addressable_shards, key=lambda s: order[s.device])]

    per_leaf = jax.tree_util.tree_map(shards, pools)
    treedef = jax.tree_util.tree_structure(pools)
    leaves = treedef.flatten_up_to(per_leaf)
    return [jax.tree_util.tree_unflatten(treedef, [leaf[r] for leaf in leaves]) for r in range(len(order))]


__all__ = ["rank_devices", "pool_sharding", "assemble", "split"]
