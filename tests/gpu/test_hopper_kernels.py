"""The Hopper MLA kernels compiled for the GPU at the model's dims, against their references on
fresh random inputs, several times over (a synchronization bug shows as run-to-run scatter: the
interpreter's body, which tests/pallas_kernels checks, cannot show it)."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import LatentPrefix, mla_decode_ref, mla_prefill_ref
from pallas_kernels.mla_decode_hopper import mla_decode_hopper
from pallas_kernels.mla_hopper import mla_prefill_chunk_hopper, mla_prefill_hopper
from tests.gpu.conftest import sm90

O_ATOL = 2e-2  # bf16 outputs of O(1), P rounded to bf16 before P @ V
LSE_ATOL = 1e-3
REPEATS = 5
RUNS = 3  # kernel runs per repeat on the same inputs: their bits must agree

pytestmark = pytest.mark.skipif(not sm90(), reason="Hopper (sm_90) kernels")


def decode_errors(
    decode,
    seed: int,
    heads: int,
    long: bool = False,
    p_slots=None,
    stall_ns: int = 0,
    runs: int = RUNS,
    cluster: int = 1,
) -> tuple[float, float, bool]:
    """Max |error| of output and LSE of `decode` (mla_decode_hopper's contract) against the
    reference on fresh bf16 inputs: kv_lora 512 + rope 64, pages of 128; `long`: 1-2k keys
    per row (16-32 P hand-overs between the warpgroups) instead of up to 1k.  The kernel runs
    `runs` times on the same inputs: the third value says whether every run gave the same
    bits (the kernel has no atomics, so a healthy one is deterministic; a race is not, even
    where its error stays inside the tolerance: on the H200 a P slot released early moved
    the error by < 0.01, under O_ATOL, in 15 repeats).  `stall_ns`: warpgroup 1 sleeps that
    long before each P @ V (`mla_decode_hopper`'s test knob), so a hand-over that only timing
    protects breaks on every run.  `cluster`: `mla_decode_hopper`'s."""
    r, p, page, b = 512, 64, 128, 4
    per_row = 16 if long else 8
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    pages = f(b * per_row + 8, page, r + p)
    table = jnp.asarray(rng.permutation(b * per_row + 8)[: b * per_row].reshape(b, per_row), jnp.int32)
    lens = jnp.asarray(rng.integers(per_row * page // 2 if long else 1, per_row * page, b), jnp.int32)
    q_latent, q_pe = f(b, 1, heads, r), f(b, 1, heads, p)
    outs = [
        decode(q_latent, q_pe, pages, table, lens, scale=192**-0.5, stall_ns=stall_ns, p_slots=p_slots, cluster=cluster)
        for _ in range(runs)
    ]
    same = all(
        np.array_equal(np.asarray(o), np.asarray(outs[0][0]))
        and np.array_equal(np.asarray(lse), np.asarray(outs[0][1]))
        for o, lse in outs[1:]
    )
    up = lambda x: x.astype(jnp.float32)
    o_ref, lse_ref = mla_decode_ref(up(q_latent), up(q_pe), up(pages), table, lens, scale=192**-0.5)
    o_err = max(float(jnp.max(jnp.abs(up(o) - o_ref))) for o, _ in outs)
    lse_err = max(float(jnp.max(jnp.abs(lse - lse_ref))) for _, lse in outs)
    return o_err, lse_err, same


STALL_NS = 2000  # per step: room for warpgroup 0 to reach the next hand-over (the mutant fails with it on the H200)


@pytest.mark.parametrize(
    "heads, long, p_slots, stall_ns",
    [(16, False, None, 0), (96, False, None, 0), (96, True, 1, 0), (96, True, 1, STALL_NS), (16, True, None, STALL_NS)],
)
def test_decode_at_the_models_latent_dims_every_repeat(heads, long, p_slots, stall_ns):
    """`small`'s 16 heads and full scale's 96; long contexts with one P slot make warpgroup 0
    wait on warpgroup 1 at every hand-over (where a release race would show); with warpgroup 1
    stalled before each read, only the barriers keep P intact."""
    for seed in range(REPEATS):
        o_err, lse_err, same = decode_errors(mla_decode_hopper, seed, heads, long, p_slots, stall_ns)
        assert o_err <= O_ATOL and lse_err <= LSE_ATOL, f"repeat {seed}: output {o_err:.3g}, lse {lse_err:.3g}"
        assert same, f"repeat {seed}: {RUNS} runs on the same inputs gave different bits (a race)"


@pytest.mark.parametrize("long, stall_ns", [(False, 0), (True, 0), (True, STALL_NS)])
def test_row_tiles_in_cta_pairs_at_the_models_latent_dims_every_repeat(long, stall_ns):
    """`cluster=2` at 128 heads: each query's two row tiles in one CTA cluster, every key tile
    multicast into both and its slot loaded again only after all four compute warpgroups are
    done with it: the reference's answer, the same bits every run, also with warpgroup 1
    stalled (in both CTAs) before each P @ V."""
    for seed in range(REPEATS):
        o_err, lse_err, same = decode_errors(mla_decode_hopper, 300 + seed, 128, long, None, stall_ns, cluster=2)
        assert o_err <= O_ATOL and lse_err <= LSE_ATOL, f"repeat {seed}: output {o_err:.3g}, lse {lse_err:.3g}"
        assert same, f"repeat {seed}: {RUNS} runs on the same inputs gave different bits (a race)"


@pytest.mark.parametrize(
    "heads, block_kv, persistent, tile_order",
    [
        (16, 64, False, "heads"),
        (96, 64, False, "heads"),
        (16, 128, False, "heads"),
        (16, 128, True, "heads"),
        (96, 128, True, "heads"),
        (96, 128, False, "q_tiles"),
        (16, 128, True, "q_tiles"),
    ],
)
def test_prefill_at_the_models_head_dims_every_repeat(heads, block_kv, persistent, tile_order):
    """qk 192 (nope 128 + rope 64), v 128, two ragged sequences; 128-key blocks put each
    warpgroup's output in its query tile's buffer; persistent CTAs (one per SM) walk many tiles
    on one K / V ring."""
    for seed in range(REPEATS):
        rng = np.random.default_rng(100 + seed)
        lens = [300, 77]
        t = sum(lens)
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
        q, k, v = f(t, heads, 192), f(t, heads, 192), f(t, heads, 128)
        cu = np.concatenate([[0], np.cumsum(lens)])
        o, lse = mla_prefill_hopper(
            q,
            k,
            v,
            cu_seqlens=cu,
            scale=192**-0.5,
            block_kv=block_kv,
            persistent=persistent,
            sms=8 if persistent else None,
            tile_order=tile_order,
        )
        up = lambda x: x.astype(jnp.float32)
        o_ref, lse_ref = mla_prefill_ref(up(q), up(k), up(v), cu_seqlens=cu, scale=192**-0.5)
        np.testing.assert_allclose(up(o), o_ref, atol=O_ATOL, rtol=0, err_msg=f"repeat {seed}")
        np.testing.assert_allclose(lse, lse_ref, atol=LSE_ATOL, rtol=0, err_msg=f"repeat {seed}")


@pytest.mark.parametrize(
    "heads, block_kv, persistent", [(16, 64, False), (16, 128, False), (96, 128, False), (16, 128, True)]
)
def test_chunk_over_a_cache_at_the_models_dims_every_repeat(heads, block_kv, persistent):
    """A jitted serving step's chunk: 3 sequences x 200 new tokens after cached prefixes of
    odd lengths (a partial last key block, none, several pages), the lengths traced, the prefix
    from non-contiguous pages of latent rows (kv_lora 512 + rope 64) == the packed reference.
    `kimik3.ops.mla_chunk_impl` picks the Hopper chunk kernel on a GPU only as long as this passes
    (RESULTS.md, MLA kernels: 1.05-1.28x faster than the Triton one at 128-key blocks)."""
    import jax

    b, t, r, rope, nope, dv, page = 3, 200, 512, 64, 128, 128, 64
    chunk = jax.jit(
        lambda q, k, v, pages, table, lens, w_kb, w_vb: mla_prefill_chunk_hopper(
            q,
            k,
            v,
            LatentPrefix(pages, table, lens, w_kb, w_vb),
            scale=192**-0.5,
            block_kv=block_kv,
            persistent=persistent,
            sms=8 if persistent else None,
        )
    )
    for seed in range(REPEATS):
        rng = np.random.default_rng(300 + seed)
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
        q, k, v = f(b, t, heads, nope + rope), f(b, t, heads, nope + rope), f(b, t, heads, dv)
        pages = f(3 * 8 + 4, page, r + rope)
        table = jnp.asarray(rng.permutation(3 * 8 + 4)[: 3 * 8].reshape(b, 8), jnp.int32)
        w_kb, w_vb = f(r, heads, nope) * r**-0.5, f(r, heads, dv) * r**-0.5
        lens = jnp.asarray([37 + seed, 0, 300], jnp.int32)
        o, lse = chunk(q, k, v, pages, table, lens, w_kb, w_vb)
        pack = lambda x: x.reshape((b * t,) + x.shape[2:]).astype(jnp.float32)
        o_ref, lse_ref = mla_prefill_ref(
            pack(q),
            pack(k),
            pack(v),
            cu_seqlens=np.arange(b + 1) * t,
            scale=192**-0.5,
            prefix=LatentPrefix(pages, table, lens, w_kb, w_vb),
        )
        np.testing.assert_allclose(pack(o), o_ref, atol=O_ATOL, rtol=0, err_msg=f"repeat {seed}")
        np.testing.assert_allclose(pack(lse), lse_ref, atol=LSE_ATOL, rtol=0, err_msg=f"repeat {seed}")


# ---- a mutant the suite must catch ---------------------------------------------------------------
# Warpgroup 1 hands the P slot back to warpgroup 0 *before* its P @ V wgmma has read it: warpgroup 0
# may then overwrite P mid-read.  The interpreter's values cannot show this race (its own race
# detector skips wgmma operands); tests/pallas_kernels/test_ring_order.py orders every slot's
# release after its last read and catches it on the CPU.  On the GPU three probe runs of such a mutant gave max errors 0.25, 0.003 and 0.21 on the H200, and
# 15 repeats of variants of it stayed inside the tolerance with identical bits: unstalled, the read
# usually wins.  The release moves ahead of the test's stall, which then opens the window.
_READ = (
    "            if stall_ns:  # tests/gpu: warpgroup 1 late to read P, so only the barriers keep the slot\n"
    "                pl.delay(stall_ns)\n"
    "            acc = value_half(acc, i, slot, 1)\n"
)
_RELEASE = "            plgpu.barrier_arrive(p_free.at[pslot])\n"


def mutant_source() -> str:
    """pallas_kernels/mla_decode_hopper.py with the P slot released before it is read."""
    import pallas_kernels.mla_decode_hopper as mod

    src = open(mod.__file__).read()
    if src.count(_READ + _RELEASE) != 1:
        raise AssertionError("the decode kernel's P release moved: update the mutant with it")
    return src.replace(_READ + _RELEASE, _RELEASE + _READ)


def test_the_suite_catches_a_p_slot_released_before_it_is_read(tmp_path):
    """The decode check above, run on the mutant (one P slot, long contexts: many hand-overs),
    must fail in at least one of its repeats."""
    import importlib.util

    path = tmp_path / "mla_decode_hopper_mutant.py"
    path.write_text(mutant_source())
    spec = importlib.util.spec_from_file_location("mla_decode_hopper_mutant", path)
    mutant = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mutant  # a dataclass (DecodeCta) resolves its annotations through it
    try:
        spec.loader.exec_module(mutant)
    finally:
        del sys.modules[spec.name]
    worst = 0.0
    cases = [(96, True, 1, STALL_NS), (16, True, None, STALL_NS), (96, True, 1, 0)]  # the decode check's
    for heads, long, p_slots, stall_ns in cases:
        for seed in range(REPEATS):
            o_err, _, same = decode_errors(mutant.mla_decode_hopper, 1000 + seed, heads, long, p_slots, stall_ns)
            worst = max(worst, o_err)
            if worst > O_ATOL or not same:
                return
    pytest.fail(
        f"the mutant passed {len(cases) * REPEATS} repeats (max error {worst:.3g}, every run the same "
        f"bits): the decode check cannot see a P slot released early"
    )
