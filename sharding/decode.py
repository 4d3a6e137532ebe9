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
from kimik3.config import ModelConfig
from kimik3.layers.primitives import rms_norm
from sharding import layers
from sharding.mesh import check_config, mesh_shape
from sharding.prefill import embed_inputs, ffn, lm_head
from sharding.rules import ALL, DECODE_RULES, Rules, cache_specs, param_specs, shard_cache, shard_params

log = logging.getLogger(__name__)


def _body(params, x_btd, cache, *, cfg: ModelConfig, ep: int, dispatch: str, kernels: str):
    """One rank's decode step: x_btd [B/dp, T, D] (its requests) -> logits [B/dp, T, V], its cache rows."""
    t = x_btd.shape[1]
    positions = cache["lengths"][:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    new_layers = []
    for i in range(cfg.n_layers):
        p = params[f"layer_{i}"]
        h = rms_norm(x_btd, p["mixer_norm"]["scale"], cfg.norm_eps)
        y, c = layers.mixer(cfg, i, p, h, positions, cache["layers"][i], kernels)
        new_layers.append(c)
        x_btd = x_btd + y
        h = rms_norm(x_btd, p["ffn_norm"]["scale"], cfg.norm_eps)
        x_btd = x_btd + ffn(cfg, i, p, h, ep=ep, dispatch=dispatch, kernels=kernels)
    return lm_head(params, cfg, x_btd), {"lengths": cache["lengths"] + t, "layers": tuple(new_layers)}


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
        log.info("decode on dp=%d ep=%d (%s dispatch, %s kernels)", self.shape.size, self.shape.ep,
                 self.dispatch, self.kernels)

    def place_params(self, params):
        return shard_params(params, self.mesh, self.rules)

    def place_cache(self, cache):
        """Put a cache (fresh, or handed off from a prefill mesh) on this mesh, requests split over dp."""
        return shard_cache(cache, self.mesh, self.rules)

    def _run(self, params, tokens, cache):
        x = embed_inputs(params, self.cfg, tokens)
        rows = P(ALL, None, None)
        cache_spec = cache_specs(cache, self.rules)
        body = functools.partial(_body, cfg=self.cfg, ep=self.shape.ep, dispatch=self.dispatch,
                                 kernels=self.kernels)
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(param_specs(params, self.rules), rows, cache_spec),
                           out_specs=(rows, cache_spec), check_vma=False)
        return fn(params, x, cache)

    def _check(self, tokens, cache):
        if cache is None:
            raise ValueError("decode needs a cache (kimik3.model.init_cache layout)")
        tokens, _, _ = model.prepare_inputs(self.cfg, tokens, cache=cache)
        if tokens.shape[0] % self.shape.size:
            raise ValueError(f"decode batch of {tokens.shape[0]} requests is not a multiple of dp={self.shape.size} "
                             f"(requests are split over the dp ranks)")
        return tokens

    def lower(self, params, tokens, cache):
        return self._jitted.lower(params, self._check(tokens, cache), cache)

    def __call__(self, params, tokens, cache):
        return self._jitted(params, self._check(tokens, cache), cache)

    def run(self, params, tokens, cache):
        """The compiled step without `__call__`'s value checks (no host sync): for callers that
        guarantee the shapes (B a multiple of dp), e.g. the serving engine."""
        return self._jitted(params, tokens, cache)


def decode(params, cfg: ModelConfig, mesh: Mesh, tokens, cache, *, dispatch: str = "auto", kernels: str = "auto"):
    """One-shot convenience: `ShardedDecode(cfg, mesh)(params, tokens, cache)`."""
    return ShardedDecode(cfg, mesh, dispatch=dispatch, kernels=kernels)(params, tokens, cache)
