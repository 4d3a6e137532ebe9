"""Mesh builders: `prefill_mesh(tp, ep)` and `decode_mesh(dp, ep)`.

Both lay ``n`` devices out as a 2-D mesh ``(REPLICA, EXPERT) = (n // ep, ep)``:
experts are split over the ``ep`` ranks of each replica group and copied over
the ``n // ep`` groups, so every token's experts sit within its own group.
Prefill uses all ``n = tp`` ranks as the tensor/sequence-parallel group;
decode uses all ``n = dp`` ranks as the data-parallel group.  ``ep`` must
divide ``tp`` (``dp``).

Any device list works: real GPUs or CPU host devices
(``jax.config.update("jax_num_cpu_devices", 8)`` before the backend starts).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from kimik3.config import ModelConfig
from sharding.rules import EXPERT, MESH_AXES, REPLICA


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of one mesh: ``mode`` 'prefill' (``size`` = tp) or 'decode' (``size`` = dp)."""

    mode: str
    size: int
    ep: int

    @property
    def group_axis(self) -> str:
        return "tp" if self.mode == "prefill" else "dp"

    @property
    def replicas(self) -> int:
        return self.size // self.ep


def _validate(shape: MeshShape, n_devices: int | None, cfg: ModelConfig | None) -> None:
    g = shape.group_axis
    if shape.size < 1:
        raise ValueError(f"{g}={shape.size} must be >= 1")
    if shape.ep < 1:
        raise ValueError(f"ep={shape.ep} must be >= 1")
    if shape.size % shape.ep:
        raise ValueError(
            f"ep={shape.ep} must divide {g}={shape.size} (experts are split over ep ranks "
            f"and copied over {g}/ep groups of the same devices)"
        )
    if n_devices is not None and n_devices != shape.size:
        raise ValueError(f"{g}={shape.size} needs exactly {shape.size} devices; got {n_devices}")
    if cfg is not None:
        check_config(cfg, shape)


def check_config(cfg: ModelConfig, shape: MeshShape) -> None:
    """Raise ValueError naming the axis when the mesh does not divide the model."""
    if shape.mode == "prefill":
        for name in ("kda_heads", "mla_heads"):
            heads = getattr(cfg, name)
            if heads % shape.size:
                raise ValueError(f"tp={shape.size} does not divide {name}={heads} of config {cfg.name!r}")
    if cfg.n_layers > 1 and cfg.n_routed_experts % shape.ep:
        raise ValueError(
            f"ep={shape.ep} does not divide n_routed_experts={cfg.n_routed_experts} of config {cfg.name!r}"
        )


def _devices(shape: MeshShape, devices: Sequence | None) -> list:
    if devices is None:
        available = jax.devices()
        if len(available) < shape.size:
            raise ValueError(
                f"{shape.group_axis}={shape.size} needs {shape.size} devices; only "
                f"{len(available)} available ({jax.default_backend()})"
            )
        return list(available[: shape.size])
    devices = list(devices)
    _validate(shape, len(devices), None)
    return devices


def _build(shape: MeshShape, devices, cfg) -> Mesh:
    _validate(shape, None, cfg)
    devs = _devices(shape, devices)
    return Mesh(np.asarray(devs, dtype=object).reshape(shape.replicas, shape.ep), MESH_AXES)


def prefill_mesh(tp: int, ep: int, devices: Sequence | None = None, cfg: ModelConfig | None = None) -> Mesh:
    """Mesh for TP/SP attention + EP MoE prefill over `tp` devices (default: the first `tp` of
    `jax.devices()`).  With `cfg`, also checks that tp divides the heads and ep the experts."""
    return _build(MeshShape("prefill", tp, ep), devices, cfg)


def decode_mesh(dp: int, ep: int, devices: Sequence | None = None, cfg: ModelConfig | None = None) -> Mesh:
    """Mesh for DP attention + EP MoE decode over `dp` devices."""
    return _build(MeshShape("decode", dp, ep), devices, cfg)


def mesh_shape(mesh: Mesh, mode: str) -> MeshShape:
    """The MeshShape of a mesh built here."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes must be {MESH_AXES} (use prefill_mesh / decode_mesh); got {mesh.axis_names}")
    return MeshShape(mode, mesh.shape[REPLICA] * mesh.shape[EXPERT], mesh.shape[EXPERT])


def parse_spec(text: str, mode: str) -> MeshShape:
    """'tp8,ep8' (prefill) or 'dp16,ep16' (decode) -> MeshShape; ep defaults to 1."""
    group = "tp" if mode == "prefill" else "dp"
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name = part.rstrip("0123456789")
        if name not in (group, "ep") or name == part:
            raise ValueError(f"bad {mode} mesh {text!r}: expected parts like '{group}8' and 'ep8'")
        sizes[name] = int(part[len(name) :])
    if group not in sizes:
        raise ValueError(f"bad {mode} mesh {text!r}: the {group} size is missing")
    shape = MeshShape(mode, sizes[group], sizes.get("ep", 1))
    _validate(shape, None, None)
    return shape
