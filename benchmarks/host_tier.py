"""Host KV tier bandwidth: a batch get of MLA pages or KDA snapshots from the embedded tier or from
Mooncake (loopback TCP), against numpy's copy of the same bytes.  Host only: no device involved.

Registered in `benchmarks.registry` (host_tier).  An MLA page is 128 tokens of every MLA layer's
latent (bf16-sized); a KDA snapshot is every KDA layer's fp32 state.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np

from benchmarks import common
from cache.host_tier import EmbeddedHostKVTier, make_key
from kimik3 import config

log = logging.getLogger("benchmarks.host_tier")
STAGING_LIMIT = 480 << 20  # the largest entry Mooncake's 512 MiB staging buffer takes


def entry_shapes(cfg) -> dict:
    n_mla, n_kda = cfg.mixer_kinds.count("mla"), cfg.mixer_kinds.count("kda")
    return {
        "mla_page": ((n_mla, 128, cfg.mla_latent_dim), np.float16),
        "kda_snapshot": ((n_kda, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim), np.float32),
    }


class _Tiers:
    """The tiers the cases use, each made once; Mooncake's services stop on close."""

    def __init__(self, ci: bool):
        self.capacity = (64 << 20) if ci else (4 << 30)
        self.made: dict = {}
        self.stack = contextlib.ExitStack()

    def get(self, name: str):
        if name not in self.made:
            if name == "default":  # the embedded tier
                self.made[name] = EmbeddedHostKVTier(self.capacity)
            else:
                from cache.mooncake_tier import MooncakeHostKVTier, MooncakeServices

                services = MooncakeServices(segment_bytes=self.capacity).start()
                self.stack.callback(services.stop)
                tier = MooncakeHostKVTier(services.master_addr, services.metadata_url, staging_bytes=512 << 20)
                self.stack.callback(tier.close)
                self.made[name] = tier
        return self.made[name]


def host_tier(ctx):
    """host_tier: put `entries` entries, then time their batch get (ours) against copying the same
    arrays (the peer); the entries read back are checked equal to what was put."""
    tiers = _Tiers(ctx.ci)
    budget = (8 << 20) if ctx.ci else (1536 << 20)
    try:
        for case in ctx.cases():
            name, entry = case
            shape, dtype = entry_shapes(config.get_config(name))[entry]
            one = int(np.prod(shape)) * np.dtype(dtype).itemsize
            for tier in ["default"] + ctx.wanted():
                if tier == "mooncake" and one > STAGING_LIMIT:
                    yield ctx.error(case, tier, f"an entry of {one >> 20} MiB exceeds Mooncake's staging buffer")
                    continue
                yield ctx.attempt(
                    case, tier, lambda tier=tier: _row(ctx, case, tier, tiers.get(tier), shape, dtype, one, budget)
                )
    finally:
        tiers.stack.close()


def _row(ctx, case, tier_name: str, tier, shape, dtype, one: int, budget: int):
    n = max(1, min(64, budget // one))
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, shape).astype(dtype) for _ in range(n)]
    namespace = f"bench/{'-'.join(map(str, case))}-{tier_name}"
    keys = [make_key(namespace, "mla", i.to_bytes(16, "little")) for i in range(n)]
    outs = [np.empty_like(a) for a in arrays]
    dst = [np.empty_like(a) for a in arrays]
    nbytes = sum(a.nbytes for a in arrays)
    put_ms = common.host_ms(lambda: tier.batch_put(keys, arrays), iters=ctx.iters)
    found = tier.batch_get_into(keys, outs)
    worst = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) for a, b in zip(arrays, outs))
    chk = {"max_err": worst if all(found) else float("inf"), "tol": 0.0, "ok": all(found) and worst == 0.0}
    get_ms = lambda: common.host_ms(lambda: tier.batch_get_into(keys, outs), iters=ctx.iters)
    copy_ms = lambda: common.host_ms(lambda: [np.copyto(d, a) for d, a in zip(dst, arrays)], iters=ctx.iters)
    row = ctx.row(
        case,
        chk,
        get_ms,
        variant=tier_name,
        peer_ms=copy_ms,
        extra=dict(entries=n, entry_mb=one / 2**20, put_gbs=nbytes / (put_ms * 1e-3) / 1e9),
    )
    if row["ours_ms"]:
        row["extra"]["get_gbs"] = nbytes / (row["ours_ms"] * 1e-3) / 1e9
    return row
