"""One model across processes: JAX's multi-controller runtime, brought up on loopback.

Every process of a group runs this same program: `initialize` joins the group
(`jax.distributed.initialize` with a coordinator, the process count and this process's id, as
JAX documents), after which `jax.devices()` lists every process's devices, a mesh may span them
(`sharding.mesh.prefill_mesh(devices=...)`), and each process runs the same jitted steps on its
own shards.  On CPU the cross-process collectives are gloo's.

Bindings: the coordinator's gRPC service binds where `bind` says, by default the coordinator
address itself (JAX's default is every interface); gloo's listeners follow the host name the
coordinator address gives, so a group on 127.0.0.1 listens on loopback only.

Host values leave a global array through `gather` (every process gets the whole array; a
process may only read its addressable shards otherwise); host inputs go in with
`jax.device_put(value, NamedSharding)`, each process passing the same value (the steps'
`place_params` / `place_cache` do).

A process group serves as one DP engine (`serving.engine.Engine` with a decode mesh over every
process's devices): each process runs an engine of its own requests over its own devices'
ranks, and the engines step together; their decode steps are one program over the whole mesh
(the MoE's all-to-alls cross processes), agreed step by step with `agree_max`.  The sharded
steps (`sharding.prefill.ShardedPrefill`, `sharding.decode.ShardedDecode`) also run across
processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """coordinator: "host:port" of process 0's coordination service; num_processes; process_id
    in [0, num_processes); cpu_devices: devices per process on CPU (None: JAX's default)."""

    coordinator: str
    num_processes: int
    process_id: int
    cpu_devices: int | None = None

    def __post_init__(self):
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"coordinator must be host:port; got {self.coordinator!r}")
        if not (isinstance(self.num_processes, int) and self.num_processes >= 1):
            raise ValueError(f"num_processes must be >= 1; got {self.num_processes!r}")
        if not (isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes):
            raise ValueError(f"process_id must lie in [0, {self.num_processes}); got {self.process_id!r}")
        if self.cpu_devices is not None and self.cpu_devices < 1:
            raise ValueError(f"cpu_devices must be >= 1; got {self.cpu_devices}")


def initialize(
    group: ProcessGroup, *, bind: str | None = None, timeout_s: int = 120, heartbeat_timeout_s: int | None = None
) -> None:
    """Join `group` (before any JAX computation in this process).  bind: the coordinator
    service's listening address (default: `group.coordinator`, so a loopback group stays on
    loopback).  heartbeat_timeout_s: a process silent this long counts as dead and the
    coordination service stops the others (JAX's default: 100 s)."""
    # An executable compiled inside a group must never be read back by a lone process (or by a
    # group of another size), whose runtime it does not match: the same HLO and options give the
    # same cache key, so a shared persistent cache would hand one to the other (a lone process
    # that loaded one crashed later, in XLA).  The group's programs get a directory of their own.
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache, f"process-group-{group.num_processes}"))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU backend's, wherever it runs
    if group.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", group.cpu_devices)
    jax.distributed.initialize(
        coordinator_address=group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
        coordinator_bind_address=bind or group.coordinator,
        initialization_timeout=timeout_s,
        **({} if heartbeat_timeout_s is None else {"heartbeat_timeout_seconds": heartbeat_timeout_s}),
    )
    log.info(
        "process %d of %d joined %s: %d devices, %d local",
        group.process_id,
        group.num_processes,
        group.coordinator,
        len(jax.devices()),
        len(jax.local_devices()),
    )


def agree_max(values) -> list[int]:
    """Elementwise max of `values` (ints) over every process of the group: each passes its own,
    all call together (a collective); with one process, the values themselves."""
    if jax.process_count() == 1:
        return [int(v) for v in values]

    every = multihost_utils.process_allgather(np.asarray(values, np.int32))  # [processes, n]
    return [int(v) for v in np.asarray(every).reshape(jax.process_count(), -1).max(0)]


def gather(x):
    """A global array (or a pytree of them) whole on this process, as numpy."""
    return multihost_utils.process_allgather(x, tiled=True)


def shutdown() -> None:
    jax.distributed.shutdown()
