"""Dense SiTU-GLU MLP (layer 0's FFN; also the shared experts' form)."""

from __future__ import annotations

import flax.linen as nn

from kimik3.layers.primitives import fan_in_init, situ_glu


def glu_mlp(x, w_gate_df, w_up_df, w_out_fd, *, gate_cap: float, up_cap: float):
    """[..., D] -> [..., D] through SiTU-GLU with intermediate F."""
    return situ_glu(x @ w_gate_df, x @ w_up_df, gate_cap, up_cap) @ w_out_fd


class MLP(nn.Module):
    d_model: int
    hidden: int
    gate_cap: float
    up_cap: float

    @nn.compact
    def __call__(self, x):
        d, f = self.d_model, self.hidden
        w_gate = self.param("w_gate_df", fan_in_init(d), (d, f))
        w_up = self.param("w_up_df", fan_in_init(d), (d, f))
        w_out = self.param("w_out_fd", fan_in_init(f), (f, d))
        return glu_mlp(x, w_gate, w_up, w_out, gate_cap=self.gate_cap, up_cap=self.up_cap)
