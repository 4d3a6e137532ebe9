"""Small pure-jnp pieces shared by every layer: norms, activations, the short conv."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import flax.linen as nn

from kimik3.quant.formats import QTensor
from pallas_kernels.moe_mxfp4_hopper import HopperMXFP4


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def l2_normalize(x, eps: float = 1e-6):
    """Unit L2 norm over the last axis (fla's `l2norm`: x / sqrt(sum x^2 + eps))."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def softcap(x, cap: float):
    return cap * jnp.tanh(x / cap)


def situ(x, cap: float):
    """Sigmoid-Tanh Unit (Kimi-K3): cap * tanh(x / cap) * sigmoid(x)."""
    return softcap(x, cap) * jax.nn.sigmoid(x)


def situ_glu(gate, up, gate_cap: float, up_cap: float):
    """SiTU-GLU: situ(gate) * softcap(up), in fp32, returned in gate's dtype."""
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    return (situ(g32, gate_cap) * softcap(u32, up_cap)).astype(gate.dtype)


def swiglu(gate, up):
    """SwiGLU: silu(gate) * up, in fp32, returned in gate's dtype (Kimi-Linear's experts and MLPs)."""
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    return (jax.nn.silu(g32) * u32).astype(gate.dtype)


def short_conv(x_btc, w_wc, state_bwc=None, export_at=None, valid_b=None):
    """Depthwise causal conv of width W (fla's ShortConvolution, no bias).

    Args:
      x_btc: [B, T, C] inputs; w_wc: [W, C] taps, oldest first.
      state_bwc: [B, W-1, C], the W-1 inputs before x (zeros if None).
      export_at: optional int32 [E] token counts in 0..T (traced).
      valid_b: optional int32 [B]: only the first valid_b[b] tokens of row b are real (the rest
        pad a prefill chunk to its compiled length); the new state is taken after them.
    Returns:
      y_btc [B, T, C] (before the activation) and the new state [B, W-1, C];
      with export_at also the state after each of those counts, [B, E, W-1, C].
    """
    width = w_wc.shape[0]
    b, t, c = x_btc.shape
    if state_bwc is None:
        state_bwc = jnp.zeros((b, width - 1, c), x_btc.dtype)
    ext = jnp.concatenate([state_bwc.astype(x_btc.dtype), x_btc], axis=1)  # [B, T+W-1, C]
    y = sum(ext[:, j : j + t].astype(jnp.float32) * w_wc[j].astype(jnp.float32) for j in range(width))
    if valid_b is None:
        new_state = ext[:, t:]
    else:
        new_state = jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, width - 1, axis=0))(
            ext, jnp.clip(valid_b, 0, t)
        )
    if export_at is None:
        return y.astype(x_btc.dtype), new_state
    at = jnp.clip(export_at, 0, t)
    states = jax.vmap(lambda p: jax.lax.dynamic_slice_in_dim(ext, p, width - 1, axis=1))(at)  # [E, B, W-1, C]
    return y.astype(x_btc.dtype), new_state, jnp.moveaxis(states, 0, 1)


def qparam(module: nn.Module, name: str, init, shape):
    """`module.param(name, init, shape)`, or the quantized weight stored under that name as it
    is: a `QTensor` holds the weight's GEMM form [K, N] (`kimik3.quant_store`), and MXFP4 experts
    moved into the Hopper kernel's layout (`kimik3.ops.hopper_mxfp4_experts`) their codes as [E,
    N, K], which Flax's check of the stored shape against `shape` would refuse."""
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if isinstance(value, (QTensor, HopperMXFP4)):
            return value
    return module.param(name, init, shape)


def gemm_form(w, contracted: int):
    """A weight [c_1 .. c_n, o_1 .. o_m] as the [K, N] matrix of its GEMM (its first `contracted`
    axes flattened into K); a `QTensor` already is one."""
    return w if isinstance(w, QTensor) else w.reshape(math.prod(w.shape[:contracted]), -1)


def fan_in_init(fan_in: int):
    """Normal(0, 1/sqrt(fan_in)) for einsum-shaped weights."""
    return nn.initializers.normal(stddev=fan_in**-0.5)


class RMSNorm(nn.Module):
    dim: int
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        return rms_norm(x, self.param("scale", nn.initializers.ones, (self.dim,)), self.eps)
