"""Vision front end: patch embedding, a pre-LN transformer encoder, 2x2
pixel-shuffle merge, and an MLP projector into the language model's width.

images [N, S, S, C] in [0, 1] -> embeddings [N, tokens_per_image, d_model].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from kimik3.config import ViTConfig
from pallas_kernels.attention import attend
from kimik3.layers.primitives import fan_in_init


def patchify(images_nhwc, patch: int):
    """[N, S, S, C] -> [N, (S/p)^2, p*p*C], patches in row-major order."""
    n, s, _, c = images_nhwc.shape
    side = s // patch
    x = images_nhwc.reshape(n, side, patch, side, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, side * side, patch * patch * c)


def merge_patches(x_npw, side: int, merge: int):
    """Pixel shuffle: [N, side^2, W] -> [N, (side/m)^2, m*m*W]."""
    n, _, w = x_npw.shape
    s = side // merge
    x = x_npw.reshape(n, s, merge, s, merge, w).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(n, s * s, merge * merge * w)


class _LayerNorm(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (self.dim,))
        bias = self.param("bias", nn.initializers.zeros, (self.dim,))
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, -1, keepdims=True)
        var = jnp.var(x32, -1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias).astype(x.dtype)


class _EncoderLayer(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, x_npw):
        w, h = self.cfg.width, self.cfg.heads
        hd = w // h
        y = _LayerNorm(w, name="ln_attn")(x_npw)
        qkv = jnp.einsum("npw,wshd->npshd", y, self.param("w_qkv_wshd", fan_in_init(w), (w, 3, h, hd)))
        o = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], scale=hd**-0.5)
        x_npw = x_npw + jnp.einsum("nphd,hdw->npw", o, self.param("w_o_hdw", fan_in_init(w), (h, hd, w)))
        y = _LayerNorm(w, name="ln_mlp")(x_npw)
        y = jax.nn.gelu(y @ self.param("w_in_wm", fan_in_init(w), (w, self.cfg.mlp_dim)))
        return x_npw + y @ self.param("w_out_mw", fan_in_init(self.cfg.mlp_dim), (self.cfg.mlp_dim, w))


class ViT(nn.Module):
    cfg: ViTConfig
    d_model: int

    @nn.compact
    def __call__(self, images_nhwc):
        cfg = self.cfg
        patch_dim = cfg.patch_size**2 * cfg.channels
        x = patchify(images_nhwc, cfg.patch_size)
        x = x @ self.param("w_patch_pw", fan_in_init(patch_dim), (patch_dim, cfg.width))
        x = x + self.param("pos_embed_pw", nn.initializers.normal(0.02), (cfg.n_patches, cfg.width))
        for i in range(cfg.depth):
            x = _EncoderLayer(cfg, name=f"encoder_{i}")(x)
        x = _LayerNorm(cfg.width, name="ln_final")(x)
        x = merge_patches(x, cfg.patches_per_side, cfg.merge)
        merged = cfg.merge**2 * cfg.width
        x = _LayerNorm(merged, name="ln_proj")(x)
        x = jax.nn.gelu(x @ self.param("w_proj1", fan_in_init(merged), (merged, self.d_model)))
        return x @ self.param("w_proj2", fan_in_init(self.d_model), (self.d_model, self.d_model))
