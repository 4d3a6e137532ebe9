"""Prefill on a `prefill_mesh(tp, ep)`: TP attention, SP between layers, EP MoE.

Per layer, on each of the ``tp`` ranks (inside one `jax.shard_map`)::

    x [B, T/tp, D]  (this rank's token shard of the residual stream)
    h = RMSNorm(x)                                   on the shard
    h = all_gather(h, seq)              [B, T, D]    the only gather: before QKV
    y = mixer_heads_of_this_rank(h)     [B, T, D]    KDA or MLA, partial sum over heads
    x = x + psum_scatter(y, seq)        [B, T/tp, D] reduce-scatter over tokens
    h = RMSNorm(x)
    x = x + FFN(h)       layer 0: dense MLP; later: LatentMoE with all-to-all
                         dispatch / combine over the EXPERT axis (sharding.layers.moe_ep)

The cache (kimik3.model.init_cache layout) is sharded as `PREFILL_RULES` say:
KDA state and conv state over heads; MLA latent rows replicated (every TP rank
attends over the same latent).  `T` must be a multiple of ``tp``.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from kimik3 import model, ops
from kimik3.block import embed_inputs, head_logits, residual_block
from kimik3.config import ModelConfig
from kimik3.layers.primitives import rms_norm
from sharding import layers
from sharding.mesh import check_config, mesh_shape
from sharding.rules import ALL, PREFILL_RULES, Rules, cache_specs, param_specs, shard_cache, shard_params

log = logging.getLogger(__name__)


def embed_params(params, cfg: ModelConfig, tokens_bt, images_nhwc=None):
    """`kimik3.block.embed_inputs` of a params tree: token embeddings [B, T, D] with the model's
    own ViT rows spliced in."""
    vit = None if cfg.vit is None else (lambda im: model.image_embeddings(params, cfg, im))
    return embed_inputs(params["embed_vd"], tokens_bt, images_nhwc, vit)


def lm_head(params, cfg: ModelConfig, x_btd):
    """Final RMSNorm and `kimik3.block.head_logits`: [B, T, D] -> logits [B, T, V] fp32."""
    return head_logits(rms_norm(x_btd, params["final_norm"]["scale"], cfg.norm_eps), params["lm_head_dv"])


def ffn(cfg: ModelConfig, layer: int, p_layer, h_btd, *, ep: int, dispatch: str, kernels: str = "auto"):
    """The FFN of `layer` on this rank's tokens: dense MLP (layer 0) or the expert-parallel LatentMoE."""
    if cfg.ffn_kind(layer) == "dense":
        return layers.dense_ffn(cfg, p_layer["mlp"], h_btd)
    return layers.moe_ep(cfg, p_layer["moe"], h_btd, ep=ep, dispatch=dispatch, kernels=kernels)


def _body(params, x_btd, cache, *, cfg: ModelConfig, tp: int, ep: int, dispatch: str, kernels: str):
    """One rank's prefill: x_btd [B, T/tp, D] token shard -> logits [B, T/tp, V], cache shard."""
    cfg_local = layers.local_config(cfg, tp)
    b, t_local, _ = x_btd.shape
    t = t_local * tp
    start = jnp.zeros((b,), jnp.int32) if cache is None else cache["lengths"]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    new_layers = []
    for i in range(cfg.n_layers):
        p = params[f"layer_{i}"]
        entry = None if cache is None else cache["layers"][i]

        def mixer(h_shard, p=p, entry=entry, i=i):
            """The rank's heads over every token: gathered before, reduce-scattered after."""
            h = jax.lax.all_gather(h_shard, ALL, axis=1, tiled=True)  # [B, T, D]
            y, c = layers.mixer(cfg_local, i, p, h, positions, entry, kernels)
            return jax.lax.psum_scatter(y, ALL, scatter_dimension=1, tiled=True), c  # [B, T/tp, D]

        with jax.named_scope(f"layer_{i}"):  # a profile reads by layer, as the unsharded model's does
            x_btd, c = residual_block(
                x_btd,
                mixer=mixer,
                ffn=lambda h: ffn(cfg, i, p, h, ep=ep, dispatch=dispatch, kernels=kernels),
                **layers.block_norms(cfg, p),
            )
        new_layers.append(c)
    logits = lm_head(params, cfg, x_btd)
    if cache is None:
        return logits, None
    return logits, {"lengths": cache["lengths"] + t, "layers": tuple(new_layers)}


