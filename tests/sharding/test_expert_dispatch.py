"""Expert-parallel dispatch (`sharding.layers.moe_ep`) under skewed routing equals the single-device
LatentMoE: most rows to one expert, experts and whole ranks that receive nothing.

Both dispatches run on the CPU's host devices.  "dense" is XLA:CPU's own fixed-capacity
all_to_all (a capacity of every row a rank sends, so a skew drops nothing).  XLA:CPU has no
ragged-all-to-all (its thunk emitter answers UNIMPLEMENTED), so the GPU's "ragged" dispatch runs
on `emulated_ragged_all_to_all`: `jax.lax.ragged_all_to_all`'s documented semantics built from
all_gather, checked here against those semantics written out in numpy.  The real collective on
two GPUs: tests/gpu/test_ragged_ep.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kimik3.layers.moe import LatentMoE, route
from sharding import layers
from sharding.mesh import decode_mesh
from sharding.rules import ALL, EXPERT

TOKENS_PER_RANK = 8
# fp32, the same expert GEMMs over other row sets in another order: measured max |diff| 1.4e-6
# (ep 4) to 4.8e-6 (ep 8) over four inputs and three layers' experts, outputs up to ~10; a row
# sent to the wrong expert, or lost, moves them by O(0.1).
ATOL = 1e-5
EXPERT_WEIGHTS = ("w_gate_elf", "w_up_elf", "w_out_efl")


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
    """`jax.lax.ragged_all_to_all` with one slice per peer, from all_gather: rank s sends
    operand[input_offsets[d] : + send_sizes[d]] to rank d, which writes it at its
    output[output_offsets[d] (s's value) : + recv_sizes[s]] and keeps the rest of `output`.  Rows
    the receiver expects beyond what the sender sends read NaN (0x7fffffff for integers), so a
    size mismatch between the two sides shows in the result."""
    if axis_index_groups is not None:
        raise NotImplementedError("axis_index_groups")
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    if input_offsets.shape != (n,):
        raise NotImplementedError("one slice per peer")
    rows = operand.shape[0]
    gather = lambda a: jax.lax.all_gather(a, axis_name)
    offsets_in, sizes, offsets_out = (
        gather(input_offsets)[:, me],
        gather(send_sizes)[:, me],
        gather(output_offsets)[:, me],
    )
    r = jnp.arange(rows)
    slices = gather(operand)[jnp.arange(n)[:, None], jnp.clip(offsets_in[:, None] + r, 0, rows - 1)]  # [n, rows, ...]
    poison = jnp.nan if jnp.issubdtype(operand.dtype, jnp.floating) else jnp.iinfo(operand.dtype).max
    sent = (r < sizes[:, None]).reshape((n, rows) + (1,) * (operand.ndim - 1))
    slices = jnp.where(sent, slices, jnp.asarray(poison, operand.dtype))
    dest = jnp.where(r < recv_sizes[:, None], offsets_out[:, None] + r, output.shape[0])  # past the end: dropped
    return output.at[dest.reshape(-1)].set(slices.reshape((n * rows,) + operand.shape[1:]), mode="drop")


def test_the_emulated_ragged_all_to_all_follows_the_documented_semantics(devices):
    n, rows, width = 4, 6, 3
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 3, (n, n)).astype(np.int32)  # [source, dest]; some slices empty
    sizes[1] = 0  # a rank that sends nothing
    in_off = (np.cumsum(sizes, 1) - sizes).astype(np.int32)  # each source packs its slices in dest order
    out_off = (np.cumsum(sizes, 0) - sizes).astype(np.int32)  # each dest stacks its slices in source order
    operand = rng.standard_normal((n, rows, width)).astype(np.float32)
    output = np.full((n, rows + 2, width), -1.0, np.float32)  # what no slice overwrites stays
    mesh = jax.sharding.Mesh(np.asarray(devices[:n]), ("x",))

    def body(op, out, io, ss, oo, rs):
        return emulated_ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        operand, output, in_off, sizes, out_off, np.ascontiguousarray(sizes.T)
    )
    want = output.copy()
    for s in range(n):  # the pseudo-code of jax.lax.ragged_all_to_all's docstring
        for d in range(n):
            m = sizes[s, d]
            want[d, out_off[s, d] : out_off[s, d] + m] = operand[s, in_off[s, d] : in_off[s, d] + m]
    np.testing.assert_array_equal(np.asarray(got), want)


def _skewed(cfg, p_moe, routing: str):
    """The layer's params with a router bias that steers selection (the weights still come from the
    scores): "one_expert": every token chooses expert 0, experts 5.. are never chosen; "one_rank":
    every token chooses experts 0 and 1 (the first rank's under ep >= 2)."""
    bias = np.zeros(cfg.n_routed_experts, np.float32)
    if routing == "one_expert":
        bias[0], bias[5:] = 8.0, -8.0
    else:
        bias[:2] = 8.0
    return dict(p_moe, router_bias_e=jnp.asarray(bias))


@functools.cache
def _sharded_moe(cfg, ep: int, dispatch: str, devices):
    """moe_ep over a decode mesh of ep ranks (one replica group): tokens [B, T, D] split over the
    ranks by batch row, the experts split over EXPERT."""
    mesh = decode_mesh(ep, ep, devices=devices[:ep], cfg=cfg)

    def run(p_moe, x):
        specs = {k: P(EXPERT) if k in EXPERT_WEIGHTS else P() for k in p_moe}
        specs = jax.tree_util.tree_map(lambda _: P(), p_moe) | specs
        body = functools.partial(layers.moe_ep, cfg, ep=ep, dispatch=dispatch, kernels="reference")
        fn = jax.shard_map(
            lambda p, h: body(p, h), mesh=mesh, in_specs=(specs, P(ALL)), out_specs=P(ALL), check_vma=False
        )
        return fn(p_moe, x)

    return jax.jit(run)


@pytest.mark.parametrize("routing", ["one_expert", "one_rank"])
@pytest.mark.parametrize("dispatch, ep", [("dense", 4), ("ragged", 4), ("ragged", 8)])
def test_skewed_routing_through_the_expert_parallel_dispatch_equals_one_device(
    tiny_cfg, tiny_params, devices, monkeypatch, dispatch, ep, routing
):
    cfg = tiny_cfg
    p_moe = _skewed(cfg, tiny_params["layer_1"]["moe"], routing)
    x = jnp.asarray(np.random.default_rng(ep).standard_normal((ep, TOKENS_PER_RANK, cfg.d_model)), jnp.float32)
    ids, _ = route(x.reshape(-1, cfg.d_model), p_moe["w_router_de"], p_moe["router_bias_e"], cfg.n_active_experts)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=cfg.n_routed_experts)
    n = ep * TOKENS_PER_RANK
    if routing == "one_expert":  # every token at expert 0, nothing at 5..7 (a whole rank idle under ep 4 and 8)
        assert counts[0] == n and not counts[5:].any() and counts[1:5].sum() == n, counts
    else:  # every row on the first rank: the others receive nothing, and it receives ep x its own rows
        assert counts[0] == counts[1] == n and not counts[2:].any(), counts
    if dispatch == "ragged":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    got = _sharded_moe(cfg, ep, dispatch, tuple(devices))(p_moe, x)
    want = LatentMoE(cfg, kernels="reference").apply({"params": p_moe}, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=0)
