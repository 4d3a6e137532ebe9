"""Dense GLU MLP (the first layers' FFN; also the shared experts' form): SiTU-GLU with its caps
(Kimi-K3) or SwiGLU (Kimi-Linear), as `ModelConfig.ffn_activation` says."""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from kimik3.layers.primitives import fan_in_init, situ_glu, swiglu


@dataclasses.dataclass(frozen=True)
class SituGLU:
    """SiTU-GLU with its caps, hashable (a static argument of the jitted kernel wrappers)."""

    caps: tuple[float, float]

    def __call__(self, gate, up):
        return situ_glu(gate, up, *self.caps)


@dataclasses.dataclass(frozen=True)
class SwiGLU:
    """silu(gate) * up, hashable like `SituGLU`."""

    def __call__(self, gate, up):
        return swiglu(gate, up)


def glu_activation(cfg):
    """The config's GLU (`ModelConfig.ffn_activation`): a hashable callable (gate, up) -> hidden."""
    if cfg.ffn_activation == "silu":
        return SwiGLU()
    return SituGLU((cfg.situ_gate_cap, cfg.situ_up_cap))


def as_activation(caps_or_act):
    """An activation callable from either an activation or SiTU-GLU's (gate_cap, up_cap)."""
    return caps_or_act if callable(caps_or_act) else SituGLU(tuple(caps_or_act))


def glu_mlp(x, w_gate_df, w_up_df, w_out_fd, *, gate_cap: float = 10.0, up_cap: float = 10.0, act=None):
    """[..., D] -> [..., D] through the GLU `act` (default SiTU-GLU with the caps), intermediate F."""
    act = SituGLU((gate_cap, up_cap)) if act is None else act
    return act(x @ w_gate_df, x @ w_up_df) @ w_out_fd


class MLP(nn.Module):
    d_model: int
    hidden: int
    gate_cap: float
    up_cap: float
    activation: str = "situ"  # "situ" | "silu"

    @nn.compact
    def __call__(self, x):
        d, f = self.d_model, self.hidden
        w_gate = self.param("w_gate_df", fan_in_init(d), (d, f))
        w_up = self.param("w_up_df", fan_in_init(d), (d, f))
        w_out = self.param("w_out_fd", fan_in_init(f), (f, d))
        act = SwiGLU() if self.activation == "silu" else SituGLU((self.gate_cap, self.up_cap))
        return glu_mlp(x, w_gate, w_up, w_out, act=act)
