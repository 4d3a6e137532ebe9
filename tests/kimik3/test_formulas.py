"""The layers' math against independent restatements of their published equations.

Contract: every formula below is written out again in plain numpy (float64), from the equations
(KDA, MLA with NoPE, sigmoid-routed MoE with SiTU-GLU / SwiGLU experts), with its constants as
literals: softmax scale 1 / sqrt(qk_nope + qk_rope), the KDA query scale 1 / sqrt(K), the L2-norm
eps 1e-6, the bounded gate's -5, the SiTU caps 10, each norm's eps.  Nothing here imports the
layers' helpers; only the modules under test (run at fp32, matmul precision "highest") and their
parameter trees.  Each comparison holds to about 1e-4 relative to the outputs' magnitude, and
each test also checks that its restatement with one constant changed (a wrong scale, eps, bound
or cap) misses by far more than that, so a changed constant in the model cannot pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import config, model
from kimik3.layers.kda import KDA
from kimik3.layers.mla import MLA, init_mla_cache
from kimik3.layers.moe import LatentMoE
from kimik3.layers.primitives import l2_normalize, rms_norm
from tests.kimik3.test_hf import small_kimi_linear
from pallas_kernels.kda import kda_chunked_ref, kda_recurrent_ref

TOL = 1e-4  # max |got - want| / max |want|
MISS = 100 * TOL  # a restatement with one constant changed must miss by at least this much


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _check(got, want, wrong):
    """got matches want, and the restatement with a changed constant (`wrong`) does not."""
    assert _rel_err(got, want) < TOL, _rel_err(got, want)
    assert _rel_err(got, wrong) > MISS, _rel_err(got, wrong)


# ---- plain numpy formulas ----------------------------------------------------------------------


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_silu(x):
    return x * np_sigmoid(x)


def np_softplus(x):
    return np.log1p(np.exp(x))


def np_rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def np_situ_glu(gate, up, gate_cap=10.0, up_cap=10.0):
    return gate_cap * np.tanh(gate / gate_cap) * np_sigmoid(gate) * (up_cap * np.tanh(up / up_cap))


def np_swiglu(gate, up):
    return np_silu(gate) * up


def np_kda_recurrence(q, k, v, g, beta, scale=None, state=None):
    """q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]; S [B, H, K, V] per token:
    S <- diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = S^T (q * scale), scale 1 / sqrt(K)."""
    b, t, h, kd = q.shape
    scale = 1.0 / np.sqrt(kd) if scale is None else scale
    s = np.zeros((b, h, kd, v.shape[-1])) if state is None else np.array(state, np.float64)
    out = np.zeros(v.shape)
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None]
        pred = np.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + np.einsum("bhk,bhv->bhkv", beta[:, i, :, None] * k[:, i], v[:, i] - pred)
        out[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i] * scale, s)
    return out, s


def np_causal_conv(x_btc, w_wc):
    """Depthwise causal conv, taps oldest first: y_t = sum_j w[j] x_{t - (W - 1) + j} (zeros before 0)."""
    width = w_wc.shape[0]
    ext = np.concatenate([np.zeros((x_btc.shape[0], width - 1, x_btc.shape[2])), x_btc], axis=1)
    return sum(ext[:, j : j + x_btc.shape[1]] * w_wc[j] for j in range(width))


# ---- helpers -----------------------------------------------------------------------------------


def _draw_params(module, key, *args):
    """The module's params with every leaf redrawn: norm weights around 1, biases around 0, the
    rest at the init's scale, so no weight sits at an init value that would hide a formula."""
    return _redraw(module.init(key, *args)["params"], int(jax.random.randint(key, (), 0, 2**30)))


def _redraw(params, seed: int):
    leaves, tree = jax.tree.flatten_with_path(params)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        a = np.asarray(leaf, np.float64)
        if "norm" in name or name.endswith("['scale']"):
            a = 1.0 + 0.3 * rng.standard_normal(a.shape)
        elif "bias" in name:
            a = 0.5 * rng.standard_normal(a.shape)
        elif "a_log" in name:
            a = np.log(rng.uniform(1.0, 16.0, a.shape))
        else:
            a = rng.standard_normal(a.shape) * max(float(np.std(a)), 1e-2)
        out.append(jnp.asarray(a, jnp.float32))
    params = jax.tree.unflatten(tree, out)
    return params, jax.tree.map(lambda p: np.asarray(p, np.float64), params)


