"""The serving engine under DP decode with pools owned per rank (issue 23): every rank keeps its
requests' pages, KDA slots and snapshots on its own device (`sharding.rank_pools`), prefills
them there, and the decode mesh's step runs each rank on its own pool (`sharding.decode.PagedDecode`).
Multi-turn sessions with prefix hits, preemption with host-tier offload, and host-tier hits
after eviction give the no-cache fp32 oracle's greedy tokens on dp/ep = (2, 2), (4, 2), (8, 8).

Each rank has 8 usable pages of 16 tokens and 2 slots: two 60-token prompts fill a rank, and
growing past 64 tokens preempts one of them."""

import jax
import numpy as np
import pytest

from cache.host_tier import EmbeddedHostKVTier
from kimik3.generate import generate
from serving.engine import Engine
from sharding import paged, rank_pools
from sharding.mesh import decode_mesh
from tests.sharding.conftest import host_init

PAGE = 16
_ORACLE = {}


@pytest.fixture(scope="module")
def params(tiny_cfg):
    return host_init(tiny_cfg, seed=3)


def _oracle(params, cfg, prompt, n):
    key = (tuple(prompt), n)
    if key not in _ORACLE:
        _ORACLE[key] = generate(params, cfg, prompt, n).tokens.tolist()
    return _ORACLE[key]


def _prompt(kind: str, i: int, n: int) -> list[int]:
    """The same prompts for every mesh (the oracle's results are shared)."""
    return np.random.default_rng([ord(kind), i]).integers(0, 256, n).tolist()


@pytest.fixture(scope="module", params=[(2, 2), (4, 2), (8, 8)], ids=lambda c: f"dp{c[0]}-ep{c[1]}")
def served(request, tiny_cfg, params, devices):
    dp, ep = request.param
    mesh = decode_mesh(dp, ep, devices=devices[:dp], cfg=tiny_cfg)
    helpers = paged.helper_programs()
    eng = Engine(params, tiny_cfg, mesh=(None, mesh), num_slots=2 * dp, num_pages=9 * dp, num_snapshots=6 * dp,
                 page_tokens=PAGE, kda_block_tokens=4 * PAGE, max_pages_per_request=8, prefill_chunk_tokens=32,
                 max_step_tokens=32 + 2 * dp, kernels="reference", dispatch="dense",
                 host=EmbeddedHostKVTier(1 << 26))
    log = {"dp": dp, "mesh": mesh}
    # A: one session per rank; its second turn returns to its rank, for the prefix hit there
    first = [eng.submit(_prompt("a", i, 37), 5) for i in range(dp)]
    eng.run(max_steps=200)
    second = [eng.submit(r.prompt + r.output + _prompt("b", i, 8), 5) for i, r in enumerate(first)]
    eng.run(max_steps=200)
    log["sessions"] = list(zip(first, second))
    # B: two 60-token prompts per rank, each growing past its 4 pages: preemption, offload, resume
    grown = [eng.submit(_prompt("c", i, 60), 8) for i in range(2 * dp)]
    eng.run(max_steps=500)
    log["grown"], log["preemptions"], log["offloaded"] = grown, eng.preemptions, eng.offloaded_resumes
    # C: session 0's third turn, its pages evicted from every rank by B: from the host tier
    third = eng.submit(second[0].prompt + second[0].output + _prompt("d", 0, 6), 4)
    eng.run(max_steps=200)
    log["third"] = third
    log["helpers"] = paged.helper_programs() - helpers
    log["engine"] = eng
    return log


def _check(req, params, cfg):
    assert req.done and req.error is None, (req.request_id, req.error)
    assert req.output == _oracle(params, cfg, req.prompt, req.max_new_tokens), req.request_id


def test_sessions_spread_over_the_ranks_and_return_to_them_for_their_prefix(served, params, tiny_cfg):
    sessions = served["sessions"]
    assert sorted(a._rank for a, _ in sessions) == list(range(served["dp"]))  # one per rank
    for a, b in sessions:
        _check(a, params, tiny_cfg)
        _check(b, params, tiny_cfg)
        assert b._rank == a._rank and b.cached_tokens >= 2 * PAGE and b.cached_tokens_host == 0


