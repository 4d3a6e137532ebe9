"""What the Hopper (sm_90a) Mosaic GPU kernels of this package share: the register split
between warp-specialized warpgroups, wgmma accumulation in place, an online softmax's score and
output accumulators with products in flight (`RefAccumulators`, `softmax_loop`), `fresh` (an
index LLVM cannot hoist), and the producer warpgroup's TMA ring over `steps` shared-memory
slots."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_BYTES = 232448  # H100 / H200: 227 KiB per CTA


def set_registers(count: int, interpret: bool):
    """Rebalance the register file between warpgroups (232 for each compute, 40 for the
    producer: FlashAttention-3's split); the interpreter has no register file."""
    if not interpret:
        plgpu.set_max_registers(count, action="increase" if count > 128 else "decrease")


def mma_into(acc, mma, interpret: bool):
    """acc plus what `mma(acc_ref)` accumulates (wgmma calls).  On the GPU in place (run_state):
    a second fp32 accumulator would double the registers it takes.  The interpreter has no
    run_state over a wgmma accumulator, so there into a fresh one, added after."""
    if interpret:
        def scoped(acc_ref):
            mma(acc_ref)
            return acc_ref[...]

        return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(mma)(plgpu.ACC.init(acc))


def stream(n_steps, steps: int, load, released, base=0):
    """The producer warpgroup's ring for one tile: `load(i, slot)` for its steps i = 0 ..
    n_steps - 1, global step base + i going into slot (base + i) % steps once the consumers have
    arrived on every barrier in `released` for the global step that held the slot before (a
    persistent CTA's tiles continue one ring: base counts the steps of its earlier tiles)."""
    @pl.loop(0, n_steps)
    def _(i):
        g = base + i
        slot = lax.rem(g, jnp.int32(steps))

        @pl.when(g >= steps)
        def _():
            for bars in released:
                plgpu.barrier_wait(bars.at[slot])

        load(i, slot)


def wait_last_releases(total, steps: int, released):
    """The releases of the ring's last `steps` global steps (of `total`): nothing needs them, but
    every waiter then sees every phase, and no use of shared memory outlives the CTA."""
    @pl.loop(jnp.maximum(total - steps, 0), total)
    def _(g):
        for bars in released:
            plgpu.barrier_wait(bars.at[lax.rem(g, jnp.int32(steps))])


class RefAccumulators:
    """An online-softmax warpgroup's accumulators in the compiled kernel: scores S and output O
    as wgmma accumulator refs, products issued asynchronously (`score_product(s_ref, i)`,
    `value_product(o_ref, i)`: wgmma calls, one commit group each) and read after
    `wgmma.wait_group wait_n`.  O stays in registers across the loop, products in flight
    between its reads."""

    def __init__(self, s_ref, o_ref, block_m, block_kv, score_product, value_product):
        self.s_ref, self.o_ref = s_ref, o_ref
        self.s_shape = (block_m, block_kv)
        self.score_product, self.value_product = score_product, value_product

    def issue_scores(self, i):
        self.s_ref[...] = plgpu.layout_cast(jnp.full(self.s_shape, 0, jnp.float32), plgpu.Layout.WGMMA)
        self.score_product(self.s_ref, i)

    def scores(self, wait_n):
        return plgpu.wgmma_accumulator_load(self.s_ref, wait_n=wait_n)

    def rescale(self, alpha, wait_n):
        o = plgpu.wgmma_accumulator_load(self.o_ref, wait_n=wait_n)
        self.o_ref[...] = o * lax.broadcast_in_dim(alpha, o.shape, [0])

    def issue_values(self, i):
        self.value_product(self.o_ref, i)


class ValueAccumulators:
    """`RefAccumulators` in the interpreter (which neither stores into an accumulator ref nor
    runs wgmmas asynchronously): each product into a fresh accumulator where it is issued, O a
    loop value."""

    def __init__(self, o, block_m, block_kv, score_product, value_product):
        self.o, self.s = o, None
        self.s_shape = (block_m, block_kv)
        self.score_product, self.value_product = score_product, value_product

    @staticmethod
    def _product(fn, shape, i):
        def scoped(acc_ref):
            fn(acc_ref, i)
            return acc_ref[...]

        return pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32))

    def issue_scores(self, i):
        self.s = self._product(self.score_product, self.s_shape, i)

    def scores(self, wait_n):
        return self.s

    def rescale(self, alpha, wait_n):
        self.o = self.o * lax.broadcast_in_dim(alpha, self.o.shape, [0])

    def issue_values(self, i):
        self.o = self.o + self._product(self.value_product, self.o.shape, i)


def softmax_loop(n, body, init, *, block_m, block_kv, width, score_product, value_product, interpret):
    """`lax.fori_loop(0, n)` of `body(acc, i, *carry) -> carry` over a warpgroup's score and
    output accumulators (`RefAccumulators`; `ValueAccumulators` in the interpreter), O [block_m,
    width] starting at zero -> (O fp32 with every product done, *carry)."""
    zeros = lambda shape: plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), plgpu.Layout.WGMMA)
    if interpret:  # O a loop value, each product computed where it is issued
        def step(i, carry):
            acc = ValueAccumulators(carry[-1], block_m, block_kv, score_product, value_product)
            return (*body(acc, i, *carry[:-1]), acc.o)

        *carry, o = lax.fori_loop(0, n, step, (*init, zeros((block_m, width))))
        return (o, *carry)

    def run(s_ref, o_ref):  # both accumulators in registers across the loop, wgmmas in flight between reads
        o_ref[...] = zeros((block_m, width))
        acc = RefAccumulators(s_ref, o_ref, block_m, block_kv, score_product, value_product)
        carry = lax.fori_loop(0, n, lambda i, c: tuple(body(acc, i, *c)), tuple(init))
        return (plgpu.wgmma_accumulator_load(o_ref, wait_n=0), *carry)

    return pl.run_scoped(run, plgpu.ACC((block_m, block_kv), jnp.float32), plgpu.ACC((block_m, width), jnp.float32))


def fresh(x):
    """x, through an identity LLVM can neither see through nor move out of a loop
    (`lax.optimization_barrier`, which Mosaic GPU lowers to a side-effecting inline asm).  A loop-invariant shared-memory operand indexed by `fresh(0)` inside the loop has its
    wgmma descriptors (one 64-bit value per k-step) computed where the wgmmas issue: indexed by
    a constant, LLVM hoists them all before the loop (the decode's 36 query descriptors; the
    alternating schedule's key slots too, constant there), where they outgrow the register
    file and spill into the accumulators' registers, and ptxas then serializes every wgmma
    (C7514; RESULTS.md, MLA decode, session 36)."""
    return lax.optimization_barrier(x)
