"""Pallas KDA kernels (interpret mode on CPU) against the token recurrence.

In interpret mode Pallas fills every output buffer with NaN before the kernel
runs, so a finite result proves that every element was written.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.kda as kda_mod
from pallas_kernels.kda import chunk_kda, chunk_kda_replay, fused_recurrent_kda, kda_recurrent_ref
from tests.pallas_kernels.test_kda_ref import kda_inputs

# fp32 state and math; the chunked kernel sums in another order and inverts
# 16x16 blocks by a product formula, so it agrees to ~1e-5 of values of O(1).
ATOL, RTOL = 1e-4, 1e-4


def replay_state(q, k, v, g, beta, n, initial_state=None):
    """State after the first n tokens, by running the recurrence over them."""
    return kda_recurrent_ref(*(x[:, :n] for x in (q, k, v, g, beta)), initial_state=initial_state)[1]


# gate_scale 0.05: weak decay (cumulative gate ~-8 over a chunk), so every block of
# A_kk matters, not only the ones near the diagonal.
@pytest.mark.parametrize(
    "b, t, h, dk, dv, impl, gate_scale",
    [
        (2, 150, 2, 16, 32, "fused", 1.0),
        (1, 64, 3, 32, 16, "fused", 1.0),
        (3, 37, 1, 16, 16, "fused", 1.0),
        (2, 150, 2, 16, 32, "split", 0.05),
        (1, 64, 3, 32, 16, "split", 1.0),
        (2, 150, 2, 16, 32, "intra_solve", 0.05),
    ],
)
def test_chunk_kda_equals_the_recurrence(rng, b, t, h, dk, dv, impl, gate_scale):
    q, k, v, g, beta = kda_inputs(rng, b, t, h, dk, dv)
    g = g * gate_scale
    s0 = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    o, s, ck = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, tuning={"prepare_impl": impl})
    o_ref, s_ref = kda_recurrent_ref(q, k, v, g, beta, initial_state=s0)
    assert np.isfinite(o).all() and np.isfinite(s).all() and ck is None
    np.testing.assert_allclose(o, o_ref, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(s, s_ref, atol=ATOL, rtol=RTOL)


def test_checkpoints_at_128_and_1536_multiples_equal_replayed_prefixes(rng):
    q, k, v, g, beta = kda_inputs(rng, 1, 1600, 1, 16, 16)
    s0 = jnp.asarray(rng.standard_normal((1, 1, 16, 16)), jnp.float32)
    positions = [128, 256, 1408, 1536]
    o, s, ck = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, checkpoint_positions=positions)
    assert ck.shape == (1, 4, 1, 16, 16) and np.isfinite(ck).all()
    for i, p in enumerate(positions):
        np.testing.assert_allclose(ck[0, i], replay_state(q, k, v, g, beta, p, s0)[0], atol=ATOL, rtol=RTOL)
    # export does not disturb the pass itself
    o_plain, s_plain, _ = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    np.testing.assert_array_equal(o, o_plain)
    np.testing.assert_array_equal(s, s_plain)


@pytest.mark.parametrize("impl", ["fused", "split"])
def test_varlen_batch_in_one_call_with_own_initial_states_and_checkpoints(rng, impl):
    lens = [70, 200, 64, 5]
    q, k, v, g, beta = kda_inputs(rng, 1, sum(lens), 2, 16, 16)
    s0 = jnp.asarray(rng.standard_normal((4, 2, 16, 16)), jnp.float32)
    cu = np.concatenate([[0], np.cumsum(lens)])
    positions = [[64], [128, 192], [64], []]
    o, s, ck = chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=s0,
        output_final_state=True,
        checkpoint_positions=positions,
        cu_seqlens=cu,
        tuning={"prepare_impl": impl},
    )
    assert ck.shape == (4, 2, 16, 16)
    slot = 0
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        seq = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        o_ref, s_ref = kda_recurrent_ref(*seq, initial_state=s0[i : i + 1])
        np.testing.assert_allclose(o[:, lo:hi], o_ref, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(s[i], s_ref[0], atol=ATOL, rtol=RTOL)
        for p in positions[i]:
            np.testing.assert_allclose(ck[slot], replay_state(*seq, p, s0[i : i + 1])[0], atol=ATOL, rtol=RTOL)
            slot += 1


@pytest.mark.parametrize(
    "prepare_dot, impl, gate_scale",
    [("tf32x3", "fused", 1.0), ("bf16", "fused", 1.0), ("tf32x3", "split", 1.0), ("auto", "split", 0.05)],
)
def test_bf16_inputs_keep_fp32_state(rng, prepare_dot, impl, gate_scale):
    q, k, v, g, beta = kda_inputs(rng, 1, 130, 2, 16, 16)
    g = g * gate_scale
    s0 = jnp.asarray(rng.standard_normal((1, 2, 16, 16)), jnp.float32)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v, beta)]
    o, s, _ = chunk_kda(
        bf[0],
        bf[1],
        bf[2],
        g,
        bf[3],
        initial_state=s0,
        output_final_state=True,
        tuning={"prepare_dot": prepare_dot, "prepare_impl": impl},
    )
    o_ref, s_ref = kda_recurrent_ref(
        *(x.astype(jnp.float32) for x in (bf[0], bf[1], bf[2], g, bf[3])), initial_state=s0
    )
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    # bf16 intermediates and operands: bf16-level agreement (relative L2 below 1e-2).
    rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
    assert rel(o, o_ref) < 1e-2 and rel(s, s_ref) < 1e-2


def softplus_gate(rng, b, t, h, dk, spread=3.0):
    """Kimi-Linear's gate -exp(A_log) softplus(f + dt_bias), A_log = log U(1, 16), f ~ N(0, spread):
    per-token log-decays reach about -16 * 3 * spread, far below the bounded gate's -5."""
    from kimik3.layers.kda import kda_gate

    f = jnp.asarray(rng.standard_normal((b, t, h, dk)) * spread, jnp.float32)
    a_log = jnp.log(jnp.asarray(rng.uniform(1.0, 16.0, h), jnp.float32))
    return kda_gate(f, a_log, jnp.zeros((h, dk), jnp.float32), None)