def test_preemption_within_a_rank_offloads_and_resumes_with_the_oracles_tokens(served, params, tiny_cfg):
    assert served["preemptions"] >= served["dp"]  # every rank had to preempt
    assert served["offloaded"] == served["preemptions"]  # and resumed from the host tier, no recompute
    for r in served["grown"]:
        _check(r, params, tiny_cfg)


def test_an_evicted_session_resumes_from_the_host_tier_on_any_rank(served, params, tiny_cfg):
    third = served["third"]
    _check(third, params, tiny_cfg)
    assert third.cached_tokens_host > 0


def test_no_step_gathers_pool_rows_and_every_pool_stays_on_its_rank(served):
    eng = served["engine"]
    assert served["helpers"] == 0  # the gather / write-back programs of `sharding.paged` never compiled
    assert eng._decode_step.programs() >= 1
    for kv, device in zip(eng.kvs, rank_pools.rank_devices(served["mesh"])):
        for leaf in jax.tree_util.tree_leaves(kv.pools) + [kv.snapshots.data]:
            assert leaf.devices() == {device}
    assert not any(m.requests for m in eng.managers)  # all KV released
    assert eng.load()["free_slots"] == 2 * served["dp"]


@pytest.mark.slow  # the GPU benchmark's driver (`python -m sharding.bench --engine`); the engines it builds are tested above
def test_the_scaling_bench_times_one_device_against_the_mesh_with_the_same_requests_per_device(devices):
    from sharding.bench import engine_scaling

    out = engine_scaling(2, "tiny", 2, 20, 3, "reference", page_tokens=PAGE, dtype="float32", devices=devices[:2])
    assert out["1gpu"]["requests"] == 2 and out["2gpu"]["requests"] == 4
    assert out["1gpu"]["tokens"] == 2 * 3 and out["2gpu"]["tokens"] == 4 * 3  # one token per request per step
    assert out["tok_s_per_gpu_2gpu"] == out["2gpu"]["tok_s"] / 2
    assert out["scaling_efficiency"] == out["speedup"] / 2 > 0


def test_rows_that_need_their_logits_beside_greedy_rows_on_the_mesh(tiny_cfg, params, devices):
    """Greedy rows take the devices' argmax; a penalized row and a logprobs row in the same steps
    get their logits and the oracle's numbers."""
    from serving.sampling import SamplingParams
    from tests.serving.test_engine_logprobs import _log_softmax, penalized_greedy

    mesh = decode_mesh(2, 2, devices=devices[:2], cfg=tiny_cfg)
    eng = Engine(params, tiny_cfg, mesh=(None, mesh), num_slots=4, num_pages=18, num_snapshots=12, page_tokens=PAGE,
                 kda_block_tokens=4 * PAGE, max_pages_per_request=8, prefill_chunk_tokens=32, max_step_tokens=40,
                 kernels="reference", dispatch="dense")
    prompts = [_prompt("s", i, 30) for i in range(3)]
    sps = [SamplingParams(), SamplingParams(frequency_penalty=1.5), SamplingParams(logprobs=2)]
    reqs = [eng.submit(p, 8, sampling=sp) for p, sp in zip(prompts, sps)]
    eng.run(max_steps=100)
    assert reqs[0].output == _oracle(params, tiny_cfg, prompts[0], 8)
    assert reqs[1].output == generate(params, tiny_cfg, prompts[1], 8, choose=penalized_greedy(0.0, 1.5)).tokens.tolist()
    want = generate(params, tiny_cfg, prompts[2], 8)
    assert reqs[2].output == want.tokens.tolist()
    for tok, entry, logits in zip(reqs[2].output, reqs[2].logprobs, want.logits):
        assert entry.logprob == pytest.approx(_log_softmax(logits)[tok], abs=1e-4)
