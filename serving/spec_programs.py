"""The device programs of EAGLE-3 speculative decoding (`serving.spec_decode`, whose module
comment describes the round): the draft pools, prefill drafting, a round's catch-up / chain /
verify / accept / commit as one program (`spec_step`), and the host's view of the rows it
advances."""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import eagle, model
from kimik3.caches import MLAPages
from kimik3.config import ModelConfig

TAIL_MODES = ("drop", "no_drop", "exact")


def verify_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config for a verify pass: KDA at one token a chunk (the chunked form at
    chunk 1 is the recurrence, and every position is a chunk end, so its state is exported)."""
    return dataclasses.replace(cfg, kda_chunk_size=1)


def init_draft_pools(cfg: ModelConfig, num_pages: int, num_slots: int, page_tokens: int, k: int, dtype) -> dict:
    """{"pages": [num_pages, page, kv_lora + rope] the draft's latent rows (the target's page ids),
    "tail_g": f32 [num_pages, D] the fused feature of each page's last slot,
    "pending": f32 [num_slots, k + 1, D] per KDA slot, the features of its slots not yet written}."""
    return {
        "pages": jnp.zeros((num_pages, page_tokens, cfg.mla_latent_dim), dtype),
        "tail_g": jnp.zeros((num_pages, cfg.d_model), jnp.float32),
        "pending": jnp.zeros((num_slots, k + 1, cfg.d_model), jnp.float32),
    }


def _draft_rows(
    draft,
    embed_vd,
    dpools,
    feats_btd,
    tokens_bt,
    positions_bt,
    tables,
    valid_b,
    *,
    cfg,
    kernels,
    page_tokens,
    store_tail: bool,
):
    """The draft layer over slots [B, T] on its paged rows (only each row's first valid_b slots
    are written).  With store_tail, the features of slots that end a page go to tail_g.
    Returns (hidden [B, T, D], dpools)."""
    cache = MLAPages(dpools["pages"], tables)
    hidden, cache = eagle.draft_layer(
        draft, cfg, feats_btd, embed_vd[tokens_bt], positions_bt, cache, kernels=kernels, valid_b=valid_b
    )
    dpools = dict(dpools, pages=cache.pages)
    if store_tail:
        real = jnp.arange(positions_bt.shape[1])[None] < valid_b[:, None]
        ends = real & (positions_bt % page_tokens == page_tokens - 1)
        page = jnp.take_along_axis(tables, positions_bt // page_tokens, axis=1, mode="clip")
        page = jnp.where(ends, page, dpools["tail_g"].shape[0])  # out of range: dropped
        dpools = dict(dpools, tail_g=dpools["tail_g"].at[page].set(feats_btd.astype(jnp.float32), mode="drop"))
    return hidden, dpools


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "page_tokens"), donate_argnames=("dpools",))
def prefill_draft(
    draft, embed_vd, dpools, taps_btld, tokens_bt, start, n_real, from_prev, slot, table, *, cfg, kernels, page_tokens
):
    """The draft rows a prefill chunk makes known, for one request.

    taps_btld [1, T, 3, D]: the chunk's target taps (positions start .. start + T - 1, the first
    n_real real); from_prev (bool): slot start - 1 is pending (its feature pending[slot][0]), so
    the T slots start there and n_real are written, else they start at `start` and n_real - 1
    are; tokens_bt [1, T]: the tokens x_{i+1} those slots read (`prefill_draft_tokens`).  The
    feature of the chunk's last real position becomes pending[slot][0].  Returns dpools."""
    g = eagle.fuse(draft, taps_btld)[0]  # [T, D]
    feats = jnp.where(from_prev, jnp.concatenate([dpools["pending"][slot, :1], g[:-1]]), g)
    first = jnp.where(from_prev, start - 1, start)
    count = jnp.where(from_prev, n_real, n_real - 1)
    positions = first + jnp.arange(g.shape[0], dtype=jnp.int32)
    _, dpools = _draft_rows(
        draft,
        embed_vd,
        dpools,
        feats[None],
        tokens_bt,
        positions[None],
        table[None],
        count[None],
        cfg=cfg,
        kernels=kernels,
        page_tokens=page_tokens,
        store_tail=True,
    )
    last = jax.lax.dynamic_index_in_dim(g, n_real - 1, keepdims=False)
    return dict(dpools, pending=dpools["pending"].at[slot, 0].set(last))


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "page_tokens"), donate_argnames=("dpools",))
def write_slot(draft, embed_vd, dpools, slot, position, token, table, *, cfg, kernels, page_tokens):
    """The draft row of one pending slot `position` (feature pending[slot][0], reading `token`)
    into its page of `table` [max_pages]: a prefill engine's last prompt slot, once it has
    sampled the token after the prompt.  Returns dpools."""
    feats = dpools["pending"][slot, :1][None]  # [1, 1, D]
    _, dpools = _draft_rows(
        draft,
        embed_vd,
        dpools,
        feats,
        token[None, None],
        position[None, None],
        table[None],
        jnp.ones((1,), jnp.int32),
        cfg=cfg,
        kernels=kernels,
        page_tokens=page_tokens,
        store_tail=True,
    )
    return dpools