class ShardedPrefill:
    """Prefill of `cfg` on a `prefill_mesh`.

    ``ShardedPrefill(cfg, mesh)(params, tokens, cache=None, images=None)`` ->
    (logits f32 [B, T, V] sharded over tokens, new cache or None), the same
    contract as `kimik3.model.forward`.  Params and cache are placed with
    `place_params` / `place_cache` (each device receives only its shard).
    """

    rules: Rules = PREFILL_RULES

    def __init__(self, cfg: ModelConfig, mesh: Mesh, *, dispatch: str = "auto", kernels: str = "auto"):
        self.cfg, self.mesh = cfg, mesh
        self.shape = mesh_shape(mesh, "prefill")
        check_config(cfg, self.shape)
        self.dispatch = layers.resolve_dispatch(dispatch)
        self.kernels = ops.resolve(kernels)
        self._jitted = jax.jit(self._run)
        log.info(
            "prefill on tp=%d ep=%d (%s dispatch, %s kernels)",
            self.shape.size,
            self.shape.ep,
            self.dispatch,
            self.kernels,
        )

    def place_params(self, params):
        return shard_params(params, self.mesh, self.rules)

    def place_cache(self, cache):
        return shard_cache(cache, self.mesh, self.rules)

    def _run(self, params, tokens, cache, images):
        x = embed_params(params, self.cfg, tokens, images)
        seq = P(None, ALL, None)
        cache_spec = None if cache is None else cache_specs(cache, self.rules)
        body = functools.partial(
            _body, cfg=self.cfg, tp=self.shape.size, ep=self.shape.ep, dispatch=self.dispatch, kernels=self.kernels
        )
        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs(params, self.rules), seq, cache_spec),
            out_specs=(seq, cache_spec),
            check_vma=False,
        )
        return fn(params, x, cache)

    def lower(self, params, tokens, cache=None, images=None):
        """The jitted program lowered for these inputs (for `.compile().as_text()`)."""
        tokens, _, images = self._check(tokens, cache, images)
        return self._jitted.lower(params, tokens, cache, images)

    def _check(self, tokens, cache, images):
        tokens, positions, images = model.prepare_inputs(self.cfg, tokens, images=images, cache=cache)
        if tokens.shape[1] % self.shape.size:
            raise ValueError(
                f"prefill span of {tokens.shape[1]} tokens is not a multiple of tp={self.shape.size} "
                f"(the sequence is split over the tp ranks)"
            )
        return tokens, positions, images

    def __call__(self, params, tokens, cache=None, images=None):
        tokens, _, images = self._check(tokens, cache, images)
        return self._jitted(params, tokens, cache, images)

    def run(self, params, tokens, cache=None, images=None):
        """The compiled step without `__call__`'s value checks (no host sync): for callers that
        guarantee the shapes (T a multiple of tp), e.g. the serving engine, whose inputs include
        generated ids (a random model may emit <|image|>)."""
        return self._jitted(params, tokens, cache, images)


def prefill(
    params,
    cfg: ModelConfig,
    mesh: Mesh,
    tokens,
    *,
    cache=None,
    images=None,
    dispatch: str = "auto",
    kernels: str = "auto",
):
    """One-shot convenience: `ShardedPrefill(cfg, mesh)(params, tokens, cache, images)`."""
    return ShardedPrefill(cfg, mesh, dispatch=dispatch, kernels=kernels)(params, tokens, cache, images)


__all__ = ["ShardedPrefill", "prefill", "embed_inputs", "lm_head", "ffn"]
