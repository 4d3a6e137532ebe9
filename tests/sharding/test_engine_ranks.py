"""The serving engine under DP decode with pools owned per rank: every rank keeps its
requests' pages, KDA slots and snapshots on its own device (`sharding.rank_pools`), prefills
them there, and the decode mesh's step runs each rank on its own pool (`sharding.decode.PagedDecode`).
Multi-turn sessions with prefix hits, preemption with host-tier offload, and host-tier hits
after eviction give the no-cache fp32 oracle's greedy tokens on dp/ep = (2, 2), (4, 2), (8, 8)
(and its penalized tokens and logprobs for the rows that ask for them).

Each rank has 8 usable pages of 16 tokens and 2 slots: two 60-token prompts fill a rank, and
growing past 64 tokens preempts one of them."""

import jax
import numpy as np
import pytest

from cache.host_tier import EmbeddedHostKVTier
from harness.scaling_bench import engine_scaling
from kimik3.generate import generate
from serving.engine import Engine
from serving.sampling import GREEDY, SamplingParams
from sharding import paged, rank_pools
from sharding.mesh import decode_mesh
from tests.serving.test_engine_logprobs import _log_softmax, penalized_greedy
from tests.sharding.conftest import host_init

PAGE = 16
_ORACLE = {}
# negative penalties: the output repeats itself (a random model rarely repeats within 5 tokens)
PENALIZED, LOGPROBS = SamplingParams(presence_penalty=-2.0, frequency_penalty=-1.5), SamplingParams(logprobs=2)


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
    eng = Engine(
        params,
        tiny_cfg,
        mesh=(None, mesh),
        num_slots=2 * dp,
        num_pages=9 * dp,
        num_snapshots=6 * dp,
        page_tokens=PAGE,
        kda_block_tokens=4 * PAGE,
        max_pages_per_request=8,
        prefill_chunk_tokens=32,
        max_step_tokens=32 + 2 * dp,
        kernels="reference",
        dispatch="dense",
        host=EmbeddedHostKVTier(1 << 26),
    )
    log = {"dp": dp, "mesh": mesh}
    # A: one session per rank; its second turn returns to its rank, for the prefix hit there.  Some
    # rows need their logits (a frequency penalty, logprobs) beside rows the devices' argmax serves.
    first = [eng.submit(_prompt("a", i, 37), 5, sampling=PENALIZED if i % 2 else GREEDY) for i in range(dp)]
    eng.run(max_steps=200)
    second = [
        eng.submit(r.prompt + r.output + _prompt("b", i, 8), 5, sampling=LOGPROBS if i == 0 else GREEDY)
        for i, r in enumerate(first)
    ]
    eng.run(max_steps=200)
    log["sessions"] = list(zip(first, second))
    # B: two 60-token prompts per rank, each growing past its 4 pages: preemption, offload, resume
    grown = [eng.submit(_prompt("c", i, 60), 8) for i in range(2 * dp)]
    eng.run(max_steps=500)
    log["grown"], log["preemptions"], log["offloaded"] = grown, eng.preemptions, eng.offloaded_resumes
    # C: the first session's third turn, its pages evicted from every rank by B: from the host tier
    third = eng.submit(second[0].prompt + second[0].output + _prompt("d", 0, 6), 4)
    eng.run(max_steps=200)
    log["third"] = third
    log["helpers"] = paged.helper_programs() - helpers
    log["decode_programs"] = eng._decode_step.programs()  # now: a later test may follow a cache clear
    log["engine"] = eng
    return log


def _check(req, params, cfg):
    """The request's tokens are the oracle's under its own rule (a penalty: vLLM's, written out on
    the host), and its logprobs, if it asked, the oracle's log-softmax."""
    assert req.done and req.error is None, (req.request_id, req.error)
    sp = req.sampling
    if sp.penalized:
        want = generate(
            params,
            cfg,
            req.prompt,
            req.max_new_tokens,
            choose=penalized_greedy(sp.presence_penalty, sp.frequency_penalty),
        ).tokens.tolist()
        assert want != _oracle(params, cfg, req.prompt, req.max_new_tokens)  # the penalty changed them
        assert req.output == want, req.request_id
        return
    assert req.output == _oracle(params, cfg, req.prompt, req.max_new_tokens), req.request_id
    if sp.logprobs is not None:
        logits = generate(params, cfg, req.prompt, req.max_new_tokens).logits
        for tok, entry, row in zip(req.output, req.logprobs, logits):
            assert entry.logprob == pytest.approx(_log_softmax(row)[tok], abs=1e-4)


def test_sessions_spread_over_the_ranks_and_return_to_them_for_their_prefix(served, params, tiny_cfg):
    sessions = served["sessions"]
    assert sorted(a.rank for a, _ in sessions) == list(range(served["dp"]))  # one per rank
    for a, b in sessions:
        _check(a, params, tiny_cfg)
        _check(b, params, tiny_cfg)
        assert b.rank == a.rank and b.cached_tokens >= 2 * PAGE and b.cached_tokens_host == 0


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
    assert served["decode_programs"] >= 1
    for kv, device in zip(eng.kvs, rank_pools.rank_devices(served["mesh"])):
        for leaf in jax.tree_util.tree_leaves(kv.pools) + [kv.snapshots.data]:
            assert leaf.devices() == {device}
    assert not any(m.requests for m in eng.managers)  # all KV released
    assert eng.load()["free_slots"] == 2 * served["dp"]


@pytest.mark.slow  # the GPU benchmark's driver (`python -m harness.scaling_bench`); the engines it builds are tested above
def test_the_scaling_bench_times_one_device_against_the_mesh_with_the_same_requests_per_device(devices):
    out = engine_scaling(2, "tiny", 2, 20, 3, "reference", page_tokens=PAGE, dtype="float32", devices=devices[:2])
    assert out["1gpu"]["requests"] == 2 and out["2gpu"]["requests"] == 4
    assert out["1gpu"]["tokens"] == 2 * 3 and out["2gpu"]["tokens"] == 4 * 3  # one token per request per step
    assert out["tok_s_per_gpu_2gpu"] == out["2gpu"]["tok_s"] / 2
    assert out["scaling_efficiency"] == out["speedup"] / 2 > 0