def _x(shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


# ---- 1. norms ----------------------------------------------------------------------------------


def test_rms_norm_is_x_over_root_mean_square_plus_eps_times_weight():
    eps = config.tiny().norm_eps
    assert eps == 1e-6
    x = _x((5, 64), scale=1e-3)  # mean x^2 ~ 1e-6: eps moves the result
    w = 1.0 + _x((64,), 1)
    got = rms_norm(jnp.asarray(x), jnp.asarray(w), eps)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    _check(got, np_rms_norm(x64, w64, 1e-6), np_rms_norm(x64, w64, 1e-5))


def test_l2_normalize_is_x_over_root_of_sum_of_squares_plus_1e_minus_6():
    x = _x((5, 16), scale=3e-4)  # sum x^2 ~ 1.4e-6: eps moves the result
    got = l2_normalize(jnp.asarray(x))
    x64 = x.astype(np.float64)
    _check(got, np_l2norm(x64, 1e-6), np_l2norm(x64, 1e-5))


# ---- 2. KDA ------------------------------------------------------------------------------------


def _kda_inputs(b=2, t=11, h=2, k=8, v=6, seed=0):
    rng = np.random.default_rng(seed)
    q = np_l2norm(rng.standard_normal((b, t, h, k)))
    kk = np_l2norm(rng.standard_normal((b, t, h, k)))
    vv = rng.standard_normal((b, t, h, v))
    g = -5.0 * np_sigmoid(rng.standard_normal((b, t, h, k)))
    beta = np_sigmoid(rng.standard_normal((b, t, h)))
    s0 = rng.standard_normal((b, h, k, v))
    return q, kk, vv, g, beta, s0


@pytest.mark.parametrize("ref", ["recurrent", "chunked"])
def test_kda_references_follow_the_delta_rule_with_per_channel_decay(ref):
    q, k, v, g, beta, s0 = _kda_inputs()
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    args = [f32(a) for a in (q, k, v, g, beta)]
    if ref == "recurrent":
        o, s = kda_recurrent_ref(*args, initial_state=f32(s0))
    else:
        o, s = kda_chunked_ref(*args, initial_state=f32(s0), chunk_size=4)  # 11 tokens: 3 chunks, one padded
    want_o, want_s = np_kda_recurrence(q, k, v, g, beta, state=s0)
    wrong_o, _ = np_kda_recurrence(q, k, v, g, beta, scale=1.25 / np.sqrt(8), state=s0)
    _check(o, want_o, wrong_o)
    assert _rel_err(s, want_s) < TOL
    # the decay is exp(g) applied before the update: exp(g / 2) instead misses
    _, wrong_s = np_kda_recurrence(q, k, v, g / 2, beta, state=s0)
    assert _rel_err(s, wrong_s) > MISS


def np_kda_layer(w, x, *, bound, eps, softplus_gate: bool, l2_eps=1e-6):
    """The KDA layer from its params: projections, short convs + SiLU, L2-normalised q / k, the
    gate, beta = sigmoid, the recurrence, rms_norm(o) * w * sigmoid(output gate), the output GEMM."""
    b, t, d = x.shape
    h, kd = w["a_log_h"].shape[0], w["dt_bias_hk"].shape[1]
    proj = lambda name: x @ w[name].reshape(d, -1)
    y = {
        n: np_silu(np_causal_conv(proj(p), w[f"conv_{n}_wc"])) for n, p in zip("qkv", ("w_q_dhk", "w_k_dhk", "w_v_dhv"))
    }
    q = np_l2norm(y["q"].reshape(b, t, h, kd), l2_eps)
    k = np_l2norm(y["k"].reshape(b, t, h, kd), l2_eps)
    v = y["v"].reshape(b, t, h, kd)
    f = np.einsum("btr,rhk->bthk", x @ w["w_fa_dr"], w["w_fb_rhk"]) + w["dt_bias_hk"]
    rate = np.exp(w["a_log_h"])[:, None]
    g = -rate * np_softplus(f) if softplus_gate else bound * np_sigmoid(rate * f)
    beta = np_sigmoid(x @ w["w_beta_dh"])
    o, _ = np_kda_recurrence(q, k, v, g, beta)
    gate = np_sigmoid(np.einsum("btr,rhv->bthv", x @ w["w_ga_dr"], w["w_gb_rhv"]))
    o = np_rms_norm(o, w["o_norm_v"], eps) * gate
    return np.einsum("bthv,hvd->btd", o, w["w_o_hvd"])


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_kda_layer_is_convs_l2_norm_gate_delta_rule_and_gated_norm(gate):
    # distinct eps per norm (large, so a mix-up shows); chunk 4 so 9 tokens span 3 chunks
    cfg = config.tiny().replace(kda_gate=gate, kda_chunk_size=4, norm_eps=0.03, kda_norm_eps=0.2, mla_norm_eps=0.05)
    layer = KDA(cfg)
    x = _x((2, 9, cfg.d_model), 3)
    params, w = _draw_params(layer, jax.random.PRNGKey(0), jnp.asarray(x))
    if gate == "softplus":  # softplus(f) with f ~ 0.5 and rate up to 16 decays fast: keep rates small
        w["a_log_h"] = np.log(np.array([0.3, 0.7]))
        params = dict(params, a_log_h=jnp.asarray(w["a_log_h"], jnp.float32))
    got, _, _ = layer.apply({"params": params}, jnp.asarray(x))
    x64 = x.astype(np.float64)
    soft = gate == "softplus"
    want = np_kda_layer(w, x64, bound=-5.0, eps=0.2, softplus_gate=soft)
    _check(got, want, np_kda_layer(w, x64, bound=-5.0, eps=0.03, softplus_gate=soft))
    if not soft:
        assert _rel_err(got, np_kda_layer(w, x64, bound=-4.0, eps=0.2, softplus_gate=False)) > MISS
    # the other gate form misses too
    assert _rel_err(got, np_kda_layer(w, x64, bound=-5.0, eps=0.2, softplus_gate=not soft)) > MISS


# ---- 3. MLA ------------------------------------------------------------------------------------


def np_mla(w, x, *, heads, nope, rope, kv_lora, eps, scale, gated: bool):
    """Naive MLA with NoPE over all of x's tokens, causal: per-head keys [k_nope | k_pe], k_pe the
    latent's shared rope part (unrotated), softmax(q.k * scale), then sigmoid(x W_gate) * o."""
    b, t, d = x.shape
    if "w_qa_dq" in w:
        q = np_rms_norm(x @ w["w_qa_dq"], w["q_norm"], eps) @ w["w_qb_qhk"].reshape(w["w_qb_qhk"].shape[0], -1)
    else:
        q = x @ w["w_q_dhk"].reshape(d, -1)
    q = q.reshape(b, t, heads, nope + rope)
    kv = x @ w["w_kva_dr"]
    c = np_rms_norm(kv[..., :kv_lora], w["kv_norm"], eps)
    k_pe = kv[..., kv_lora:]
    k_nope = np.einsum("bsr,rhn->bshn", c, w["w_kb_rhn"])
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, :, None], (b, t, heads, rope))], axis=-1)
    v = np.einsum("bsr,rhv->bshv", c, w["w_vb_rhv"])
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshv->bthv", p, v)
    if gated:
        o = o * np_sigmoid(np.einsum("btd,dhv->bthv", x, w["w_gate_dhv"]))
    return np.einsum("bthv,hvd->btd", o, w["w_o_hvd"])


