"""Decode on a `decode_mesh(dp, ep)`: attention data-parallel over requests, EP MoE.

Each of the ``dp`` ranks owns ``B / dp`` requests: their MLA latent rows and
KDA state live only there (nothing replicated, since decode is bound by KV
capacity first), and the attention weights are replicated.  Per layer, on
each rank (inside one `jax.shard_map`)::

    x [B/dp, T, D]
    x = x + Mixer(RMSNorm(x))          KDA or MLA on the rank's own cache rows, no collective
    x = x + FFN(RMSNorm(x))            layer 0: dense MLP; later: LatentMoE with all-to-all
                                       dispatch / combine over the EXPERT axis

The cache is `kimik3.model.init_cache`'s contiguous layout with the batch
split over the whole mesh (`DECODE_RULES`).  A prefill cache moves here with
`ShardedDecode.place_cache` (a reshard from the prefill mesh's layout).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from kimik3 import model, ops
from kimik3.block import residual_block
from kimik3.caches import LayerCaches, PagedPools
from kimik3.config import ModelConfig
from sharding import layers
from sharding.mesh import check_config, mesh_shape
from sharding.prefill import embed_params, ffn, lm_head
from sharding.rules import ALL, DECODE_RULES, Rules, cache_specs, param_specs, shard_cache, shard_params

log = logging.getLogger(__name__)


def _body(params, x_btd, caches, lengths_b, *, cfg: ModelConfig, ep: int, dispatch: str, kernels: str):
    """One rank's decode step: x_btd [B/dp, T, D] (its requests), caches over their rows
    (`kimik3.caches.LayerCaches` of its contiguous cache rows, or `PagedPools` over its own
    pools) -> (logits [B/dp, T, V], the caches written)."""
    t = x_btd.shape[1]
    positions = lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    for i in range(cfg.n_layers):
        p, entry = params[f"layer_{i}"], caches.get(cfg, i, None)
        with jax.named_scope(f"layer_{i}"):  # a profile reads by layer, as the unsharded model's does
            x_btd, c = residual_block(
                x_btd,
                mixer=lambda h: layers.mixer(cfg, i, p, h, positions, entry, kernels),
                ffn=lambda h: ffn(cfg, i, p, h, ep=ep, dispatch=dispatch, kernels=kernels),
                **layers.block_norms(cfg, p),
            )
        caches = caches.put(cfg, i, None, c)
    return lm_head(params, cfg, x_btd), caches


def _contiguous_body(params, x_btd, cache, **kw):
    logits, caches = _body(params, x_btd, LayerCaches(tuple(cache["layers"])), cache["lengths"], **kw)
    return logits, {"lengths": cache["lengths"] + x_btd.shape[1], "layers": caches.layers}


def _paged_body(params, x_btd, pools, tables, slots, lengths, **kw):
    """One rank's step over its own pools (`kimik3.model.init_paged_cache` of its pages and
    slots): tables [B/dp, P] and slots [B/dp] are ids in those pools."""
    logits, caches = _body(params, x_btd, PagedPools(pools["kda"], pools["mla"], slots, tables), lengths, **kw)
    return logits, {"kda": caches.kda, "mla": caches.mla}


class ShardedDecode:
    """Decode steps of `cfg` on a `decode_mesh`.

    ``ShardedDecode(cfg, mesh)(params, tokens [B, T], cache)`` -> (logits f32
    [B, T, V] sharded over requests, new cache), the contract of
    `kimik3.model.forward` with a contiguous cache; B must be a multiple of dp.
    """

    rules: Rules = DECODE_RULES

    def __init__(self, cfg: ModelConfig, mesh: Mesh, *, dispatch: str = "auto", kernels: str = "auto"):
        self.cfg, self.mesh = cfg, mesh
        self.shape = mesh_shape(mesh, "decode")
        check_config(cfg, self.shape)
        self.dispatch = layers.resolve_dispatch(dispatch)
        self.kernels = ops.resolve(kernels)
        self._jitted = jax.jit(self._run)
        log.info(
            "decode on dp=%d ep=%d (%s dispatch, %s kernels)",
            self.shape.size,
            self.shape.ep,
            self.dispatch,
            self.kernels,
        )

    def place_params(self, params):
        return shard_params(params, self.mesh, self.rules)

    def place_cache(self, cache):
        """Put a cache (fresh, or handed off from a prefill mesh) on this mesh, requests split over dp."""
        return shard_cache(cache, self.mesh, self.rules)

    def _run(self, params, tokens, cache):
        x = embed_params(params, self.cfg, tokens)
        rows = P(ALL, None, None)
        cache_spec = cache_specs(cache, self.rules)
        body = functools.partial(
            _contiguous_body, cfg=self.cfg, ep=self.shape.ep, dispatch=self.dispatch, kernels=self.kernels
        )
        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs(params, self.rules), rows, cache_spec),
            out_specs=(rows, cache_spec),
            check_vma=False,
        )
        return fn(params, x, cache)

    def _check(self, tokens, cache):
        if cache is None:
            raise ValueError("decode needs a cache (kimik3.model.init_cache layout)")
        tokens, _, _ = model.prepare_inputs(self.cfg, tokens, cache=cache)
        if tokens.shape[0] % self.shape.size:
            raise ValueError(
                f"decode batch of {tokens.shape[0]} requests is not a multiple of dp={self.shape.size} "
                f"(requests are split over the dp ranks)"
            )
        return tokens

    def lower(self, params, tokens, cache):
        return self._jitted.lower(params, self._check(tokens, cache), cache)

    def __call__(self, params, tokens, cache):
        return self._jitted(params, self._check(tokens, cache), cache)

    def run(self, params, tokens, cache):
        """The compiled step without `__call__`'s value checks (no host sync): for callers that
        guarantee the shapes (B a multiple of dp), e.g. the serving engine."""
        return self._jitted(params, tokens, cache)


class PagedDecode:
    """Decode steps of `cfg` on a `decode_mesh` over pools each rank owns (DP attention as served).

    The pools are the ranks' own `kimik3.model.init_paged_cache` pools of the same size, stacked
    on axis 0 in the mesh's device order and split over the whole mesh (`sharding.rank_pools`),
    so rank r's shard is exactly its pool: its pages, its KDA slots, its null page 0 and scratch
    slot.  ``PagedDecode(cfg, mesh)(params, pools, tokens [dp*b, T], tables [dp*b, max_pages],
    slots [dp*b], lengths [dp*b])`` -> (logits f32 [dp*b, T, V] split over the ranks, the pools
    written in place: donated).  Rows r*b .. r*b + b - 1 are rank r's; their tables and slots are
    ids in rank r's pool.  Each rank reads and writes only its own shard: no collective touches
    the pools, the only ones are the EP all-to-alls of the MoE layers.
    """

    rules: Rules = DECODE_RULES
    mode = "decode"

    def __init__(self, cfg: ModelConfig, mesh: Mesh, *, dispatch: str = "auto", kernels: str = "auto"):
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"decode mesh must be a jax.sharding.Mesh (sharding.mesh.decode_mesh); got {type(mesh).__name__}"
            )
        self.cfg, self.mesh = cfg, mesh
        self.shape = mesh_shape(mesh, "decode")
        check_config(cfg, self.shape)
        self.dispatch = layers.resolve_dispatch(dispatch)
        self.kernels = ops.resolve(kernels)
        self._jitted = jax.jit(self._run, donate_argnums=(1,))
        log.info(
            "decode over the ranks' own pools on dp=%d ep=%d (%s dispatch, %s kernels)",
            self.shape.size,
            self.shape.ep,
            self.dispatch,
            self.kernels,
        )

    def programs(self) -> int:
        """Compiled programs so far (one per batch bucket)."""
        return self._jitted._cache_size()

    @property
    def size(self) -> int:
        return self.shape.size

    def place_params(self, params):
        return shard_params(params, self.mesh, self.rules)

    def _run(self, params, pools, tokens, tables, slots, lengths):
        x = embed_params(params, self.cfg, tokens)
        split = lambda tree: jax.tree_util.tree_map(lambda _: P(ALL), tree)
        body = functools.partial(
            _paged_body, cfg=self.cfg, ep=self.shape.ep, dispatch=self.dispatch, kernels=self.kernels
        )
        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs(params, self.rules), P(ALL), split(pools), P(ALL), P(ALL), P(ALL)),
            out_specs=(P(ALL), split(pools)),
            check_vma=False,
        )
        return fn(params, x, pools, tables, slots, lengths)

    def lower(self, params, pools, tokens, tables, slots, lengths):
        return self._jitted.lower(params, pools, tokens, tables, slots, lengths)

    def run(self, params, pools, tokens, tables, slots, lengths):
        """The compiled step without `__call__`'s checks and conversions: for callers that pass
        int32 global arrays of the right shapes (`sharding.rank_pools.rows_in`), e.g. the engine."""
        return self._jitted(params, pools, tokens, tables, slots, lengths)

    def __call__(self, params, pools, tokens, tables, slots, lengths):
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2 or tokens.shape[0] % self.size:
            raise ValueError(f"decode tokens must be [dp * b, T] with dp={self.size}; got {tokens.shape}")
        return self._jitted(
            params,
            pools,
            tokens,
            jnp.asarray(tables, jnp.int32),
            jnp.asarray(slots, jnp.int32),
            jnp.asarray(lengths, jnp.int32),
        )


def decode(params, cfg: ModelConfig, mesh: Mesh, tokens, cache, *, dispatch: str = "auto", kernels: str = "auto"):
    """One-shot convenience: `ShardedDecode(cfg, mesh)(params, tokens, cache)`."""
    return ShardedDecode(cfg, mesh, dispatch=dispatch, kernels=kernels)(params, tokens, cache)