@functools.partial(jax.jit, donate_argnames=("dpools",))
def set_pending(dpools, slot, feature):
    """pending[slot][0] = feature [D] (a handed-over request's last prompt slot, or the exact tail
    rule's slot h - 1 from tail_g)."""
    return dict(dpools, pending=dpools["pending"].at[slot, 0].set(feature))


@functools.partial(jax.jit, donate_argnames=("dpools",))
def copy_draft_page(dpools, src, dst):
    """The draft rows of page src into page dst (a private copy for the exact tail rule)."""
    return dict(dpools, pages=dpools["pages"].at[dst].set(dpools["pages"][src]))


def _choose(logits_bv, temperature_b, key_b):
    """Greedy rows take the argmax; sampled rows draw from softmax(logits / T).  Returns
    (tokens int32 [B], probabilities f32 [B, V] the tokens were drawn from (one-hot if greedy))."""
    greedy = temperature_b <= 0
    t = jnp.where(greedy, 1.0, temperature_b)[:, None]
    probs = jax.nn.softmax(logits_bv.astype(jnp.float32) / t, axis=-1)
    drawn = jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(key_b, logits_bv.astype(jnp.float32) / t)
    arg = jnp.argmax(logits_bv, axis=-1)
    tok = jnp.where(greedy, arg, drawn).astype(jnp.int32)
    one_hot = jax.nn.one_hot(arg, logits_bv.shape[-1], dtype=jnp.float32)
    return tok, jnp.where(greedy[:, None], one_hot, probs)


def _draft_body(draft, embed, dpools, rows, *, cfg, kernels, k, page_tokens):
    """Catch-up and chain (see the module docstring) for a batch of `rows` (`_round_body`).
    Returns (dpools, drafts int32 [B, k], draft_probs f32 [B, k, V], keys [B, k + 2, 2])."""
    lengths, active, slots = rows["lengths"], rows["active"], rows["slots"]
    b = lengths.shape[0]
    c = rows["catch_n"]
    pos_c = (lengths - c)[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
    feats = dpools["pending"][slots]
    hidden, dpools = _draft_rows(
        draft,
        embed,
        dpools,
        feats,
        rows["catch_tokens"],
        pos_c,
        rows["draft_tables"],
        c * active,
        cfg=cfg,
        kernels=kernels,
        page_tokens=page_tokens,
        store_tail=True,
    )
    h = hidden[jnp.arange(b), jnp.maximum(c - 1, 0)]  # slot L - 1
    # a round's draws from (the request's 63-bit seed, L): reproducible under preemption and
    # handoffs (a function of the sequence, not of the batch); k draft draws, then the
    # acceptance's uniforms and its resample
    keys = jax.vmap(
        lambda sd, p: jax.random.split(
            jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(sd[0]), sd[1]), p), k + 2
        )
    )(rows["seed"], lengths)
    drafts, qs = [], []
    for s in range(k):
        lg = eagle.draft_logits(draft, cfg, h[:, None])[:, 0]
        d, q = _choose(lg, rows["temperature"], keys[:, s])
        drafts.append(d)
        qs.append(q)
        if s == k - 1:
            break
        pos = (lengths - 1 + s + 1)[:, None]  # slot L - 1 + s + 1 reads (o of the slot before, d_{s+1})
        hidden, dpools = _draft_rows(
            draft,
            embed,
            dpools,
            h[:, None],
            d[:, None],
            pos,
            rows["draft_tables"],
            active,
            cfg=cfg,
            kernels=kernels,
            page_tokens=page_tokens,
            store_tail=False,
        )
        h = hidden[:, 0]
    return dpools, jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), keys


