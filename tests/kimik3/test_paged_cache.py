"""Paged cache: scattered pages and state slots give the contiguous cache's answer,
and a second request resumes from a first request's pages plus a KDA snapshot."""

import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import model, tokenizer

PAGE = 16
# fp32 through 4 layers, paged against contiguous (another gather and summation order): max |diff|
# of logits and cache rows measured over 4 param and prompt seeds 3.5e-6 to 4.2e-5
ATOL = 1e-4


def _tokens(rng, n):
    return rng.integers(0, tokenizer.N_BYTES, size=(1, n)).astype(np.int32)


def _exporting(params, cfg, toks, view, kernels, export_at, **kw):
    """`model.paged_step_jit` over toks [B, T] at the view's next positions: (logits, view after,
    exports per KDA layer)."""
    positions = np.asarray(view["lengths"])[:, None] + np.arange(toks.shape[1], dtype=np.int32)[None]
    return model.paged_step_jit(
        params,
        toks,
        positions,
        view,
        None,
        cfg=cfg,
        expert_path="grouped",
        kernels=kernels,
        export_at=np.asarray(export_at, np.int32),
        **kw,
    )


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_paged_pieces_equal_the_contiguous_cache(rng, tiny_cfg, tiny_params, kernels):
    toks = np.concatenate([_tokens(rng, 70), _tokens(rng, 70)])  # two sequences
    contiguous = model.init_cache(tiny_cfg, 2, 96, jnp.float32)
    pools = model.init_paged_cache(tiny_cfg, num_pages=20, num_slots=5, page_tokens=PAGE, dtype=jnp.float32)
    table = np.array([[7, 2, 19, 4, 11, 3], [5, 13, 1, 8, 16, 9]], np.int32)  # scattered, non-contiguous
    slots = np.array([3, 1], np.int32)
    lengths = np.zeros(2, np.int32)
    for lo, hi in [(0, 40), (40, 41), (41, 70)]:  # chunked prefill, decode, naive continuation
        want, contiguous = model.forward(tiny_params, tiny_cfg, toks[:, lo:hi], cache=contiguous, kernels="reference")
        got, view = model.forward(
            tiny_params, tiny_cfg, toks[:, lo:hi], kernels=kernels, cache=model.paged_view(pools, table, slots, lengths)
        )
        pools, lengths = model.pools_of(view), np.asarray(view["lengths"])
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert lengths.tolist() == [70, 70]