def test_the_exact_diagonal_tiles_equal_the_pairwise_formula(rng):
    """Each 16-token block's tile A[t, s] = sum_k x_t k_s exp(G_t - G_s) (s <= t), written out
    pairwise in numpy, for gates down to about -150 per token."""
    from pallas_kernels.kda.diagonal import diagonal_tiles

    q, k, _, _, _ = kda_inputs(rng, 1, 16, 1, 32, 16)
    g = softplus_gate(rng, 1, 16, 1, 32)[0, :, 0]
    q, k = np.asarray(q[0, :, 0], np.float64), np.asarray(k[0, :, 0], np.float64)
    gc = np.cumsum(np.asarray(g, np.float64), axis=0)
    want_kk, want_qk = np.zeros((16, 16)), np.zeros((16, 16))
    for t in range(16):
        for s in range(t + 1):
            decay = np.exp(gc[t] - gc[s])
            want_kk[t, s], want_qk[t, s] = np.sum(k[t] * k[s] * decay), np.sum(q[t] * k[s] * decay)
    akk, aqk = diagonal_tiles(*(jnp.asarray(x, jnp.float32) for x in (q, k, g)))
    np.testing.assert_allclose(akk, want_kk, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(aqk, want_qk, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_unbounded_gate_gives_the_recurrence_with_exports(rng, dtype):
    """Kimi-Linear's softplus gate (log-decays far below -5): the kernel with gate_bounded=False
    equals the token recurrence, states exported in the same pass included; fp32 to 1e-4, bf16
    inputs to bf16's relative L2 of 1e-2.  The factored form overflows on the same inputs."""
    q, k, v, _, beta = kda_inputs(rng, 2, 150, 2, 32, 16)
    g = softplus_gate(rng, 2, 150, 2, 32)
    assert float(jnp.min(g)) < -40
    s0 = jnp.asarray(rng.standard_normal((2, 2, 32, 16)) * 0.1, jnp.float32)
    cast = [x.astype(dtype) for x in (q, k, v, beta)]
    o, s, ck = chunk_kda(
        cast[0], cast[1], cast[2], g, cast[3], initial_state=s0, output_final_state=True,
        checkpoint_positions=[64, 128], gate_bounded=False,
    )  # fmt: skip
    o_ref, s_ref = kda_recurrent_ref(
        *(x.astype(jnp.float32) for x in (cast[0], cast[1], cast[2], g, cast[3])), initial_state=s0
    )
    ck_ref = [
        replay_state(*(x.astype(jnp.float32) for x in (cast[0], cast[1], cast[2], g, cast[3])), p, s0)
        for p in (64, 128)
    ]
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(ck).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(o, o_ref, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(s, s_ref, atol=ATOL, rtol=RTOL)
        for i in range(2):
            np.testing.assert_allclose(ck[:, i], ck_ref[i], atol=ATOL, rtol=RTOL)
        o_factored = chunk_kda(q, k, v, g, beta, initial_state=s0)[0]
        assert not np.isfinite(np.asarray(o_factored)).all()
    else:
        rel = lambda a, b: float(jnp.linalg.norm(jnp.asarray(a, jnp.float32) - b) / jnp.linalg.norm(b))
        assert rel(o, o_ref) < 1e-2 and rel(s, s_ref) < 1e-2 and rel(ck[:, 1], ck_ref[1]) < 1e-2


def test_an_unbounded_gate_needs_the_split_prepare(rng):
    q, k, v, g, beta = kda_inputs(rng, 1, 64, 1, 16, 16)
    with pytest.raises(ValueError, match="unbounded gate needs prepare_impl 'split'"):
        chunk_kda(q, k, v, g, beta, gate_bounded=False, tuning={"prepare_impl": "fused"})


@pytest.mark.parametrize("gate_scale", [1.0, 0.05])
def test_split_prepare_gives_the_fused_prepare_intermediates(rng, gate_scale):
    """The "split" prepare (intra + solve kernels) against the fused kernel, fp32, per intermediate;
    strong decay (large exponents) and weak decay (all of A_kk populated)."""
    q, k, v, g, beta = kda_inputs(rng, 1, 192, 2, 32, 16)
    args = [x[0] for x in (q, k, v, g * gate_scale, beta)]  # [T, H, ...], T a multiple of 64
    fused = kda_mod._chunk_prepare_call(*args, interpret=True, tuning=(("prepare_impl", "fused"),))
    split = kda_mod._chunk_prepare_call(*args, interpret=True, tuning=(("prepare_impl", "split"),))
    for name, a, b in zip(["w", "u", "q_decayed", "k_to_end", "a_qk", "decay_end"], fused, split):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.isfinite(b).all(), name
        # Both are fp32 up to summation order (the cumulative gate reaches ~-160 here, so
        # exponents carry ~1e-5 absolute rounding).
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("n", [2, 4, 3])
def test_prepare_programs_looping_over_chunks_give_the_same_intermediates(rng, n):
    """`intra_chunks` / `solve_chunks` (a program loops over several chunks of one head): every
    intermediate equals one chunk a program's, bit for bit (the same math per chunk).  Four
    chunks: 2 and 4 divide them; 3 does not and falls back to one chunk a program."""
    q, k, v, g, beta = kda_inputs(rng, 1, 256, 2, 32, 16)
    args = [x[0] for x in (q, k, v, g, beta)]
    tuning = (("intra_chunks", n), ("solve_chunks", n))
    assert kda_mod._loop_chunks(4, "solve_chunks", tuning) == (1 if n == 3 else n)
    one = kda_mod._chunk_prepare_call(*args, interpret=True)
    looped = kda_mod._chunk_prepare_call(*args, interpret=True, tuning=tuning)
    for name, a, b in zip(["w", "u", "q_decayed", "k_to_end", "a_qk", "decay_end"], one, looped):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_intra_solve_kernel_gives_the_split_intermediates_bit_for_bit(rng, dtype):
    """prepare_impl "intra_solve" (the intra and solve kernels as one program, A_kk and
    beta exp(G) k kept on chip, rounded as the split's HBM copies are) is the split's math:
    every intermediate equal, in fp32 and with bf16 inputs (bf16 dots, bf16 A_kk)."""
    q, k, v, g, beta = kda_inputs(rng, 1, 192, 2, 32, 16)
    args = [x[0].astype(dtype) for x in (q, k, v)] + [g[0], beta[0].astype(dtype)]
    split = kda_mod._chunk_prepare_call(*args, interpret=True, tuning=(("prepare_impl", "split"),))
    one = kda_mod._chunk_prepare_call(*args, interpret=True, tuning=(("prepare_impl", "intra_solve"),))
    for name, a, b in zip(["w", "u", "q_decayed", "k_to_end", "a_qk", "decay_end"], split, one):
        assert a.dtype == b.dtype and np.isfinite(np.asarray(b, np.float32)).all(), name
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a, np.float32), err_msg=name)


def test_unknown_prepare_impl_is_refused(rng):
    q, k, v, g, beta = kda_inputs(rng, 1, 64, 1, 16, 16)
    with pytest.raises(ValueError, match="prepare_impl"):
        chunk_kda(q, k, v, g, beta, tuning={"prepare_impl": "nope"})


def test_replay_baselines_produce_the_same_states_as_export(rng):
    q, k, v, g, beta = kda_inputs(rng, 1, 512, 1, 16, 16)
    _, _, ck = chunk_kda(q, k, v, g, beta, checkpoint_positions=[128, 256, 384, 512])
    o_a, blocks, units = chunk_kda_replay(q, k, v, g, beta, mode="partial", block_tokens=256, unit_tokens=128)
    np.testing.assert_allclose(units[0], ck[0], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(blocks[0], ck[0, 1::2], atol=ATOL, rtol=RTOL)
    o, _, _ = chunk_kda(q, k, v, g, beta)
    np.testing.assert_array_equal(o_a, o)


class TestFusedRecurrent:
    @pytest.mark.parametrize("block_v, num_warps, cache_hints", [(None, 8, False), (8, 1, False), (None, 8, True)])
    def test_decode_over_non_contiguous_slots_updates_only_those(self, rng, block_v, num_warps, cache_hints):
        """The default tiling, a narrow one, and the default with fla's eviction hints."""
        q, k, v, g, beta = kda_inputs(rng, 3, 1, 2, 16, 32)
        pool = jnp.asarray(rng.standard_normal((9, 2, 16, 32)), jnp.float32)
        before = np.asarray(pool).copy()
        slots = np.array([7, 0, 4])
        o, pool = fused_recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            state_pool=pool,
            slots=slots,
            block_v=block_v,
            num_warps=num_warps,
            cache_hints=cache_hints,
        )
        o_ref, s_ref = kda_recurrent_ref(q, k, v, g, beta, initial_state=jnp.asarray(before[slots]))
        np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(pool)[slots], s_ref, atol=1e-5, rtol=1e-5)
        untouched = [i for i in range(9) if i not in slots]
        np.testing.assert_array_equal(np.asarray(pool)[untouched], before[untouched])

    @pytest.mark.parametrize("cache_hints", [False, True])
    def test_speculative_verify_then_commit_the_accepted_prefix(self, rng, cache_hints):
        q, k, v, g, beta = kda_inputs(rng, 2, 4, 1, 16, 16)
        pool = jnp.asarray(rng.standard_normal((4, 1, 16, 16)), jnp.float32)
        before = np.asarray(pool).copy()
        slots = np.array([3, 1])
        accepted = np.array([2, 4])
        o, pool = fused_recurrent_kda(
            q, k, v, g, beta, state_pool=pool, slots=slots, num_accepted=accepted, cache_hints=cache_hints
        )
        o_ref, _ = kda_recurrent_ref(q, k, v, g, beta, initial_state=jnp.asarray(before[slots]))
        np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)  # outputs for every drafted token
        for i, n in enumerate(accepted):
            want = replay_state(*(x[i : i + 1] for x in (q, k, v, g, beta)), n, jnp.asarray(before[slots[i]][None]))
            np.testing.assert_allclose(np.asarray(pool)[slots[i]], want[0], atol=1e-5, rtol=1e-5)

    def test_a_verify_pass_exports_the_state_after_every_token(self, rng):
        q, k, v, g, beta = kda_inputs(rng, 3, 5, 2, 16, 32)
        pool = jnp.asarray(rng.standard_normal((6, 2, 16, 32)), jnp.float32)
        before = np.asarray(pool).copy()
        slots = np.array([5, 0, 2])
        o, pool, states = fused_recurrent_kda(q, k, v, g, beta, state_pool=pool, slots=slots, export_states=True)
        assert states.shape == (3, 5, 2, 16, 32)
        o_ref, _ = kda_recurrent_ref(q, k, v, g, beta, initial_state=jnp.asarray(before[slots]))
        np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
        for n in range(1, 6):
            want = replay_state(q, k, v, g, beta, n, jnp.asarray(before[slots]))
            np.testing.assert_allclose(states[:, n - 1], want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(pool)[slots], states[:, -1], atol=1e-6, rtol=1e-6)

    def test_zero_accepted_leaves_the_state_untouched(self, rng):
        q, k, v, g, beta = kda_inputs(rng, 1, 3, 1, 16, 16)
        pool = jnp.asarray(rng.standard_normal((2, 1, 16, 16)), jnp.float32)
        before = np.asarray(pool).copy()
        _, pool = fused_recurrent_kda(q, k, v, g, beta, state_pool=pool, slots=[1], num_accepted=[0])
        np.testing.assert_array_equal(np.asarray(pool), before)