MLA_CASES = {
    "k3": dict(),  # q-LoRA, output gate
    "linear": dict(q_lora_rank=0, mla_output_gate=False),  # Kimi-Linear's switches
}


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_is_causal_nope_attention_with_scale_one_over_root_of_qk_dim(case):
    cfg = config.tiny().replace(norm_eps=0.03, kda_norm_eps=0.2, mla_norm_eps=0.1, **MLA_CASES[case])
    assert (cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.mla_heads) == (16, 16, 32, 2)
    scale = 1.0 / np.sqrt(16 + 16)
    layer = MLA(cfg)
    b, t = 2, 7  # t > mla_absorb_max_tokens (4): the cached prefill is the naive form
    x = _x((b, t + 1, cfg.d_model), 5)
    pos = jnp.broadcast_to(jnp.arange(t + 1)[None], (b, t + 1))
    params, w = _draw_params(layer, jax.random.PRNGKey(1), jnp.asarray(x[:, :t]), pos[:, :t])
    x64 = x.astype(np.float64)
    kw = dict(heads=2, nope=16, rope=16, kv_lora=32, gated=case == "k3")
    want = np_mla(w, x64, eps=0.1, scale=scale, **kw)
    wrong_scale = np_mla(w, x64, eps=0.1, scale=1.25 * scale, **kw)
    wrong_eps = np_mla(w, x64, eps=0.03, scale=scale, **kw)

    got, _ = layer.apply({"params": params}, jnp.asarray(x), pos)  # no cache
    _check(got, want, wrong_scale)
    assert _rel_err(got, wrong_eps) > MISS

    # with a cache: a prefill of t tokens (naive form), then one decode token (absorbed form)
    cache = init_mla_cache(cfg, b, 16, jnp.float32)
    got_pre, cache = layer.apply({"params": params}, jnp.asarray(x[:, :t]), pos[:, :t], cache)
    got_dec, _ = layer.apply({"params": params}, jnp.asarray(x[:, t:]), pos[:, t:], cache)
    _check(got_pre, want[:, :t], wrong_scale[:, :t])
    _check(got_dec, want[:, t:], wrong_scale[:, t:])
    assert _rel_err(got_dec, wrong_eps[:, t:]) > MISS


