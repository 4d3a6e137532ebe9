"""EAGLE-3 speculative decoding in the serving engine: the draft's paged KV and the round.

The draft head (`kimik3.eagle`) keeps its MLA latent rows in a pool of its own, indexed by the
target's page ids (a request's draft rows live on its target block table; a prefix hit that
shares the target's pages shares the draft rows written with them, and `serving.kv_pools`'s
page blocks carry both to the host tier).  Draft slot i reads (g_i, x_{i+1}): the fused target
taps at position i and the token after it, so slot i can be written only once x_{i+1} is
known.  Per running request (its KDA slot) the engine keeps the fused features of the slots
not written yet, `pending` [k + 1, D], and how many there are (1 .. k + 1).

A decode round for a batch is one program (`spec_step`), from L committed tokens and t0 (the
last emitted token, at position L)::

    catch-up   the pending slots L - c .. L - 1 on the target's features: draft rows final
    chain      d_1 from slot L - 1, then slots L .. L + k - 2 on the draft's own hidden states
               (rows overwritten by the next catch-up)
    verify     the target over [t0, d_1 .. d_k] at L .. L + k in one pass: KDA at one token a
               chunk, exporting its state after each token; MLA rows written; logits [B, k + 1, V]

    accept     `accept_on_device`: `kimik3.speculative.accept`'s rule (greedy, or rejection
               sampling, so every emitted token is distributed as the target's)
    commit     each KDA layer's state and conv rows after the a + 1 kept tokens into the slot,
               the kept positions' features as the next round's pending ones

    advance    the round's own rows for the next one (t0, L + a + 1, the emitted tokens as the next
               catch-up: `advance_rows`), so the engine dispatches round n + 1 on them before the
               host reads round n (`SpecDecoder.dispatch` / `resolve`, as the plain engine chains
               its decode steps); the host writes rows only where they changed (a new page, a
               request joining or leaving)

and the host reads the kept tokens and a (B x (k + 2) int32), its one wait per round, while the
next round runs.  MLA rows past the new length are never read (each lies after every later
query and is overwritten by the next verify).  The verify pass's KDA is the recurrent kernel on
the state pool by slot, exporting every token's state (`kimik3.ops.kda` at chunk size 1).

Prefill chunks tap the target too (`kimik3.model.paged_step(..., taps=...)`): after each chunk
the draft writes the rows of slots start - 1 .. end - 2 and keeps slot end - 1 pending
(`prefill_draft`).  After a prefix hit of h tokens (`tail` rule, `TAIL_MODES`): "drop" (the
manager's hit excludes the last matched page: its draft rows are recomputed with the target
over it), "no_drop" (the matched draft rows are kept, the tail slot h - 1 as it was written:
for another continuation it may be stale, which costs acceptance, never tokens), "exact" (the
page is kept and only slot h - 1 is recomputed, from the fused feature every page keeps of its
last slot (`tail_g`), into a private copy of the page's draft rows).  Drop does not shut out
staleness entirely (nor does vLLM's rule): the page it keeps last ends on a slot that reads the
first token of the dropped page, and that slot was written by whichever request published the
kept page, whose next page may have differed.  Only "exact" recomputes the slot a hit ends on.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_pool import NoFreeBlocks
from kimik3 import eagle, model
from kimik3.caches import MLAPages
from kimik3.config import ModelConfig
from serving.model_runner import _overwrite, refresh_rows
from serving.sampling import seed_words

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


@dataclasses.dataclass
class SpecStats:
    rounds: int = 0  # verify passes (per request row)
    drafted: int = 0
    kept: int = 0
    chained: int = 0  # batched rounds dispatched before the round before them was read
    # host seconds of each batched round (the latest; a long-running server keeps no more)
    round_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=4096))

    @property
    def acceptance(self) -> float:
        return self.kept / self.drafted if self.drafted else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify pass (kept drafts + the target's own)."""
        return (self.kept + self.rounds) / self.rounds if self.rounds else 0.0


