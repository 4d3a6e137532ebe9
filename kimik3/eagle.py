"""The EAGLE-3 draft head: a one-layer model that reads its target's hidden states.

Draft slot i reads (h_i, x_{i+1}): the target's residual stream after a low, a middle and a high
layer at position i (`model.forward_taps`), fused by one FC (3D -> D) into g_i, and the
embedding of the token that follows (the target's own embedding table, frozen).  One decoder
layer, then its own final norm and LM head, predicts x_{i+2}::

    g_i   = [h_low; h_mid; h_high]_i @ fc_fd                  [B, T, 3D] -> [B, T, D]
    u_i   = [rms(e(x_{i+1})); rms(g_i)]                        [B, T, 2D]
    x_i   = g_i + MLA(u)_i                                      (the target's MLA, input 2D wide)
    o_i   = x_i + MLP(rms(x_i))                                 the draft's hidden state
    q_i   = softmax(rms(o_i) @ lm_head_dv)                      the draft's guess at x_{i+2}

Drafting k tokens chains the head on itself: slot i + 1 reads (o_i, d_1) where d_1 is the
token it drafted, and so on.  Its attention is the target's MLA (`kimik3.layers.mla`, NoPE:
positions enter through causality only), so its latent rows have the target's MLA page shape
and live on the target's block tables.

Training-time test (`ttt_logits`): step 0 runs every slot on the target's features; step j
re-runs every slot i on the draft's own step j - 1 output, with the true token x_{i+j+1}, as if
it were position i + j of a chain started at i: its query sees step 0's latent rows at
positions <= i and its own chain's rows of steps 1..j (never another chain's).  That is exactly
what the chained inference sees (`draft_chain` checks it in the tests).

Weights (a plain pytree; `init_draft`)::

    {"fc_fd": [3D, D], "embed_norm": [D], "feat_norm": [D], "mla": the MLA layer's (input 2D),
     "ffn_norm": [D], "mlp": {"w_gate_df", "w_up_df", "w_out_fd"}, "final_norm": [D],
     "lm_head_dv": [D, V] (initialized from the target's)}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kimik3.caches import MLALatent, MLAPages
from kimik3.config import ModelConfig
from kimik3.block import ffn_half, head_logits
from kimik3.layers.mla import MLA, mla_output, mla_project
from pallas_kernels.mla_forms import expand_heads
from kimik3.layers.mlp import MLP, glu_mlp
from kimik3.layers.primitives import rms_norm

Params = dict


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """taps: the target's low / middle / high layers (unrolled ones); ffn_dim: the draft MLP's
    width; ttt_steps: training-time-test depth (step 0 on the target's features, then the
    draft's own); loss_decay: step j's loss weight is loss_decay ** j (SpecForge's 0.8)."""

    taps: tuple[int, int, int]
    ffn_dim: int
    ttt_steps: int = 3
    loss_decay: float = 0.8

    def __post_init__(self):
        if len(self.taps) != 3:
            raise ValueError(f"EagleConfig.taps must name 3 target layers (low, mid, high); got {self.taps}")
        if self.ttt_steps < 1 or self.ffn_dim < 1:
            raise ValueError(f"EagleConfig: ttt_steps and ffn_dim must be >= 1; got {self.ttt_steps}, {self.ffn_dim}")

    def check(self, cfg: ModelConfig) -> None:
        if any(not 0 <= t < cfg.n_layers for t in self.taps):
            raise ValueError(f"EagleConfig.taps {self.taps} must lie in [0, {cfg.n_layers}) for {cfg.name}")


def default_config(cfg: ModelConfig, **kw) -> EagleConfig:
    """vLLM's default taps (layers 2, L // 2, L - 3, clipped to the model) and the target's dense
    FFN width."""
    n = cfg.n_layers
    taps = tuple(sorted(min(max(t, 0), n - 1) for t in (2, n // 2, n - 3)))
    return EagleConfig(taps=taps, ffn_dim=kw.pop("ffn_dim", cfg.dense_ffn_dim), **kw)


def init_draft(key, cfg: ModelConfig, ecfg: EagleConfig, target_params: Params) -> Params:
    """Fresh draft weights in fp32; the LM head starts as a copy of the target's."""
    ecfg.check(cfg)
    d = cfg.d_model
    k_fc, k_mla, k_mlp = jax.random.split(key, 3)
    u = jnp.zeros((1, 1, 2 * d), jnp.float32)
    mla = MLA(cfg, "reference").init(k_mla, u, jnp.zeros((1, 1), jnp.int32))["params"]
    mlp = MLP(d, ecfg.ffn_dim, cfg.situ_gate_cap, cfg.situ_up_cap).init(k_mlp, u[..., :d])["params"]
    ones = lambda: jnp.ones((d,), jnp.float32)  # a buffer each: a training step donates them
    return {
        "fc_fd": jax.random.normal(k_fc, (3 * d, d), jnp.float32) * (3 * d) ** -0.5,
        "embed_norm": ones(),
        "feat_norm": ones(),
        "mla": mla,
        "ffn_norm": ones(),
        "mlp": mlp,
        "final_norm": ones(),
        "lm_head_dv": jnp.array(target_params["lm_head_dv"], jnp.float32, copy=True),
    }


def fuse(params: Params, taps_btld):
    """The target's tapped hidden states [B, T, 3, D] -> the draft's features g [B, T, D]."""
    b, t = taps_btld.shape[:2]
    x = taps_btld.reshape(b, t, -1).astype(params["fc_fd"].dtype)
    return x @ params["fc_fd"]


def _layer_input(params, cfg, feat_btd, emb_btd):
    return jnp.concatenate(
        [
            rms_norm(emb_btd.astype(feat_btd.dtype), params["embed_norm"], cfg.norm_eps),
            rms_norm(feat_btd, params["feat_norm"], cfg.norm_eps),
        ],
        axis=-1,
    )


def _ffn(params, cfg, x_btd):
    m = params["mlp"]
    return ffn_half(
        x_btd,
        lambda x: rms_norm(x, params["ffn_norm"], cfg.norm_eps),
        lambda h: glu_mlp(
            h, m["w_gate_df"], m["w_up_df"], m["w_out_fd"], gate_cap=cfg.situ_gate_cap, up_cap=cfg.situ_up_cap
        ),
    )


def draft_layer(
    params: Params,
    cfg: ModelConfig,
    feat_btd,
    emb_btd,
    positions_bt,
    cache: MLALatent | MLAPages | None = None,
    *,
    kernels: str = "reference",
    valid_b=None,
):
    """Slots [B, T]: features (g or the draft's own hidden) [B, T, D] and the next tokens'
    embeddings [B, T, D] -> (hidden o [B, T, D], the MLA cache entry written, or None).

    The cache is the MLA layer's entry (`kimik3.caches.MLALatent` or `MLAPages`); valid_b int32
    [B]: each row's real slots, the rest pad the call and write no page (`kimik3.layers.mla.MLA`)."""
    u = _layer_input(params, cfg, feat_btd, emb_btd)
    y, cache = MLA(cfg, kernels).apply({"params": params["mla"]}, u, positions_bt, cache, valid_b=valid_b)
    return _ffn(params, cfg, feat_btd + y), cache


def draft_logits(params: Params, cfg: ModelConfig, hidden_btd):
    """The draft's hidden states [B, T, D] -> logits [B, T, V] in fp32."""
    return head_logits(rms_norm(hidden_btd, params["final_norm"], cfg.norm_eps), params["lm_head_dv"])


def ttt_logits(params: Params, cfg: ModelConfig, ecfg: EagleConfig, embed_vd, taps_btld, tokens_bt):
    """Training-time test over whole sequences: logits [steps, B, T, V] fp32, where step j's
    row i is the draft's guess at x_{i+j+2} after a chain started at slot i (its token inputs
    are the true x_{i+1} .. x_{i+j+1}; past the sequence end they are padding, which the loss
    masks).  fp32 naive attention (no kernels): the form the chained inference must equal."""
    w = params["mla"]
    b, t = tokens_bt.shape
    scale = cfg.mla_qk_dim**-0.5
    feat = fuse(params, taps_btld)
    causal = jnp.tril(jnp.ones((t, t), bool))
    keys0 = vals0 = None
    diag_k, diag_v = [], []  # the chain rows of steps 1..j at each slot: [B, T, H, K] / [B, T, H, v]
    out = []
    for j in range(ecfg.ttt_steps):
        nxt = jnp.pad(tokens_bt[:, j + 1 :], ((0, 0), (0, j + 1)))  # x_{i+j+1}, zero past the end
        u = _layer_input(params, cfg, feat, embed_vd[nxt])
        q, latent, xg = mla_project(cfg, w, u)
        k, v = expand_heads(latent, w["w_kb_rhn"], w["w_vb_rhv"])
        if j == 0:
            keys0, vals0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        s0 = jnp.einsum("bthk,bshk->bhts", q, keys0, preferred_element_type=jnp.float32) * scale
        s0 = jnp.where(causal[None, None], s0, -jnp.inf)
        sd = [
            jnp.einsum("bthk,bthk->bht", q, kk, preferred_element_type=jnp.float32)[..., None] * scale for kk in diag_k
        ]
        p = jax.nn.softmax(jnp.concatenate([s0] + sd, axis=-1), axis=-1)
        o = jnp.einsum("bhts,bshv->bthv", p[..., :t].astype(vals0.dtype), vals0)
        for s, vv in enumerate(diag_v):
            o = o + jnp.einsum("bht,bthv->bthv", p[..., t + s].astype(vv.dtype), vv)
        hidden = _ffn(params, cfg, feat + mla_output(w, o, xg, u.dtype))
        out.append(draft_logits(params, cfg, hidden))
        feat = hidden
    return jnp.stack(out)


def ttt_loss(params: Params, cfg: ModelConfig, ecfg: EagleConfig, embed_vd, taps_btld, tokens_bt, target_logits_btv):
    """Soft cross-entropy of every TTT step against the target's next-token distribution
    (target logits at position i + j + 1 for step j's slot i), weighted loss_decay ** j.
    Returns (loss, {"acc": [steps] top-1 agreement with the target, "ce": [steps]})."""
    logits = ttt_logits(params, cfg, ecfg, embed_vd, taps_btld, tokens_bt)
    t = tokens_bt.shape[1]
    ces, accs, total = [], [], 0.0
    for j in range(ecfg.ttt_steps):
        tgt = jnp.pad(target_logits_btv[:, j + 1 :], ((0, 0), (0, j + 1), (0, 0)))
        mask = (jnp.arange(t) + j + 1 < t).astype(jnp.float32)[None]  # [1, T]
        n = jnp.maximum(mask.sum() * tokens_bt.shape[0], 1.0)
        p_t = jax.nn.softmax(tgt.astype(jnp.float32), axis=-1)
        logq = jax.nn.log_softmax(logits[j], axis=-1)
        ce = -(jnp.sum(p_t * logq, axis=-1) * mask).sum() / n
        acc = ((jnp.argmax(logits[j], -1) == jnp.argmax(tgt, -1)) * mask).sum() / n
        total = total + ecfg.loss_decay**j * ce
        ces.append(ce)
        accs.append(acc)
    return total, {"ce": jnp.stack(ces), "acc": jnp.stack(accs)}


def draft_chain(params: Params, cfg: ModelConfig, embed_vd, taps_ld, tokens, k: int, *, greedy_tokens=None):
    """The inference chain, no cache, for one sequence: slots 0 .. n - 2 on the target's features
    (`taps_ld` [n, 3, D] of tokens [n]; slot i reads x_{i+1}), then k - 1 more slots on the
    draft's own hidden states.  The tokens the chain feeds itself are its own greedy guesses,
    or `greedy_tokens` [k - 1] when given (teacher forcing, what TTT trains).  Returns logits
    [k, V]: the guesses at x_n .. x_{n+k-1}."""
    tokens = jnp.asarray(tokens, jnp.int32)
    n = tokens.shape[0]
    feat = fuse(params, taps_ld[None, : n - 1])[0]  # [n - 1, D]
    toks = tokens[1:]
    out = []
    for s in range(k):
        pos = jnp.arange(feat.shape[0], dtype=jnp.int32)[None]
        hidden, _ = draft_layer(params, cfg, feat[None], embed_vd[toks][None], pos)
        logits = draft_logits(params, cfg, hidden[:, -1:])[0, 0]
        out.append(logits)
        if s == k - 1:
            break
        nxt = jnp.argmax(logits) if greedy_tokens is None else jnp.asarray(greedy_tokens, jnp.int32)[s]
        feat = jnp.concatenate([feat, hidden[0, -1:]], axis=0)
        toks = jnp.concatenate([toks, nxt[None]])
    return jnp.stack(out)