# ---- 4. MoE ------------------------------------------------------------------------------------


def np_moe(w, x, *, top_k, latent, biased, act, scaling, eps):
    """Sigmoid scores; top-k of scores + bias; weights the chosen scores (or scores + bias)
    renormalised; experts act(x Wg) * ... in the latent (then RMSNorm, W_up) or at d_model; times
    the scaling factor; plus the shared expert."""
    b, t, d = x.shape
    xn = x.reshape(b * t, d)
    scores = np_sigmoid(xn @ w["w_router_de"])
    choice = scores + w["router_bias_e"]
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    wts = np.take_along_axis(choice if biased else scores, ids, axis=-1)
    wts = wts / wts.sum(-1, keepdims=True)
    xl = xn @ w["w_down_dl"] if latent else xn
    z = np.zeros(xl.shape)
    for n in range(xn.shape[0]):
        for e, c in zip(ids[n], wts[n]):
            z[n] += c * (act(xl[n] @ w["w_gate_elf"][e], xl[n] @ w["w_up_elf"][e]) @ w["w_out_efl"][e])
    routed = (np_rms_norm(z, w["latent_norm_l"], eps) @ w["w_up_ld"] if latent else z) * scaling
    s = w["shared"]
    shared = act(xn @ s["w_gate_df"], xn @ s["w_up_df"]) @ s["w_out_fd"]
    return (routed + shared).reshape(b, t, d)


MOE_CASES = {
    "k3_latent_situ": dict(),
    "k3_latent_situ_biased": dict(moe_biased_weights=True),
    "linear_swiglu": dict(moe_latent=False, ffn_activation="silu"),
    "linear_swiglu_biased": dict(moe_latent=False, ffn_activation="silu", moe_biased_weights=True),
}


@pytest.mark.parametrize("path", ["dense", "grouped"])
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_routes_by_sigmoid_top_k_and_mixes_glu_experts(case, path):
    # the latent sum is O(1)-O(10): a large norm eps (1.0) so that its value shows
    cfg = config.tiny().replace(norm_eps=1.0, kda_norm_eps=0.2, mla_norm_eps=0.1, **MOE_CASES[case])
    assert (cfg.n_active_experts, cfg.situ_gate_cap, cfg.situ_up_cap, cfg.routed_scaling_factor) == (2, 10, 10, 2.5)
    layer = LatentMoE(cfg, expert_path=path)
    x = _x((2, 5, cfg.d_model), 7, scale=4.0)  # large enough that the caps (10) bite
    params, w = _draw_params(layer, jax.random.PRNGKey(2), jnp.asarray(x))
    got = layer.apply({"params": params}, jnp.asarray(x))
    x64 = x.astype(np.float64)
    swiglu = cfg.ffn_activation == "silu"
    act = np_swiglu if swiglu else np_situ_glu
    kw = dict(top_k=2, latent=cfg.moe_latent, biased=cfg.moe_biased_weights, eps=1.0)
    want = np_moe(w, x64, act=act, scaling=2.5, **kw)
    _check(got, want, np_moe(w, x64, act=act, scaling=1.25 * 2.5, **kw))
    # the other weighting (with / without the bias) picks the same experts but misses
    other = dict(kw, biased=not cfg.moe_biased_weights)
    assert _rel_err(got, np_moe(w, x64, act=act, scaling=2.5, **other)) > MISS
    # routing on the scores alone (the bias dropped) picks other experts and misses
    no_bias = dict(w, router_bias_e=np.zeros_like(w["router_bias_e"]))
    assert _rel_err(got, np_moe(no_bias, x64, act=act, scaling=2.5, **kw)) > MISS
    if not swiglu:
        caps = lambda g, u: np_situ_glu(g, u, 8.0, 10.0)
        assert _rel_err(got, np_moe(w, x64, act=caps, scaling=2.5, **kw)) > MISS
        caps = lambda g, u: np_situ_glu(g, u, 10.0, 8.0)
        assert _rel_err(got, np_moe(w, x64, act=caps, scaling=2.5, **kw)) > MISS
    if cfg.moe_latent:
        assert _rel_err(got, np_moe(w, x64, act=act, scaling=2.5, **dict(kw, eps=0.1))) > MISS


