"""Paged cache: scattered pages and state slots give the contiguous cache's answer,
and a second request resumes from a first request's pages plus a KDA snapshot."""

import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import model, tokenizer

PAGE = 16
ATOL = 2e-4  # fp32 through 4 layers; see test_model.py


def _tokens(rng, n):
    return rng.integers(0, tokenizer.N_BYTES, size=(1, n)).astype(np.int32)


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
        got, view = model.forward(tiny_params, tiny_cfg, toks[:, lo:hi], kernels=kernels,
                                  cache=model.paged_view(pools, table, slots, lengths))
        pools, lengths = {"layers": view["layers"]}, np.asarray(view["lengths"])
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert lengths.tolist() == [70, 70]


def test_second_request_resumes_from_shared_pages_and_a_kda_snapshot(rng, tiny_cfg, tiny_params):
    prefix, tail_a, tail_b = _tokens(rng, 2 * PAGE), _tokens(rng, 10), _tokens(rng, 12)
    pools = model.init_paged_cache(tiny_cfg, num_pages=12, num_slots=4, page_tokens=PAGE, dtype=jnp.float32)
    table_a = np.array([[3, 6, 9]], np.int32)
    # Request A: the shared prefix (2 full pages), snapshot its KDA state, then its own tail.
    _, view = model.forward(tiny_params, tiny_cfg, prefix, cache=model.paged_view(pools, table_a, [0], [0]))
    snapshot = {i: dict(layer) for i, layer in enumerate(view["layers"]) if tiny_cfg.mixer_kind(i) == "kda"}
    _, view = model.forward(tiny_params, tiny_cfg, tail_a, cache=model.paged_view(view, table_a, [0], [2 * PAGE]))
    pools = {"layers": view["layers"]}
    # Request B: same prefix pages (shared, read-only), its KDA slot 2 restored from A's snapshot row 0.
    layers = list(pools["layers"])
    for i, snap in snapshot.items():
        layers[i] = {k: layers[i][k].at[2].set(snap[k][0]) for k in layers[i]}
    table_b = np.array([[3, 6, 1]], np.int32)  # pages 3 and 6 shared with A; page 1 its own
    logits_b, _ = model.forward(tiny_params, tiny_cfg, tail_b,
                                cache=model.paged_view({"layers": tuple(layers)}, table_b, [2], [2 * PAGE]))
    # The oracle for B: its whole prompt with no cache at all.
    want, _ = model.forward(tiny_params, tiny_cfg, np.concatenate([prefix, tail_b], 1))
    np.testing.assert_allclose(logits_b, want[:, 2 * PAGE:], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(logits_b.argmax(-1), want[:, 2 * PAGE:].argmax(-1))


def test_paged_capacity_is_checked(tiny_cfg, tiny_params):
    pools = model.init_paged_cache(tiny_cfg, num_pages=4, num_slots=2, page_tokens=PAGE, dtype=jnp.float32)
    with pytest.raises(ValueError, match="cache capacity=32"):
        model.forward(tiny_params, tiny_cfg, np.zeros((1, 33), np.int32),
                      cache=model.paged_view(pools, [[1, 2]], [0], [0]))


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_one_pass_exports_every_kda_layer_as_a_replay_leaves_it(rng, tiny_cfg, tiny_params, kernels):
    """`export_at` on a paged view: the pass returns, per KDA layer, the state and conv rows after
    64 and 128 of its tokens, equal to the slot's entries after a pass over only that prefix
    (states a prefix cache snapshots, without the replay); an entry naming no chunk end is zero."""
    toks = _tokens(rng, 200)
    pools = model.init_paged_cache(tiny_cfg, num_pages=16, num_slots=3, page_tokens=PAGE, dtype=jnp.float32)
    table, slot = [list(range(1, 14)) + [0] * 3], [1]
    _, out = model.forward(tiny_params, tiny_cfg, toks, kernels=kernels,
                           cache=model.paged_view(pools, table, slot, [0], export_at=[64, 128, 100]))
    kda_layers = [i for i, kind in enumerate(tiny_cfg.mixer_kinds) if kind == "kda"]
    assert len(out["exports"]) == len(kda_layers)
    for e, n in enumerate((64, 128)):
        _, replay = model.forward(tiny_params, tiny_cfg, toks[:, :n], kernels=kernels,
                                  cache=model.paged_view(pools, table, slot, [0]))
        for exported, i in zip(out["exports"], kda_layers):
            for key, rows in exported.items():
                np.testing.assert_allclose(rows[0, e], replay["layers"][i][key][1], atol=ATOL, rtol=ATOL)
    assert all(not np.asarray(rows[0, 2]).any() for exported in out["exports"] for rows in exported.values())