class TestBadInput:
    def test_checkpoint_positions(self, rng):
        q, k, v, g, beta = kda_inputs(rng, 1, 130, 1, 16, 16)
        with pytest.raises(ValueError, match="multiple of 64"):
            chunk_kda(q, k, v, g, beta, checkpoint_positions=[100])
        with pytest.raises(ValueError, match="beyond"):
            chunk_kda(q, k, v, g, beta, checkpoint_positions=[192])

    def test_shapes_and_state_dtype(self, rng):
        q, k, v, g, beta = kda_inputs(rng, 1, 64, 1, 16, 16)
        with pytest.raises(ValueError, match="beta"):
            chunk_kda(q, k, v, g, beta[:, :10])
        with pytest.raises(ValueError, match="float32"):
            chunk_kda(q, k, v, g, beta, initial_state=jnp.zeros((1, 1, 16, 16), jnp.bfloat16))
        with pytest.raises(ValueError, match="powers of two"):
            chunk_kda(*kda_inputs(rng, 1, 64, 1, 24, 16))
        with pytest.raises(ValueError, match="cu_seqlens"):
            chunk_kda(q, k, v, g, beta, cu_seqlens=[0, 30, 20, 64])

    def test_decode_arguments(self, rng):
        q, k, v, g, beta = kda_inputs(rng, 2, 1, 1, 16, 16)
        pool = jnp.zeros((4, 1, 16, 16), jnp.float32)
        with pytest.raises(ValueError, match="distinct"):
            fused_recurrent_kda(q, k, v, g, beta, state_pool=pool, slots=[1, 1])
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            fused_recurrent_kda(q, k, v, g, beta, state_pool=pool, slots=[1, 4])
        with pytest.raises(ValueError, match="float32"):
            fused_recurrent_kda(q, k, v, g, beta, state_pool=pool.astype(jnp.bfloat16), slots=[0, 1])
        with pytest.raises(ValueError, match="num_accepted"):
            fused_recurrent_kda(q, k, v, g, beta, state_pool=pool, slots=[0, 1], num_accepted=[0, 2])


