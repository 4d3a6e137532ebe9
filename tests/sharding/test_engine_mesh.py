"""The serving engine on device meshes (`Engine(mesh=...)`) gives the oracle's greedy tokens:
colocated (prefill tp2/ep2, decode dp2/ep2), P/D across two meshes, and a prefix-hit second turn.

Compiles dominate on CPU, so the prompt lengths are chosen to need few step shapes: sharded
prefill chunks of 16 and 4 tokens (tp * 2^k), the last token of each prompt unsharded (the
remainder below tp), and decode buckets of 2 and 4 rows.  All engines with the prefill mesh
share one compiled `ShardedPrefill` (`sharding.paged.sharded_step`)."""

import numpy as np
import pytest

from kimik3.generate import generate
from serving.engine import Engine
from sharding.mesh import decode_mesh, prefill_mesh
from tests.sharding.conftest import host_init

PAGE = 16
PROMPT_LENS = (37, 21, 53)  # not multiples of tp or of the page
NEW = 5


def _engine(params, cfg, **kw):
    kw = dict(
        dict(
            num_pages=48,
            num_slots=4,
            num_snapshots=12,
            page_tokens=PAGE,
            kda_block_tokens=4 * PAGE,
            max_pages_per_request=8,
            prefill_chunk_tokens=16,
            max_step_tokens=64,
            kernels="reference",
            dispatch="dense",
        ),
        **kw,
    )
    return Engine(params, cfg, **kw)


@pytest.fixture(scope="module")
def params(tiny_cfg):
    return host_init(tiny_cfg, seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def oracle(tiny_cfg, params):
    memo = {}

    def tokens(prompt, n):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = generate(params, tiny_cfg, prompt, n).tokens.tolist()
        return memo[key]

    return tokens


@pytest.fixture(scope="module")
def meshes(tiny_cfg, devices):
    return prefill_mesh(2, 2, devices[:2], cfg=tiny_cfg), decode_mesh(2, 2, devices[2:4], cfg=tiny_cfg)


@pytest.fixture(scope="module")
def colocated(tiny_cfg, params, prompts, meshes):
    """One colocated engine, prefill on tp2/ep2 (devices 0-1), decode on dp2/ep2 (devices 2-3),
    three concurrent requests."""
    eng = _engine(params, tiny_cfg, mesh=meshes)
    reqs = [eng.submit(p, NEW) for p in prompts]
    eng.run(max_steps=100)
    return eng, reqs


def test_colocated_engine_on_meshes_equals_the_oracle(colocated, prompts, oracle):
    eng, reqs = colocated
    for req, p in zip(reqs, prompts):
        assert req.done and req.error is None
        assert req.output == oracle(p, NEW), len(p)
    # the sharded steps ran (chunks of 16 and 4 tokens; decode buckets of 2 and 4 rows), and only those
    assert eng._prefill_step.size == 2 and eng._decode_step.size == 2
    assert set(eng._prefill_step.calls) == {(1, 16), (1, 4)}  # this engine's (the program is shared)
    assert 1 <= eng._decode_step.programs() <= 2
    assert not eng.manager.requests  # all KV released


def test_second_turn_from_a_prefix_hit_on_the_sharded_engine(colocated, prompts, oracle):
    eng, reqs = colocated
    turn1, r1 = prompts[2], reqs[2]
    extra = np.random.default_rng(5).integers(0, 256, 11).tolist()
    turn2 = turn1 + r1.output + extra  # 69 tokens: a hit at 48, then sharded 16 + 4, the last one unsharded
    r2 = eng.submit(turn2, NEW)
    eng.run(max_steps=100)
    assert r2.error is None and r2.cached_tokens == 3 * PAGE
    assert r2.output == oracle(turn2, NEW)


def test_pd_disaggregation_across_two_meshes_equals_the_oracle(tiny_cfg, params, prompts, oracle, meshes, devices):
    """Prefill engine on devices 0-1 (tp2, ep2), decode engine on devices 2-5 (dp4, ep2), direct handoff."""
    from serving.disagg import DisaggregatedServer

    prefill = _engine(params, tiny_cfg, role="prefill", mesh=meshes[0])
    decode = _engine(params, tiny_cfg, role="decode", mesh=decode_mesh(4, 2, devices[2:6], cfg=tiny_cfg))
    server = DisaggregatedServer(prefill, decode, "direct")
    reqs = [server.submit(p, NEW) for p in prompts[:2]]
    done = server.run(max_steps=200)
    for r, p in zip(reqs, prompts):
        assert done[r.request_id].output == oracle(p, NEW), len(p)
    assert decode._decode_step.size == 4
    assert not prefill.manager.requests and not any(m.requests for m in decode.managers)


def test_warmup_compiles_every_sharded_shape(tiny_cfg, params, prompts, oracle, meshes):
    """After `warmup` (sharded chunks of 2 tokens, the unsharded remainder, decode buckets 2 and 4),
    serving a request compiles nothing."""
    eng = _engine(params, tiny_cfg, mesh=meshes, prefill_chunk_tokens=2)
    assert [t for t, _ in eng._prefill_lengths()] == [1, 2]
    eng.warmup()
    req = eng.submit(prompts[1], NEW)
    eng.run(max_steps=100)
    assert eng.compiles == 0
    assert req.output == oracle(prompts[1], NEW)


def test_sharded_prefill_chunks_of_several_requests_run_as_one_batch(tiny_cfg, params, prompts, oracle, meshes):
    """prefill_batch=2: the sharded chunks of one length of two requests on one rank run as one tp2
    call (warm-up compiled it), and every request still gets the oracle's tokens."""
    eng = _engine(params, tiny_cfg, mesh=meshes, prefill_chunk_tokens=2, prefill_batch=2)
    eng.warmup()
    ps = [prompts[0][:21], prompts[1][:21], prompts[2][:21], prompts[2][-21:]]
    reqs = [eng.submit(p, NEW) for p in ps]  # two per rank
    eng.run(max_steps=100)
    assert eng.compiles == 0
    assert sorted(r.rank for r in reqs) == [0, 0, 1, 1]
    assert eng.prefill_batches[2] >= 20 and not eng.prefill_batches[1]  # 10 chunks of 2 tokens per rank
    for r, p in zip(reqs, ps):
        assert r.output == oracle(p, NEW)


def test_a_bad_mesh_is_refused_at_construction(tiny_cfg, params, meshes, devices):
    pre, dec = meshes
    with pytest.raises(ValueError, match="tp=4 does not divide kda_heads=2"):
        _engine(params, tiny_cfg, role="prefill", mesh=prefill_mesh(4, 2, devices[:4]))
    with pytest.raises(ValueError, match="ep=3 does not divide n_routed_experts=8"):
        _engine(params, tiny_cfg, role="decode", mesh=decode_mesh(3, 3, devices[:3]))
    with pytest.raises(ValueError, match=r"mesh=\(prefill_mesh, decode_mesh\)"):
        _engine(params, tiny_cfg, mesh=pre)
    with pytest.raises(ValueError, match="takes one mesh"):
        _engine(params, tiny_cfg, role="decode", mesh=meshes)
    with pytest.raises(ValueError, match="must divide page_tokens=9"):
        _engine(params, tiny_cfg, role="prefill", mesh=pre, page_tokens=9, kda_block_tokens=36)
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        _engine(params, tiny_cfg, role="decode", mesh="dp2,ep2")