def _verify_body(params, draft, pools, rows, drafts, *, cfg, kernels, taps, k):
    """The target over [t0, d_1 .. d_k] at L .. L + k in one pass (`_round_body`).  Returns (pools,
    logits [B, k + 1, V], exports (per KDA layer a `kimik3.caches.KDAState`: state f32
    [B, k + 1, H, K, V] and conv [B, k + 1, W-1, 3, H*D], the rows after each verified token),
    g f32 [B, k + 1, D])."""
    lengths, active, slots = rows["lengths"], rows["active"], rows["slots"]
    tokens = jnp.concatenate([rows["t0"][:, None], drafts], axis=1)  # [B, k + 1] at L .. L + k
    view = model.paged_view(pools, rows["tables"], slots, lengths)
    positions = lengths[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
    logits, view, exports, vtaps = model.forward_paged(
        params,
        tokens,
        positions,
        view,
        None,
        cfg=verify_config(cfg),
        expert_path="grouped",
        kernels=kernels,
        taps=taps,
        export_at=jnp.arange(1, k + 2, dtype=jnp.int32),
        valid_b=active * (k + 1),
    )
    g = eagle.fuse(draft, vtaps).astype(jnp.float32)
    return model.pools_of(view), logits, exports, g


def _round_body(params, draft, pools, dpools, rows, *, cfg, kernels, taps, k, page_tokens):
    """Catch-up, chain and verify for a batch (see the module docstring).

    rows: {"t0": int32 [B] the last emitted tokens (position L), "lengths": [B] L, "catch_n":
    [B] c, "catch_tokens": [B, k + 1] the tokens x_{i+1} of slots L - c .. (padded), "tables" /
    "draft_tables": [B, max_pages], "slots": [B], "active": [B] 1 or 0 (padding rows: scratch
    slot, null pages), "temperature": f32 [B], "seed": uint32 [B, 2] (`serving.sampling.seed_words`)}.
    Returns (pools, dpools, logits f32 [B, k + 1, V], drafts int32 [B, k], draft_probs f32
    [B, k, V], exports (per KDA layer a `KDAState` [B, k + 1, ...]: `_verify_body`), g f32
    [B, k + 1, D] the verified positions' fused features, keys)."""
    dpools, drafts, qs, keys = _draft_body(
        draft, params["embed_vd"], dpools, rows, cfg=cfg, kernels=kernels, k=k, page_tokens=page_tokens
    )
    pools, logits, exports, g = _verify_body(
        params, draft, pools, rows, drafts, cfg=cfg, kernels=kernels, taps=taps, k=k
    )
    return pools, dpools, logits, drafts, qs, exports, g, keys


def accept_on_device(logits_bkv, drafts_bk, qs_bkv, temperature_b, key_u, key_r):
    """`kimik3.speculative.accept` for a batch, on the device: (a [B] drafts kept, next [B] the
    target's token after them).  Greedy rows (temperature 0) keep d_i while it is the target's
    argmax; sampled rows keep d_i with probability min(1, p(d_i) / q(d_i)) and resample a refused
    one from norm(max(p - q, 0)) (the bonus token from p_k when all k are kept).  key_u / key_r:
    [B, 2] keys of the uniforms and of the resample."""
    b, k = drafts_bk.shape
    greedy = temperature_b <= 0
    choice = jnp.argmax(logits_bkv, axis=-1).astype(jnp.int32)  # [B, k + 1]
    t = jnp.where(greedy, 1.0, temperature_b)[:, None, None]
    p = jax.nn.softmax(logits_bkv.astype(jnp.float32) / t, axis=-1)  # [B, k + 1, V]
    take = lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0]
    p_d, q_d = take(p[:, :k], drafts_bk), take(qs_bkv, drafts_bk)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(key_u)
    ok = jnp.where(greedy[:, None], drafts_bk == choice[:, :k], u * q_d < p_d)
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # the agreeing prefix
    p_a = p[jnp.arange(b), a]  # [B, V]
    q_a = jnp.concatenate([qs_bkv, jnp.zeros_like(qs_bkv[:, :1])], axis=1)[jnp.arange(b), a]  # zero past k
    resid = jnp.maximum(p_a - q_a, 0.0)
    total = resid.sum(-1, keepdims=True)
    resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p_a)
    drawn = jax.vmap(lambda kk, r: jax.random.categorical(kk, jnp.log(r)))(key_r, resid).astype(jnp.int32)
    nxt = jnp.where(greedy, choice[jnp.arange(b), a], drawn)
    return a.astype(jnp.int32), nxt


# the entries of a round's rows that the round itself advances on the device (`advance_rows`)
DEVICE_KEYS = ("t0", "lengths", "catch_n", "catch_tokens")