def test_second_request_resumes_from_shared_pages_and_a_kda_snapshot(rng, tiny_cfg, tiny_params):
    prefix, tail_a, tail_b = _tokens(rng, 2 * PAGE), _tokens(rng, 10), _tokens(rng, 12)
    pools = model.init_paged_cache(tiny_cfg, num_pages=12, num_slots=4, page_tokens=PAGE, dtype=jnp.float32)
    table_a = np.array([[3, 6, 9]], np.int32)
    # Request A: the shared prefix (2 full pages), snapshot its KDA state, then its own tail.
    _, view = model.forward(tiny_params, tiny_cfg, prefix, cache=model.paged_view(pools, table_a, [0], [0]))
    snapshot = {
        i: dict(layer) for i, layer in enumerate(model.pool_layers(tiny_cfg, view)) if tiny_cfg.mixer_kind(i) == "kda"
    }
    _, view = model.forward(tiny_params, tiny_cfg, tail_a, cache=model.paged_view(view, table_a, [0], [2 * PAGE]))
    pools = model.pools_of(view)
    # Request B: same prefix pages (shared, read-only), its KDA slot 2 restored from A's snapshot row 0
    # (KDA layer k's slot s is row k * num_slots + s of the pool).
    kda = dict(pools["kda"])
    for k, snap in enumerate(snapshot.values()):
        kda = {key: kda[key].at[k * 4 + 2].set(snap[key][0]) for key in kda}
    table_b = np.array([[3, 6, 1]], np.int32)  # pages 3 and 6 shared with A; page 1 its own
    logits_b, _ = model.forward(
        tiny_params, tiny_cfg, tail_b, cache=model.paged_view(dict(pools, kda=kda), table_b, [2], [2 * PAGE])
    )
    # The oracle for B: its whole prompt with no cache at all.
    want, _ = model.forward(tiny_params, tiny_cfg, np.concatenate([prefix, tail_b], 1))
    np.testing.assert_allclose(logits_b, want[:, 2 * PAGE :], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(logits_b.argmax(-1), want[:, 2 * PAGE :].argmax(-1))


def test_paged_capacity_is_checked(tiny_cfg, tiny_params):
    pools = model.init_paged_cache(tiny_cfg, num_pages=4, num_slots=2, page_tokens=PAGE, dtype=jnp.float32)
    with pytest.raises(ValueError, match="cache capacity=32"):
        model.forward(
            tiny_params, tiny_cfg, np.zeros((1, 33), np.int32), cache=model.paged_view(pools, [[1, 2]], [0], [0])
        )


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_one_pass_exports_every_kda_layer_as_a_replay_leaves_it(rng, tiny_cfg, tiny_params, kernels):
    """`export_at` of a paged pass: the pass returns, per KDA layer, the state and conv rows after
    64 and 128 of its tokens, equal to the slot's entries after a pass over only that prefix
    (states a prefix cache snapshots, without the replay); an entry naming no chunk end is zero."""
    toks = _tokens(rng, 200)
    pools = model.init_paged_cache(tiny_cfg, num_pages=16, num_slots=3, page_tokens=PAGE, dtype=jnp.float32)
    table, slot = [list(range(1, 14)) + [0] * 3], [1]
    _, _, exports = _exporting(
        tiny_params, tiny_cfg, toks, model.paged_view(pools, table, slot, [0]), kernels, [64, 128, 100]
    )
    kda_layers = [i for i, kind in enumerate(tiny_cfg.mixer_kinds) if kind == "kda"]
    assert len(exports) == len(kda_layers)
    assert all(isinstance(exported, model.KDAState) for exported in exports)
    for e, n in enumerate((64, 128)):
        _, replay = model.forward(
            tiny_params, tiny_cfg, toks[:, :n], kernels=kernels, cache=model.paged_view(pools, table, slot, [0])
        )
        for exported, i in zip(exports, kda_layers):
            for key, rows in (("state", exported.state), ("conv", exported.conv)):
                np.testing.assert_allclose(
                    rows[0, e], model.pool_layers(tiny_cfg, replay)[i][key][1], atol=ATOL, rtol=ATOL
                )
    assert all(not np.asarray(rows[0, 2]).any() for exported in exports for rows in (exported.state, exported.conv))


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_a_padded_call_changes_nothing_but_its_real_tokens(rng, tiny_cfg, tiny_params, kernels):
    """valid_b of a paged pass: rows of 70 and 55 real tokens padded with junk ids to one
    96-token call give each row's own unpadded pass: the last real token's logits, the KDA
    state and conv rows, the exports, the latent pages; pad latents land nowhere (pages
    outside the tables stay zero, even where pad positions run past a table)."""
    toks = _tokens(rng, 96).repeat(2, 0)
    toks[1] = _tokens(rng, 96)
    valid = [70, 55]
    tables = np.array([[3, 6, 9, 12, 2], [5, 1, 8, 4, 0]], np.int32)  # row 1: 55 tokens need 4 pages; 0 pads
    tables[1, 4] = 15  # a page past row 1's real tokens: pad writes must not land in it either
    slots = [2, 0]
    pools = model.init_paged_cache(tiny_cfg, num_pages=16, num_slots=3, page_tokens=PAGE, dtype=jnp.float32)
    # the jitted core, as the engine calls it: a padded call may run past a row's table
    positions = np.broadcast_to(np.arange(96, dtype=np.int32), (2, 96))
    got, out, exports = model.paged_step_jit(
        tiny_params,
        toks,
        positions,
        model.paged_view(pools, tables, slots, [0, 0]),
        None,
        cfg=tiny_cfg,
        expert_path="grouped",
        kernels=kernels,
        logits_tail=1,
        export_at=np.asarray([64, -1], np.int32),
        valid_b=np.asarray(valid, np.int32),
    )
    assert np.asarray(out["lengths"]).tolist() == valid
    used = set()
    for b, n in enumerate(valid):
        pages = tables[b, : -(-n // PAGE)]
        used |= set(pages.tolist())
        want, alone, alone_exports = _exporting(
            tiny_params,
            tiny_cfg,
            toks[b : b + 1, :n],
            model.paged_view(pools, tables[b : b + 1], slots[b : b + 1], [0]),
            kernels,
            [64, -1],
        )
        np.testing.assert_allclose(got[b, -1], want[0, -1], atol=ATOL, rtol=0)
        out_layers, alone_layers = model.pool_layers(tiny_cfg, out), model.pool_layers(tiny_cfg, alone)
        for i, kind in enumerate(tiny_cfg.mixer_kinds):
            for key, pool in out_layers[i].items():
                if kind == "kda":
                    np.testing.assert_allclose(pool[slots[b]], alone_layers[i][key][slots[b]], atol=ATOL, rtol=0)
                else:
                    rows = np.asarray(pool[pages]).reshape(-1, pool.shape[-1])[:n]
                    np.testing.assert_allclose(
                        rows, np.asarray(alone_layers[i][key][pages]).reshape(-1, pool.shape[-1])[:n], atol=ATOL, rtol=0
                    )
        for padded, single in zip(exports, alone_exports):
            for got_rows, want_rows in ((padded.state, single.state), (padded.conv, single.conv)):
                np.testing.assert_allclose(got_rows[b], want_rows[0], atol=ATOL, rtol=0)
    for i, kind in enumerate(tiny_cfg.mixer_kinds):
        if kind == "mla":
            pages_i = model.pool_layers(tiny_cfg, out)[i]["pages"]
            untouched = sorted(set(range(16)) - used)
            assert not np.asarray(pages_i[np.array(untouched)]).any()
            for b, n in enumerate(valid):  # the last real page holds nothing past the real tokens
                last = tables[b, (n - 1) // PAGE]
                assert not np.asarray(pages_i[last, n % PAGE or PAGE :]).any()
