"""The Hopper MLA decode with the score tiles dealt alternately to its two compute warpgroups
(`mla_decode_hopper(..., schedule="alternate")`; FlashMLA's "seesaw" idea).

The default schedule (`mla_decode_hopper._decode_kernel`) gives warpgroup 0 every key tile's scores,
softmax and value half 0, and warpgroup 1 only value half 1: while warpgroup 0 runs a softmax
the tensor cores wait, since warpgroup 1 waits for that softmax's P.  Here warpgroup w computes
the scores and softmax of the key tiles i with i % 2 == w and multiplies every tile's P by its
value half w.  Warpgroup 1 issues its tile's Q K^T before it waits for warpgroup 0's P, so
softmax(a) runs beside Q K(b)^T and softmax(b) beside both P(a) V; warpgroup 0 lets its last
P V finish before it issues Q K(a)^T (a partial wait there would serialize the kernel):

    warpgroup 0, pair j (tiles a = 2j, b = 2j + 1)     warpgroup 1, pair j
    wait P(b - 2) V0; issue Q K(a)^T                    issue Q K(b)^T
    S(a) -> softmax(a) after m(b - 2) -> P(a)           wait P(a); O1 *= alpha(a); issue P(a) V1(a)
    O0 *= alpha(a); issue P(a) V0(a)                    S(b) -> softmax(b) after m(a) -> P(b)
    wait P(b); O0 *= alpha(b); issue P(b) V0(b)         O1 *= alpha(b); issue P(b) V1(b)

The running max passes between them with each P (its rescale factor and new max beside it in
shared memory); each warpgroup sums its own tiles' P rows and rescales that sum by every
tile's factor, and the two sums add at the end.  Shared memory is the default schedule's at
block_kv 64 (queries, a two-slot key ring, one P slot).  Splits hold an even number of key
tiles, but a row tile's last split may hold an odd one: it takes one more, its last tile
again with every score masked (P = 0, the factor 1), which changes no row's answer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.hopper_ring import fresh, set_registers, stream, wait_last_releases
from pallas_kernels.mla import _LOG2E
from pallas_kernels.mla_decode_hopper import DecodeCta, softmax_step


def decode_kernel(bt_ref, len_ref, q_lat_ref, q_pe_ref, pages_ref, o_ref, lse_ref, smem, bars, *, n_heads,
                  n_queries, block_kv, steps, n_splits, rank, scale_log2, interpret, stall_ns=0, cluster=1,
                  descriptors="hoisted"):
    """One CTA: sequence `b`, KV split `split`, 64 folded rows `rows` (`mla_decode_hopper._decode_core`'s
    grid and outputs).  smem: the query parts, the key ring's parts, one P slot, fp32 row vectors
    (alpha, m, l of warpgroup 0, l of warpgroup 1, lse).  cluster 2: row tiles in CTA pairs,
    each key tile multicast into both (as `mla_decode_hopper._decode_kernel`'s)."""
    q_parts, k_parts, p_smem, vec_smem = smem
    alpha_smem, m_smem, lse_smem = vec_smem.at[0], vec_smem.at[1], vec_smem.at[4]
    l_smem = (vec_smem.at[2], vec_smem.at[3])
    q_bars, k_bars, k_used, p_ready, p_free, stats_ready = bars
    wg = lax.axis_index("wg")
    block_m = q_parts[0].shape[1]
    half = rank // 2
    dtype = q_lat_ref.dtype
    # even tile counts per split: only a row tile's last split pads
    cta = DecodeCta.at(len_ref, q_lat_ref, q_pe_ref, pages_ref, block_m=block_m, block_kv=block_kv, n_heads=n_heads,
                       n_queries=n_queries, n_splits=n_splits, rank=rank, cluster=cluster, split_multiple=2)
    b, split, rb, n_steps = cta.b, cta.split, cta.rb, cta.n_steps
    n_pairs = lax.div(n_steps + 1, jnp.int32(2))  # an odd count's last tile comes again, masked
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    slot_of = lambda i: lax.rem(i, jnp.int32(steps))  # constant per pair member at two slots

    @pl.when(wg == 2)
    def _memory():
        set_registers(40, interpret)

        def load(i, slot):  # the padding step: the last tile again
            cta.load_keys(bt_ref, pages_ref, k_parts, k_bars, jnp.minimum(i, n_steps - 1), slot, steps=steps,
                          cluster=cluster)

        stream(2 * n_pairs, steps, load, (k_used,))
        wait_last_releases(2 * n_pairs, steps, (k_used,))

    def compute(w: int):
        """Warpgroup w: the scores of the tiles i = 2j + w, value half w of every tile."""
        set_registers(232, interpret)

        if w == 0:
            cta.load_queries(q_parts, q_bars)
        for i in range(3):
            plgpu.barrier_wait(q_bars.at[i])

        def wait_tile(i):
            for part in range(3):  # every part, by both warpgroups: each sees every phase of each barrier
                plgpu.barrier_wait(k_bars.at[part * steps + slot_of(i)])

        # "in_loop": operands indexed through `fresh`, their descriptors computed where the wgmmas
        # issue (the queries' are loop-invariant and, at two ring slots, each pair member's key slot too)
        pin = fresh if descriptors == "in_loop" else (lambda x: x)

        def score_product(acc_ref, i):
            here, slot = pin(0), pin(slot_of(i))
            for part in range(3):
                plgpu.wgmma(acc_ref, q_parts[part].at[here], k_parts[part].at[slot].transpose((1, 0)))

        def value_product(acc_ref, i):
            plgpu.wgmma(acc_ref, p_smem, k_parts[w].at[pin(slot_of(i))])

        def softmax(s, i, m_prev):
            """Tile i's raw scores after the running max m_prev -> (P, alpha, m)."""
            return softmax_step(cta.mask(s, i, n_heads, n_queries), m_prev, scale_log2)

        def publish(p, alpha, m):
            p_smem[...] = p.astype(dtype)
            alpha_smem[...] = alpha
            m_smem[...] = m
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready.at[w])

        def handed_over_alpha():
            """The factor just published, read back: O's multiplies then wait for a load after
            the hand-over's barrier, so ptxas cannot move them ahead of P's release (as in
            `mla_decode_hopper._decode_kernel`); the other warpgroup overwrites the slot only
            after this warpgroup frees it."""
            return plgpu.load(alpha_smem, layout=row_layout, optimized=False)

        def take(acc, wait_n):
            """The other warpgroup's P: its factor and max; O rescaled (wgmmas but wait_n done)."""
            plgpu.barrier_wait(p_ready.at[1 - w])
            alpha = plgpu.load(alpha_smem, layout=row_layout, optimized=False)
            m = plgpu.load(m_smem, layout=row_layout, optimized=False)
            acc.rescale(alpha, wait_n)
            return alpha, m

        def release_last_pair(j):
            """Warpgroup 1, before its scores: the last pair's second tile is done here (its P and
            its key slot, which the ring's next load into that slot waits for: at two slots the
            scores about to be issued need that very load)."""
            plgpu.wgmma_wait(0)

            @pl.when(j > 0)
            def _():
                plgpu.barrier_arrive(k_used.at[slot_of(2 * j - 1)])
                plgpu.barrier_arrive(p_free.at[1])

        def pair0(acc, j, m_prev, l_w):  # warpgroup 0: own tile a, then warpgroup 1's tile b
            a, bt = 2 * j, 2 * j + 1
            # P(b - 2) V0 done before Q K(a)^T issues, not by a partial wait after it: groups
            # outstanding there would be one in later pairs and none in the first, and ptxas
            # serializes every wgmma of a kernel whose partial wait has no single count (C7514;
            # RESULTS.md, MLA decode, session 36)
            plgpu.wgmma_wait(0)

            @pl.when(j > 0)
            def _():
                plgpu.barrier_arrive(k_used.at[slot_of(a - 1)])

            wait_tile(a)  # its slot last held tile a - steps, released before: no wait on our own release
            acc.issue_scores(a)

            p, alpha, m_a = softmax(acc.scores(0), a, m_prev)
            l_w = l_w * alpha + p.sum(axis=1)

            @pl.when(j > 0)
            def _():
                plgpu.barrier_wait(p_free.at[1])  # warpgroup 1 is done reading P(a - 1)

            publish(p, alpha, m_a)
            acc.rescale(handed_over_alpha(), 0)
            acc.issue_values(a)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(p_free.at[0])
            plgpu.barrier_arrive(k_used.at[slot_of(a)])
            wait_tile(bt)
            alpha_b, m_b = take(acc, 0)
            acc.issue_values(bt)
            return m_b, l_w * alpha_b

        def pair1(acc, j, m_prev, l_w):  # warpgroup 1: own tile b, after warpgroup 0's tile a
            del m_prev  # warpgroup 0's max after tile a comes with P(a)
            a, bt = 2 * j, 2 * j + 1
            release_last_pair(j)
            wait_tile(bt)
            acc.issue_scores(bt)
            wait_tile(a)
            alpha_a, m_a = take(acc, None)  # O has nothing in flight; Q K(b)^T (three groups) runs on
            if stall_ns:  # tests/gpu: late to read P, so only the barriers keep the slot
                pl.delay(stall_ns)
            acc.issue_values(a)
            p, alpha, m_b = softmax(acc.scores(1), bt, m_a)  # P(a) V1 runs on
            l_w = l_w * alpha_a * alpha + p.sum(axis=1)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(k_used.at[slot_of(a)])
            plgpu.barrier_wait(p_free.at[0])  # warpgroup 0 is done reading P(a)
            publish(p, alpha, m_b)
            acc.rescale(handed_over_alpha(), 0)
            acc.issue_values(bt)
            return m_b, l_w

        init = (plgpu.layout_cast(jnp.full((block_m,), -jnp.inf, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.full((block_m,), 0, jnp.float32), row_layout))
        o, m, l_w = softmax_loop(n_pairs, pair0 if w == 0 else pair1, init, block_m=block_m, block_kv=block_kv,
                                 width=half, score_product=score_product, value_product=value_product,
                                 interpret=interpret)

        @pl.when(n_pairs > 0)
        def _():
            plgpu.barrier_arrive(k_used.at[slot_of(2 * n_pairs - 1)])
            if w == 0:
                plgpu.barrier_wait(p_free.at[1])  # the last release of P, which nothing else waits for
            else:
                plgpu.barrier_arrive(p_free.at[1])

        # the two row sums meet; after this barrier no wgmma reads the queries, so the outputs
        # may leave through their buffers
        l_smem[w][...] = l_w
        plgpu.commit_smem()
        plgpu.barrier_arrive(stats_ready)
        plgpu.barrier_wait(stats_ready)
        l_i = (plgpu.load(l_smem[0], layout=row_layout, optimized=False)
               + plgpu.load(l_smem[1], layout=row_layout, optimized=False))
        has = l_i > 0
        inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)  # a split with no keys: zeros
        q_parts[w].at[0][...] = (o * lax.broadcast_in_dim(inv, o.shape, [0])).astype(dtype)
        if w == 0:
            lse_smem[...] = jnp.where(has, (m + jnp.log2(jnp.where(has, l_i, 1.0))) / _LOG2E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_parts[w].at[0],
                                o_ref.at[b, split, pl.ds(rb * block_m, block_m), pl.ds(w * half, half)])
        if w == 0:
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split, pl.ds(rb * block_m, block_m)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 0)
    def _wg0():
        compute(0)

    @pl.when(wg == 1)
    def _wg1():
        compute(1)


class RefAccumulators:
    """A compute warpgroup's accumulators in the compiled kernel: scores S and output O
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


def barriers(steps: int, cluster: int = 1):
    """The kernel's barriers: queries (3), key parts (3 per slot), key slots used (both
    warpgroups, of both CTAs in a cluster), P ready from warpgroup w (2), P free from warpgroup
    w (2), the row sums (both)."""
    used = (plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=2, num_barriers=steps) if cluster > 1
            else plgpu.Barrier(num_arrivals=2, num_barriers=steps))
    return (plgpu.Barrier(num_barriers=3), plgpu.Barrier(num_barriers=3 * steps), used,
            plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_arrivals=2))


VECTORS = 5  # fp32 row vectors: alpha, m, l of each warpgroup, lse