# ---- 5. the whole model ------------------------------------------------------------------------


# per preset: (the config, its constants written out: norm eps, MLA eps, KDA eps, routed scaling,
# MLA dims (heads, nope, rope, kv_lora), top-k)
MODEL_CASES = {
    "tiny": (config.tiny, dict(eps=1e-6, mla_eps=1e-6, kda_eps=1e-6, scaling=2.5, mla=(2, 16, 16, 32), top_k=2)),
    "kimi_linear": (
        small_kimi_linear,
        dict(eps=1e-5, mla_eps=1e-6, kda_eps=1e-5, scaling=2.446, mla=(2, 8, 8, 16), top_k=2),
    ),
}


def np_model(cfg, w, tokens, c, mla_scale_factor=1.0):
    """Embedding, then per layer x += mixer(rms_norm(x)); x += ffn(rms_norm(x)); the final norm
    and the head.  Layer kinds from the config's layout; constants from `c`."""
    heads, nope, rope, kv_lora = c["mla"]
    act = np_swiglu if cfg.ffn_activation == "silu" else np_situ_glu
    x = w["embed_vd"][tokens]
    for i in range(cfg.n_layers):
        lw = w[f"layer_{i}"]
        h = np_rms_norm(x, lw["mixer_norm"]["scale"], c["eps"])
        if cfg.mixer_kind(i) == "kda":
            soft = cfg.kda_gate == "softplus"
            x = x + np_kda_layer(lw["kda"], h, bound=-5.0, eps=c["kda_eps"], softplus_gate=soft)
        else:
            scale = mla_scale_factor / np.sqrt(nope + rope)
            gated = cfg.mla_output_gate
            x = x + np_mla(
                lw["mla"],
                h,
                heads=heads,
                nope=nope,
                rope=rope,
                kv_lora=kv_lora,
                eps=c["mla_eps"],
                scale=scale,
                gated=gated,
            )
        h = np_rms_norm(x, lw["ffn_norm"]["scale"], c["eps"])
        if cfg.ffn_kind(i) == "dense":
            m = lw["mlp"]
            x = x + act(h @ m["w_gate_df"], h @ m["w_up_df"]) @ m["w_out_fd"]
        else:
            kw = dict(top_k=c["top_k"], latent=cfg.moe_latent, biased=cfg.moe_biased_weights, eps=c["eps"])
            x = x + np_moe(lw["moe"], h, act=act, scaling=c["scaling"], **kw)
    return np_rms_norm(x, w["final_norm"]["scale"], c["eps"]) @ w["lm_head_dv"]


# the Kimi-Linear composition is also held to transformers' logits (test_hf_reference.py): slow tier only
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "kimi_linear" else c for c in sorted(MODEL_CASES)]
)
def test_model_logits_are_the_blocks_restated_layer_by_layer(case):
    make, consts = MODEL_CASES[case]
    cfg = make()
    params, w = _redraw(model.init_params(cfg, jax.random.PRNGKey(4), "float32"), 4)
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 6))
    logits, _ = model.forward(params, cfg, jnp.asarray(tokens, jnp.int32), expert_path="dense")
    want = np_model(cfg, w, tokens, consts)
    _check(logits, want, np_model(cfg, w, tokens, consts, mla_scale_factor=1.25))
