"""What the Hopper (sm_90a) Mosaic GPU kernels of this package share: the register split
between warp-specialized warpgroups, wgmma accumulation in place, `fresh` (an index LLVM
cannot hoist), and the producer warpgroup's TMA ring over `steps` shared-memory slots."""

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


def fresh(x):
    """x, through an identity LLVM can neither see through nor move out of a loop
    (`lax.optimization_barrier`, which Mosaic GPU lowers to a side-effecting inline asm).  A
    loop-invariant shared-memory operand indexed by `fresh(0)` inside the loop has its wgmma
    descriptors (one 64-bit value per k-step) computed where the wgmmas issue: indexed by a
    constant, LLVM hoists them all before the loop (the decode's 36 query descriptors), where
    they outgrow the register file beside the accumulators and spill (ptxas: 144 bytes in the
    decode; RESULTS.md, MLA kernels)."""
    return lax.optimization_barrier(x)
