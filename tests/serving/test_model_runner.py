"""The decode programs: N steps in one program equal N single steps token for token (EOS stops a
row on the device); the persistent buffers are written only where the host's rows differ."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine import Engine
from serving.decode_runner import DecodeRows, DecodeRunner
from serving.sampling import GREEDY

PAGE = 16
N_STEPS = 4


@pytest.fixture(scope="module")
def prefilled(tiny_cfg, tiny_params):
    """An engine whose three requests (a decode bucket of 4: one padding row) just finished their
    prefill, with pages for N_STEPS more tokens each."""
    eng = Engine(
        tiny_params,
        tiny_cfg,
        num_pages=48,
        num_slots=4,
        page_tokens=PAGE,
        kda_block_tokens=4 * PAGE,
        prefill_chunk_tokens=64,
        kernels="reference",
    )
    rng = np.random.default_rng(5)
    reqs = [eng.submit(rng.integers(0, 256, 16).tolist(), 20) for _ in range(3)]  # one 16-token chunk each
    while not all(r.output for r in reqs):
        eng.step()
    assert all(len(r.output) == 1 for r in reqs)  # every prefill ended in the same step
    for r in reqs:
        eng.manager.extend(r.request_id, r.kv_len + N_STEPS)
    return eng, reqs


def single_steps(eng, rows, n):
    runner, pools, out = DecodeRunner(eng.cfg, "reference"), jax.tree.map(jnp.copy, eng.pools), []
    for _ in range(n):
        pools, tokens, did, _ = runner.dispatch(eng.params, pools, rows)
        tokens = np.asarray(tokens)
        runner.settle(rows, tokens, did)
        rows = rows.advanced(tokens)
        out.append(tokens)
    return np.stack(out, 1), pools, runner


def test_multi_step_program_equals_single_steps(prefilled):
    eng, reqs = prefilled
    rows = eng.executor.decode_rows(reqs, [r.output[-1] for r in reqs])
    assert len(rows.tokens) == 4 and rows.active.tolist() == [1, 1, 1, 0]
    want, pools_single, runner = single_steps(eng, rows, N_STEPS)
    assert runner.overwrites == 1  # the buffers were written once; each later step ran on them as they were
    multi = DecodeRunner(eng.cfg, "reference")
    pools, got = multi.dispatch_multi(
        eng.params, jax.tree.map(jnp.copy, eng.pools), rows, N_STEPS, [False] * 4, eos_id=0
    )
    got = np.asarray(got)
    np.testing.assert_array_equal(got[:3], want[:3])
    assert (got[3] == -1).all()  # the padding row emits nothing
    for a, b in zip(jax.tree.leaves(pools), jax.tree.leaves(pools_single)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5, rtol=1e-5)


def test_a_row_that_samples_eos_stops_on_the_device(prefilled):
    eng, reqs = prefilled
    rows = eng.executor.decode_rows(reqs, [r.output[-1] for r in reqs])
    want, _, _ = single_steps(eng, rows, N_STEPS)
    eos = int(want[0, 1])  # row 0's second token plays EOS
    stop = [True, False, False, False]
    _, got = DecodeRunner(eng.cfg, "reference").dispatch_multi(
        eng.params, jax.tree.map(jnp.copy, eng.pools), rows, N_STEPS, stop, eos_id=eos
    )
    got = np.asarray(got)
    first_eos = list(want[0]).index(eos)
    assert got[0].tolist() == want[0, : first_eos + 1].tolist() + [-1] * (N_STEPS - first_eos - 1)
    np.testing.assert_array_equal(got[1:3], want[1:3])


def test_decode_rows_pad_to_the_bucket_and_advance_as_the_device_does():
    rows = DecodeRows.build(
        4, [3, 4], [[1, 2], [3]], [0, 1], [10, 20], [GREEDY, GREEDY], max_pages=3, null_page=0, scratch_slot=9
    )
    assert rows.tables.tolist() == [[1, 2, 0], [3, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert rows.slots.tolist() == [0, 1, 9, 9] and rows.active.tolist() == [1, 1, 0, 0] and rows.greedy
    after = rows.advanced(np.asarray([7, 8, 5, 5]))
    assert after.tokens.tolist() == [7, 8, 0, 0] and after.lengths.tolist() == [11, 21, 0, 0]
    assert not after.same_as(rows) and after.same_as(rows.advanced(np.asarray([7, 8, 1, 1])))


def test_warmup_compile_threads_are_bounded_by_jobs_cores_and_memory():
    from serving.model_runner import compile_threads

    gib = 1 << 30
    assert compile_threads(20, cpu_count=16, available_bytes=None) == 8  # half the cores
    assert compile_threads(3, cpu_count=16, available_bytes=None) == 3  # one per job
    assert compile_threads(20, cpu_count=16, available_bytes=4 * gib, bytes_per_compile=3 * gib // 2) == 2
    assert compile_threads(20, cpu_count=16, available_bytes=gib // 2, bytes_per_compile=gib) == 1  # never 0
    assert compile_threads(20, cpu_count=2, available_bytes=None) == 1