@functools.partial(
    jax.jit, static_argnames=("cfg", "kernels", "taps", "k", "page_tokens"), donate_argnames=("pools", "dpools", "rows")
)
def spec_step(params, draft, pools, dpools, rows, *, cfg, kernels, taps, k, page_tokens):
    """One whole round in one program: `_round_body`, `accept_on_device`, `_commit_body`.  Returns
    (pools, dpools, rows for the next round (`advance_rows`: the next round can run on them
    before the host has read this one), out int32 [B, k + 2]: row b's kept drafts then its next
    token, then padding, and in the last column a, the drafts kept)."""
    pools, dpools, logits, drafts, qs, exports, g, keys = _round_body(
        params, draft, pools, dpools, rows, cfg=cfg, kernels=kernels, taps=taps, k=k, page_tokens=page_tokens
    )
    a, nxt = accept_on_device(logits, drafts, qs, rows["temperature"], keys[:, k], keys[:, k + 1])
    pools, dpools = _commit_body(pools, dpools, exports, g, rows["slots"], a + 1, cfg=cfg)
    drafts_pad = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    tokens = jnp.where(jnp.arange(k + 1)[None] == a[:, None], nxt[:, None], drafts_pad)
    out = jnp.concatenate([tokens, a[:, None]], axis=1)
    return pools, dpools, _advance(rows, out, k, jnp), out


def _advance(rows, out, k: int, xp):
    """rows after the round that emitted out [B, k + 2] (xp: jnp on the device, np on the host):
    t0 the next token, L + a + 1, and the a + 1 emitted tokens as the next catch-up (padded with
    0, as `catch_up_tokens` pads); padding rows unchanged."""
    a = out[:, k + 1]
    act = rows["active"] > 0
    tokens = out[:, : k + 1]
    emitted = xp.where(xp.arange(k + 1)[None] <= a[:, None], tokens, 0)
    return dict(
        rows,
        t0=xp.where(act, xp.take_along_axis(tokens, a[:, None], axis=1)[:, 0], rows["t0"]),
        lengths=(rows["lengths"] + (a + 1) * rows["active"]).astype(rows["lengths"].dtype),
        catch_n=xp.where(act, a + 1, rows["catch_n"]).astype(rows["catch_n"].dtype),
        catch_tokens=xp.where(act[:, None], emitted, rows["catch_tokens"]).astype(rows["catch_tokens"].dtype),
    )


def advance_rows(rows: dict, out: np.ndarray, k: int) -> dict:
    """The host's copy of what `spec_step` leaves in its rows after emitting `out`."""
    return _advance(rows, out, k, np)


def _commit_body(pools, dpools, exports, g, slots, keep_b, *, cfg):
    """Each KDA layer's state and conv rows of `slots` [B] after their first keep_b [B] (1 .. k + 1)
    verified tokens (`exports`: per KDA layer a `kimik3.caches.KDAState` [B, k + 1, ...], from
    `_round_body`), and g [B, k + 1, D] as the slots' pending features.  Padding rows (keep 1,
    the scratch slot) write scratch only.  Returns (pools, dpools)."""
    num_slots = pools["kda"]["state"].shape[0] // len(exports)
    b = slots.shape[0]
    kda = dict(pools["kda"])
    for i, e in enumerate(exports):
        rows = slots + i * num_slots
        for key, exported in (("state", e.state), ("conv", e.conv)):
            kept = exported[jnp.arange(b), keep_b - 1]
            kda[key] = kda[key].at[rows].set(kept.astype(kda[key].dtype))
    return dict(pools, kda=kda), dict(dpools, pending=dpools["pending"].at[slots].set(g))


def catch_up_tokens(prompt: list[int], output: list[int], lengths: int, catch_n: int, width: int) -> list[int]:
    """x_{i+1} for the catch-up slots L - c .. L - 1 of a request whose tokens are prompt + output
    (position L holds t0), padded to `width`; the k + 1 tokens are sliced, never the whole
    sequence copied (a round's host side stays O(k) per request at any context length)."""
    lo, hi, n = lengths - catch_n + 1, lengths + 1, len(prompt)
    toks = list(prompt[lo : min(hi, n)]) + list(output[max(lo - n, 0) : max(hi - n, 0)])
    return toks + [0] * (width - len(toks))


def prefill_draft_tokens(
    context: list[int], start: int, end: int, from_prev: bool, width: int
) -> tuple[list[int], int]:
    """(the tokens x_{i+1} of `prefill_draft`'s width slots, padded; the slots to write) for the
    chunk [start, end) of `context`."""
    first = start - 1 if from_prev else start
    toks = list(context[first + 1 : end])  # slots first .. end - 2 read x_{first+1} .. x_{end-1}
    return toks + [0] * (width - len(toks)), len(toks)


def draft_fingerprint(draft) -> str:
    """A short hash of a draft's FC and LM head: page blocks holding its rows are keyed by it, so
    an engine with another draft (or none) never reads them."""
    h = hashlib.sha256()
    for name in ("fc_fd", "lm_head_dv"):
        h.update(np.asarray(jnp.asarray(draft[name]).astype(jnp.bfloat16).astype(jnp.float32)).tobytes())
    return h.hexdigest()[:12]
