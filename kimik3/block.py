"""The residual block, written once for every program: the unsharded model (`kimik3.model`), its
layer-by-layer CPU programs (`kimik3.layerwise`) and the sharded prefill and decode steps
(`sharding.prefill`, `sharding.decode`), which pass in their mesh's parts (the collectives around
the mixer, the expert-parallel FFN) as callables; and the embedding and head around the blocks.

    x = x + mixer(mixer_norm(x))        `mixer_half`  (KDA or MLA; also returns the cache entry and exports)
    x = x + ffn(ffn_norm(x))            `ffn_half`    (dense MLP or LatentMoE)
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimik3 import tokenizer
from kimik3.caches import LayerEntry
from kimik3.config import ModelConfig
from kimik3.layers.kda import KDA
from kimik3.layers.mla import MLA
from kimik3.layers.mlp import MLP
from kimik3.layers.moe import LatentMoE
from kimik3.layers.primitives import RMSNorm


def mixer_half(x_btd, norm: Callable, mixer: Callable):
    """(x + y, aux) where (y, aux) = mixer(norm(x)): the block's first residual half; aux is what
    the mixer returns beside its output (the layer's cache entry).  x_btd, y [B, T, D]."""
    y, aux = mixer(norm(x_btd))
    return x_btd + y, aux


def ffn_half(x_btd, norm: Callable, ffn: Callable):
    """x + ffn(norm(x)): the block's second residual half.  x_btd [B, T, D]."""
    return x_btd + ffn(norm(x_btd))


def residual_block(x_btd, *, mixer: Callable, ffn: Callable, mixer_norm: Callable, ffn_norm: Callable):
    """One pre-RMSNorm residual block from its parts: (x [B, T, D] after both halves, the mixer's
    aux).  A mesh passes its own parts: e.g. a sequence-parallel prefill's mixer gathers the
    tokens before the heads and reduce-scatters after them (`sharding.prefill`)."""
    with jax.named_scope("mix"):
        x_btd, aux = mixer_half(x_btd, mixer_norm, mixer)
    with jax.named_scope("ffn"):
        return ffn_half(x_btd, ffn_norm, ffn), aux


def block_kind(cfg: ModelConfig, layer: int) -> tuple[str, str]:
    """What a block's params depend on: (mixer kind, FFN kind)."""
    return cfg.mixer_kind(layer), cfg.ffn_kind(layer)


def first_of_kind(cfg: ModelConfig, layer: int, half: str = "block") -> int:
    """The first layer of `layer`'s kind: its `block_kind` (half "block"), its mixer kind
    ("mixer") or its FFN kind ("ffn").  What a program compiled once per kind (the init's draws,
    `kimik3.layerwise`) is traced for, since a block (half) depends on nothing else."""
    kind = {"block": lambda i: block_kind(cfg, i), "mixer": cfg.mixer_kind, "ffn": cfg.ffn_kind}[half]
    return next(i for i in range(cfg.n_layers) if kind(i) == kind(layer))


class Block(nn.Module):
    """Pre-RMSNorm residual block: token mixer (KDA or MLA), then FFN (dense or MoE).

    Its two halves are methods of their own (`mix`, `ffn`) so that a program can hold one
    half (`kimik3.layerwise` compiles each mixer kind and each FFN kind once)."""

    cfg: ModelConfig
    layer: int
    expert_path: str = "grouped"
    kernels: str = "auto"

    def setup(self):
        cfg = self.cfg
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.mixer_kind(self.layer) == "kda":
            self.kda = KDA(cfg, self.kernels)
        else:
            self.mla = MLA(cfg, self.kernels)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.ffn_kind(self.layer) == "dense":
            self.mlp = MLP(cfg.d_model, cfg.dense_ffn_dim, cfg.situ_gate_cap, cfg.situ_up_cap, cfg.ffn_activation)
        else:
            self.moe = LatentMoE(cfg, self.expert_path, self.kernels)

    def __call__(self, x_btd, positions_bt, cache: LayerEntry | None, *, export_at=None, valid_b=None):
        """x [B, T, D], positions [B, T], the layer's cache entry (`kimik3.caches`) or None ->
        (x after the block, the entry written, the KDA exports or None); see `mix`."""
        x_btd, cache, exports = self.mix(x_btd, positions_bt, cache, export_at=export_at, valid_b=valid_b)
        return self.ffn(x_btd, valid_b), cache, exports

    def mix(self, x_btd, positions_bt, cache: LayerEntry | None, *, export_at=None, valid_b=None):
        """(x + mixer(norm(x)), the layer's cache entry written, its exports).  The entry is the
        mixer's (`kimik3.layers.kda.KDA`, `kimik3.layers.mla.MLA`): for KDA the state after the
        span (from zero without a cache), for MLA None without a cache.  export_at (int32 [E]):
        the positions whose KDA state the layer exports (a `kimik3.caches.KDAState` [B, E, ...];
        None for an MLA layer or without export_at).  valid_b (int32 [B]): each row's real
        tokens (the rest pad the call and change no cache)."""
        if self.cfg.mixer_kind(self.layer) == "kda":

            def kda(h):
                y, entry, exports = self.kda(h, cache, export_at=export_at, valid_b=valid_b)
                return y, (entry, exports)

            x_btd, (entry, exports) = mixer_half(x_btd, self.mixer_norm, kda)
            return x_btd, entry, exports
        x_btd, entry = mixer_half(x_btd, self.mixer_norm, lambda h: self.mla(h, positions_bt, cache, valid_b=valid_b))
        return x_btd, entry, None

    def ffn(self, x_btd, valid_b=None):
        """x + ffn(norm(x)).  valid_b: int32 [B] or None; a row's pad tokens (past valid[b]: a
        padded chunk, a decode bucket's idle rows) are routed to no expert, so they read no
        expert weights."""
        if self.cfg.ffn_kind(self.layer) == "dense":
            return ffn_half(x_btd, self.ffn_norm, self.mlp)
        real = None if valid_b is None else jnp.arange(x_btd.shape[1])[None] < valid_b[:, None]
        return ffn_half(x_btd, self.ffn_norm, lambda h: self.moe(h, real))


def splice_image_embeddings(x_btd, tokens_bt, emb_npd, first_row=0):
    """Replace <|image|> placeholders, in row-major (batch, time) order, by the
    rows of emb [N, P, D] flattened to [N*P, D], starting at row `first_row`
    (a prefill chunk that begins after some of its request's placeholders).

    Placeholders past the last row are text tokens: an <|image|> the model generates is
    embedded like any token it generates (what a decode step does), so the oracle's full
    recompute and the cached path agree on it."""
    flat = emb_npd.reshape(-1, emb_npd.shape[-1]).astype(x_btd.dtype)
    is_img = (tokens_bt == tokenizer.IMAGE_ID).reshape(-1)
    row = jnp.cumsum(is_img) - 1 + first_row
    is_img = is_img & (row < flat.shape[0])
    x = x_btd.reshape(-1, x_btd.shape[-1])
    return jnp.where(is_img[:, None], flat[jnp.clip(row, 0, flat.shape[0] - 1)], x).reshape(x_btd.shape)


def embed_inputs(embed_vd, tokens_bt, images, vit=None):
    """x [B, T, D]: the token embeddings with image rows spliced in.  images: pixels
    [N, S, S, C] (encoded by `vit`, a callable -> [N, P, D]), or {"rows": [M, D], "first":
    int32 []} embeddings computed earlier (see `KimiK3`), or None."""
    x = embed_vd[tokens_bt]
    if isinstance(images, dict):
        return splice_image_embeddings(x, tokens_bt, images["rows"], images["first"])
    if vit is not None and images is not None:
        return splice_image_embeddings(x, tokens_bt, vit(images.astype(x.dtype)))
    return x


def head_logits(x_btd, lm_head_dv):
    """fp32 logits [B, T, V] of the final-normed rows (the head's dot is fp32 by design)."""
    return jnp.dot(x_btd.astype(jnp.float32), lm_head_dv.astype(jnp.float32))