class SpecDecoder:
    """The engine's speculative decoding: the draft, its pools' bookkeeping, and the round (see
    the module docstring).  The engine calls `on_admit` after a request's slot is restored,
    `after_chunk` after each prefill chunk, and `decode` for the decode rows of a step."""

    def __init__(
        self, draft, ecfg: eagle.EagleConfig, cfg: ModelConfig, *, k: int, tail: str, kernels: str, page_tokens: int
    ):
        from kimik3 import speculative

        speculative.check_draft(cfg, ecfg, draft, k)
        if tail not in TAIL_MODES:
            raise ValueError(f"eagle_tail must be one of {TAIL_MODES}; got {tail!r}")
        self.draft = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), draft)
        self.ecfg, self.cfg, self.k, self.tail, self.kernels = ecfg, cfg, k, tail, kernels
        self.page_tokens = page_tokens
        self.taps = tuple(ecfg.taps)
        self.fingerprint = draft_fingerprint(draft)
        self.stats = SpecStats()
        # per decode bucket: the rows on the device, what the host knows they hold (None for the
        # entries a round in flight is advancing), and the id of the latest round dispatched on them
        self._io: dict[int, dict] = {}
        self._held: dict[int, dict | None] = {}
        self._last: dict[int, int] = {}
        self._dispatched = 0
        self._resolved_s = None  # when the latest round was read (chained rounds' period)
        self.overwrites = 0  # rounds whose rows had to be (partly) written from the host

    def _mark_tails(self, kv, table: list[int], first: int, count: int) -> None:
        """Slots first .. first + count - 1 were written on target features: the pages they end
        now hold their tail feature (`KVPools.tail_known`)."""
        p = self.page_tokens
        for end in range(-(-(first + 1) // p) * p, first + count + 1, p):  # slot end - 1 ends a page
            kv.tail_known[table[(end - 1) // p]] = True

    def programs(self) -> int:
        """Compiled speculative programs so far (rounds per bucket, prefill drafting per chunk length)."""
        return sum(f._cache_size() for f in (spec_step, prefill_draft, write_slot, set_pending, copy_draft_page))

    def warmup(self, eng) -> int:
        """Compile and run once, on scratch rows, the round of every decode bucket and the
        drafting of every prefill chunk length.  Returns the number of new programs."""
        from cache.block_pool import NULL_BLOCK

        before = self.programs()
        # a P/D prefill engine never decodes: no rounds to compile
        buckets = (
            []
            if eng.role == "prefill"
            else sorted({eng.runner.decode_bucket(n) for n in range(1, eng.scratch_slot + 1)})
        )
        for bucket in buckets:
            rows = self._rows(eng, [], bucket)
            eng.kv.pools, eng.kv.dpools, io, out = spec_step(
                eng.params,
                self.draft,
                eng.kv.pools,
                eng.kv.dpools,
                self._place(eng, rows),
                cfg=self.cfg,
                kernels=self.kernels,
                taps=self.taps,
                k=self.k,
                page_tokens=self.page_tokens,
            )
            # the two writes `_buffers` makes (a chained round's entries, every entry); the
            # buffers are left holding `rows`
            io = _overwrite(io, self._place(eng, {key: v for key, v in rows.items() if key not in DEVICE_KEYS}))
            self._io[bucket], self._held[bucket] = _overwrite(io, self._place(eng, rows)), rows
            jax.block_until_ready(self._io[bucket])
        null = jnp.full((eng.max_pages,), NULL_BLOCK, jnp.int32)
        for t, step in eng.runner.prefill_lengths():
            if step is None:
                taps = jax.device_put(
                    jnp.zeros((1, t, len(self.taps), self.cfg.d_model), eng.dtype),
                    eng.kv.dpools["pending"].devices().pop(),
                )  # committed, as a chunk's are
                eng.kv.dpools = prefill_draft(
                    self.draft,
                    eng.params["embed_vd"],
                    eng.kv.dpools,
                    taps,
                    jnp.zeros((1, t), jnp.int32),
                    jnp.int32(0),
                    jnp.int32(0),
                    jnp.bool_(False),
                    jnp.int32(eng.scratch_slot),
                    null,
                    cfg=self.cfg,
                    kernels=self.kernels,
                    page_tokens=self.page_tokens,
                )
        scratch, page = jnp.int32(eng.scratch_slot), jnp.int32(NULL_BLOCK)  # the exact rule's and adopt's moves
        if eng.role == "prefill":  # its last prompt slots (`write_last_slot`)
            eng.kv.dpools = write_slot(
                self.draft,
                eng.params["embed_vd"],
                eng.kv.dpools,
                scratch,
                jnp.int32(0),
                jnp.int32(0),
                null,
                cfg=self.cfg,
                kernels=self.kernels,
                page_tokens=self.page_tokens,
            )
        eng.kv.dpools = copy_draft_page(eng.kv.dpools, page, page)
        eng.kv.dpools = set_pending(eng.kv.dpools, scratch, jnp.zeros((self.cfg.d_model,), jnp.float32))
        jax.block_until_ready(eng.kv.dpools["pending"])
        return self.programs() - before

    # ---- admission ---------------------------------------------------------------------------
    def on_admit(self, eng, req, blocks) -> None:
        """A request's slot was restored after a prefix hit of blocks.hit.tokens (h): with the
        "exact" rule the tail slot h - 1 is recomputed into a private copy of its page's draft rows."""
        req.draft_pending, req.draft_table, req.tail_recomputed = 0, None, False
        h = blocks.hit.tokens
        if h == 0 or self.tail != "exact":
            return
        idx = h // self.page_tokens - 1
        shared = blocks.page_table[idx]
        if not eng.kv.tail_known[shared]:
            return  # its feature did not travel with the page: kept as written (as no_drop)
        try:
            (private,) = eng.manager.page_pool.allocate(1)
        except NoFreeBlocks:  # no free page: kept as written
            return
        req.extra_pages.append(private)
        eng.kv.dpools = copy_draft_page(eng.kv.dpools, jnp.int32(shared), jnp.int32(private))
        eng.kv.dpools = set_pending(eng.kv.dpools, jnp.int32(req.slot), eng.kv.dpools["tail_g"][shared])
        table = list(blocks.page_table)
        table[idx] = private
        req.draft_table = table
        req.draft_pending, req.tail_recomputed = 1, True

    def adopted(self, eng, req, feature) -> None:
        """A handed-over request (`Engine.adopt`): its pages carry the draft's rows of slots
        0 .. n - 2; slot n - 1 waits on `feature` and the first token."""
        req.draft_table, req.tail_recomputed = None, False
        eng.kv.dpools = set_pending(eng.kv.dpools, jnp.int32(req.slot), jnp.asarray(feature, jnp.float32))
        req.draft_pending = 1

    def draft_table(self, eng, req) -> list[int]:
        table = eng.table_of(req)
        if req.draft_table is not None:
            table[: len(req.draft_table)] = req.draft_table
        return table

    # ---- prefill -----------------------------------------------------------------------------
    def after_chunk(self, eng, req, start: int, end: int, taps) -> None:
        """The draft rows of a prefill chunk [start, end) of req.context (taps [1, T, 3, D])."""
        from_prev = req.draft_pending > 0
        toks, count = prefill_draft_tokens(req.context, start, end, from_prev, taps.shape[1])
        table = self.draft_table(eng, req)
        p = self.page_tokens
        eng.kv.tail_known[np.asarray(table[start // p : -(-end // p)], np.int64)] = False  # written anew here
        eng.kv.dpools = prefill_draft(
            self.draft,
            eng.params["embed_vd"],
            eng.kv.dpools,
            taps,
            jnp.asarray([toks], jnp.int32),
            jnp.int32(start),
            jnp.int32(end - start),
            jnp.bool_(from_prev),
            jnp.int32(req.slot),
            jnp.asarray(table, jnp.int32),
            cfg=self.cfg,
            kernels=self.kernels,
            page_tokens=self.page_tokens,
        )
        self._mark_tails(eng.kv, table, start - 1 if from_prev else start, count)
        req.draft_pending = 1

    def write_last_slot(self, eng, req, token: int) -> None:
        """A prefill engine's request, prefilled: its last prompt slot n - 1 waits on the token after
        the prompt, which the engine has now sampled.  A decode engine writes that slot in its
        first round; a prefill engine decodes nothing, so it writes it here: its prefix cache
        then holds the page whole (a later hit there reads a written row, and the exact rule
        finds the page's tail feature)."""
        n = len(req.context)
        if n % self.page_tokens:
            return  # the slot lies in a partial page, which no prefix hit can reach
        table = self.draft_table(eng, req)
        eng.kv.dpools = write_slot(
            self.draft,
            eng.params["embed_vd"],
            eng.kv.dpools,
            jnp.int32(req.slot),
            jnp.int32(n - 1),
            jnp.int32(token),
            jnp.asarray(table, jnp.int32),
            cfg=self.cfg,
            kernels=self.kernels,
            page_tokens=self.page_tokens,
        )
        self._mark_tails(eng.kv, table, n - 1, 1)

    # ---- decode ------------------------------------------------------------------------------
    def _rows(self, eng, reqs, bucket: int) -> dict:
        """A round's inputs for `reqs`, padded to `bucket` rows (scratch slot, null pages, inactive)."""
        from cache.block_pool import NULL_BLOCK

        k, pad = self.k, bucket - len(reqs)
        null = [NULL_BLOCK] * eng.max_pages
        return {
            "t0": np.asarray([r.output[-1] for r in reqs] + [0] * pad, np.int32),
            "lengths": np.asarray([r.kv_len for r in reqs] + [1] * pad, np.int32),
            "catch_n": np.asarray([r.draft_pending for r in reqs] + [1] * pad, np.int32),
            "catch_tokens": np.asarray(
                [catch_up_tokens(r.prompt, r.output, r.kv_len, r.draft_pending, k + 1) for r in reqs]
                + [[0] * (k + 1)] * pad,
                np.int32,
            ),
            "tables": np.asarray([eng.table_of(r) for r in reqs] + [null] * pad, np.int32),
            "draft_tables": np.asarray([self.draft_table(eng, r) for r in reqs] + [null] * pad, np.int32),
            "slots": np.asarray([r.slot for r in reqs] + [eng.scratch_slot] * pad, np.int32),
            "active": np.asarray([1] * len(reqs) + [0] * pad, np.int32),
            "temperature": np.asarray([r.sampling.temperature for r in reqs] + [0.0] * pad, np.float32),
            "seed": np.asarray([seed_words(r.sampling.seed) for r in reqs] + [(0, 0)] * pad, np.uint32),
        }

    @staticmethod
    def _place(eng, rows: dict) -> dict:
        """rows on the pools' device (speculation runs on one), committed as every later round's
        rows are: one program per bucket, not one per placement."""
        return jax.device_put(rows, next(iter(eng.kv.dpools["pending"].devices())))

    def _buffers(self, eng, rows: dict, chained: bool) -> dict:
        """The bucket's rows on the device; where any entry of `rows` differs from what they hold,
        the whole group is written in (chained: all but the device-advanced entries, which the
        round in flight leaves)."""
        bucket = len(rows["slots"])
        io, held = self._io.pop(bucket, None), self._held.get(bucket)
        if chained and io is None:
            raise RuntimeError(f"no earlier round of bucket {bucket} to chain on")
        if io is None:
            self.overwrites += 1
            return self._place(eng, rows)
        keys = [key for key in rows if not (chained and key in DEVICE_KEYS)]
        io, wrote = refresh_rows(io, held, rows, keys, place=lambda v: self._place(eng, v))
        self.overwrites += wrote
        return io

    def dispatch(self, eng, reqs, chained: bool = False):
        """Enqueue one verify round for `reqs` (pages extended for it: by the scheduler, or for a
        chained round by `Scheduler.chain_plan`) without waiting; chained: on the rows the round
        in flight leaves on the device (its tokens not read yet).  Returns the in-flight record
        for `resolve`."""
        rows = self._rows(eng, reqs, eng.runner.decode_bucket(len(reqs)))
        if chained:
            rows = dict(rows, **{key: None for key in DEVICE_KEYS})  # filled when the round before is read
        io = self._buffers(eng, rows, chained)
        eng.kv.pools, eng.kv.dpools, io, out = spec_step(
            eng.params,
            self.draft,
            eng.kv.pools,
            eng.kv.dpools,
            io,
            cfg=self.cfg,
            kernels=self.kernels,
            taps=self.taps,
            k=self.k,
            page_tokens=self.page_tokens,
        )
        bucket = len(rows["slots"])
        self._dispatched += 1
        self.stats.chained += int(chained)
        # the round advances DEVICE_KEYS: unknown until it is read
        self._io[bucket], self._last[bucket] = io, self._dispatched
        self._held[bucket] = dict(rows, **{key: None for key in DEVICE_KEYS})
        return {
            "reqs": list(reqs),
            "rows": rows,
            "out": out,
            "id": self._dispatched,
            "chained": chained,
            "t": time.perf_counter(),
        }

    def resolve(self, eng, rnd: dict, successor: dict | None = None, mixed: bool = False) -> list[tuple]:
        """Read a dispatched round (its one wait on the device): each request's kept drafts and the
        target's next token, as (request, token, mixed, None) in order (`StepOutput.tokens`: the
        scheduler drops those after a request's end); successor: the round chained on it, whose
        device-advanced rows this one's tokens determine.  Requests that ended since (EOS,
        cancellation) get none."""
        k, rows = self.k, rnd["rows"]
        out = np.asarray(rnd["out"])
        now = time.perf_counter()
        after = advance_rows(rows, out, k)
        if successor is not None:
            successor["rows"].update({key: after[key] for key in DEVICE_KEYS})
        if self._last.get(len(rows["slots"])) == rnd["id"]:
            self._held[len(rows["slots"])] = after
        keep = out[:, k + 1] + 1
        emitted = []
        for i, r in enumerate(rnd["reqs"]):
            if r.done or r not in eng.running:
                continue
            self._mark_tails(eng.kv, self.draft_table(eng, r), r.kv_len - r.draft_pending, r.draft_pending)
            r.kv_len += int(keep[i])
            r.draft_pending = int(keep[i])
            r.accepted.append(int(keep[i]) - 1)
            self.stats.rounds += 1
            self.stats.drafted += k
            self.stats.kept += int(keep[i]) - 1
            emitted += [(r, int(tok), mixed, None) for tok in out[i, : keep[i]].tolist()]
        # a chained round's period is the time between reads; a lone round's, dispatch to read
        start = self._resolved_s if rnd["chained"] and self._resolved_s is not None else rnd["t"]
        self.stats.round_s.append(now - start)
        self._resolved_s = now
        return emitted