def test_traced_export_positions_equal_a_replay_and_zero_where_they_name_no_state(rng):
    """`export_at` is the traced form of checkpoint_positions (a serving engine's chunk exports
    its snapshot boundaries with one compiled program): exports equal the replayed states, for
    the Pallas kernel and the chunked reference; -1, non-multiples of 64 and positions past T
    export zeros."""
    import jax

    q, k, v, g, beta = kda_inputs(rng, 2, 200, 2, 16, 16)
    s0 = jnp.asarray(rng.standard_normal((2, 2, 16, 16)), jnp.float32)
    export_at = jnp.asarray([128, -1, 64, 100, 256], jnp.int32)
    run = jax.jit(lambda e: chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, export_at=e))
    _, _, ck = run(export_at)
    _, _, ck_ref = kda_mod.kda_chunked_ref(q, k, v, g, beta, initial_state=s0, export_at=export_at)
    assert ck.shape == ck_ref.shape == (2, 5, 2, 16, 16)
    for j, p in ((0, 128), (2, 64)):
        want = replay_state(q, k, v, g, beta, p, s0)
        np.testing.assert_allclose(ck[:, j], want, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(ck_ref[:, j], want, atol=ATOL, rtol=RTOL)
    for j in (1, 3, 4):
        assert not np.asarray(ck[:, j]).any() and not np.asarray(ck_ref[:, j]).any()
    _, _, ck2 = run(jnp.asarray([64, 192, -1, -1, -1], jnp.int32))
    np.testing.assert_allclose(ck2[:, 1], replay_state(q, k, v, g, beta, 192, s0), atol=ATOL, rtol=RTOL)
    # (JAX registers a tracing-context value during the first call, so the second traces once more.)
    programs = run._cache_size()
    run(jnp.asarray([192, 64, 128, -1, 0], jnp.int32))  # other positions: the same program
    assert run._cache_size() == programs


def test_state_pass_splits_v_finer_only_when_programs_are_scarce():
    """64 V columns per program, 32 when that would leave fewer than 96 programs (H200-tuned)."""
    assert kda_mod._state_block_v(1, 32, 128, None) == 32  # B1 H32: 64 programs at 64
    assert kda_mod._state_block_v(8, 32, 128, None) == 64
    assert kda_mod._state_block_v(4, 12, 128, None) == 64
    assert kda_mod._state_block_v(1, 2, 16, None) == 16  # never wider than V
    assert kda_mod._state_block_v(8, 32, 128, (("state_block_v", 16),)) == 16
