"""Parameter counts and weight bytes, read off the abstract param tree; what a compiled program
holds and what the machine has free.

Counting from `jax.eval_shape` of the real init (rather than a formula kept
beside the model) means the numbers cannot drift from the model; for the same reason a
program's memory is XLA's own buffer assignment (`program_memory`), not a model of it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import jax

from kimik3.config import ModelConfig
from kimik3.model import abstract_params
from kimik3.quantization import BITS_PER_VALUE, KIMI_K3_MXFP4, QuantManifest

log = logging.getLogger(__name__)


def _leaves(cfg: ModelConfig):
    tree = abstract_params(cfg, "float32")
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        yield jax.tree_util.keystr(path, simple=True, separator="/"), math.prod(leaf.shape)


def param_count(cfg: ModelConfig) -> int:
    """Total parameters, vision encoder included."""
    return sum(n for _, n in _leaves(cfg))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a text token touches: routed experts count k of E."""
    frac = cfg.n_active_experts / cfg.n_routed_experts if cfg.n_routed_experts else 0.0
    total = 0.0
    for path, n in _leaves(cfg):
        if path.startswith("vit/"):
            continue
        total += n * frac if "moe/w_" in path and path.endswith(("_elf", "_efl")) else n
    return int(total)


def weight_bytes(cfg: ModelConfig, manifest: QuantManifest = KIMI_K3_MXFP4) -> int:
    """Bytes of all weights stored as `manifest` says (block scales included)."""
    bits = sum(n * BITS_PER_VALUE[manifest.format_of(path)] for path, n in _leaves(cfg))
    return int(math.ceil(bits / 8))


def tree_bytes(tree) -> int:
    """Bytes of a pytree's arrays (or `jax.ShapeDtypeStruct`s)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Bytes XLA assigned one compiled program (`jax.stages.Compiled.memory_analysis`)."""

    arguments: int
    outputs: int
    aliased: int  # outputs written into donated arguments (counted once, in arguments)
    temporaries: int  # everything else live during the call: gradients, activations, workspaces

    @property
    def peak(self) -> int:
        """Bytes live while the program runs: its arguments, its own outputs and temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


def program_memory(compiled) -> ProgramMemory | None:
    """XLA's memory figures of a compiled program, or None where the backend gives none."""
    try:
        m = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError) as e:  # a backend without buffer statistics
        log.debug("no memory analysis: %s", e)
        return None
    if m is None:
        return None
    return ProgramMemory(
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
        int(m.temp_size_in_bytes),
    )


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's memory cgroup (v2, else v1) leaves: its limit less its usage, reclaimable
    page cache (inactive files) not counted as used; None where there is no limit."""
    for limit_file, usage_file, stat_file, inactive in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
    ):
        try:
            with open(os.path.join(root, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:  # v1 writes "unlimited" as ~2**63
            return None
        try:
            with open(os.path.join(root, stat_file)) as f:
                stat = dict(line.split()[:2] for line in f if line.strip())
            usage -= min(int(stat.get(inactive, 0)), usage)
        except (OSError, ValueError):
            pass
        return max(int(limit) - usage, 0)
    return None


def available_memory(device=None) -> tuple[int | None, str]:
    """(bytes a new program may still allocate on `device` (default: the first), where the figure
    comes from).  An accelerator: its allocator's ``bytes_limit - bytes_in_use``.  The CPU: the
    host's MemAvailable (/proc/meminfo; elsewhere `os.sysconf`'s available pages), lowered to
    what a memory cgroup's limit leaves.  (None, why) where nothing can be read."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), f"{device.device_kind} memory free"
    host = _meminfo_available()
    source = "host MemAvailable"
    if host is None:
        try:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            source = "host available pages"
        except (ValueError, OSError, AttributeError):
            return None, f"{device.platform} reports no memory statistics"
    cgroup = _cgroup_available()
    if cgroup is not None and cgroup < host:
        return cgroup, "the memory cgroup's limit less its usage"
    return host, source
