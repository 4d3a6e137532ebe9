"""A step's execution: the plan the scheduler made, run on the device, and the record of what it produced.

`StepExecutor.execute(plan) -> StepOutput` runs a `serving.scheduler.StepPlan` in order: the
preempted requests' KV offloaded while their freed pages still hold it, the admitted requests'
slots restored (or their offloaded KV installed), the decode rows dispatched, the prefill chunks
run (their snapshots exported and published, a finished prompt's first token chosen).  What it
produced comes back as a `StepOutput` (tokens per request, requests handed over), which
`Scheduler.update_from_output` applies; the executor itself never emits a token nor finishes a
request.

A decode step's tokens are read (its one wait on the device) as late as possible: a decode-only
plan leaves them in flight (`in_flight`), and the next plan either builds on them on the device
(a chained plan, `Scheduler.chain_plan`: its output holds the previous step's tokens) or reads
them first (`settle`).

A request's own host-side work (choosing its token on the host, its logprobs, its decode row, its
images' encoder pass, a draft's bookkeeping, the P/D hook) runs isolated: if it raises, the
`fail` hook ends that request alone (`Engine.fail_request`) and the step goes on for the others.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_pool import NULL_BLOCK
from kimik3 import tokenizer
from serving.decode_runner import DecodeRows, decode_logprobs
from serving.request import Request
from serving.sampling import TokenLogprobs, choose_token, logprobs_of
from serving.scheduler import PrefillChunk, StepOutput, StepPlan

__all__ = ["StepExecutor", "StepOutput", "FAILED"]

FAILED = object()  # what `StepExecutor.isolated` returns for work that failed its request


@dataclasses.dataclass
class _InFlight:
    """A dispatched decode step not read yet: its requests, its rows (`DecodeRows`, or a
    speculative round's record), its device tokens (and logprobs), its dispatch id, mixed."""

    reqs: list[Request]
    rows: object
    tokens: object
    dispatch_id: int
    mixed: bool


class StepExecutor:
    """Runs plans on an engine's device pieces (its runner, pools, managers, draft).

    engine: the `serving.engine.Engine` whose pieces run the plans; fail: callable(request, error)
    that ends a request alone."""

    def __init__(self, engine, fail: Callable[[Request, BaseException], None]):
        self.eng = engine
        self.fail = fail
        self.wait_s = 0.0  # time spent waiting on the device since the engine last reset it
        self._inflight: _InFlight | None = None

    # ---- what the scheduler plans with -----------------------------------------------------------
    @property
    def in_flight(self) -> list[Request] | None:
        """The requests of the decode step dispatched and not read yet (None: none is)."""
        return None if self._inflight is None else self._inflight.reqs

    def isolated(self, req: Request, fn, *args, **kw):
        """fn(*args, **kw), a piece of `req`'s own host-side work: its result, or `FAILED` when it
        raised (then `req` has ended alone through the `fail` hook)."""
        try:
            return fn(*args, **kw)
        except Exception as err:  # noqa: BLE001 - the request's failure is the request's
            self.fail(req, err)
            return FAILED

    def wait_for(self, arrays) -> None:
        """Block until `arrays` (a pytree) are computed, the time counted as the step's wait on
        the device (`serving.metrics.StepProfile`), not its host work."""
        t0 = time.perf_counter()
        jax.block_until_ready(arrays)
        self.wait_s += time.perf_counter() - t0

    # ---- a plan ------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run `plan`; its decode tokens stay in flight when the plan is decode-only (a chained
        plan's output holds the tokens of the step it was chained on)."""
        out = StepOutput()
        if plan.chained:
            self._chain_decode(plan.decode, out)
            return out
        eng = self.eng
        for p in plan.preempted:  # their freed pages still hold their KV until this step runs
            if p.offload_keys is not None:
                pages, state = eng.kvs[p.rank].read_kv(list(p.page_table), p.cached_len, p.slot)
                if all(eng.manager.host.batch_put(list(p.offload_keys), pages + [state])):
                    p.request.offload_keys = list(p.offload_keys)
                else:
                    eng.manager.host.remove(list(p.offload_keys))
        for a in plan.admitted:
            if a.resume_kv is not None:
                self.install_kv(a.request, a.blocks, *a.resume_kv)
            else:
                eng.kv_of(a.request).restore_state(a.request.slot, a.blocks.snapshot_block)
            a.restored(eng.manager_of(a.request))
            if eng.spec is not None:
                self.isolated(a.request, eng.spec.on_admit, eng, a.request, a.blocks)
        decode = [r for r in plan.decode if not r.done]  # less any that failed alone above
        if decode or eng.group:  # a group's engines decode together, with padding rows if idle
            self._decode(decode, bool(plan.prefill), out)
        batches: dict[tuple[int, int], list[PrefillChunk]] = {}
        for chunk in plan.prefill:
            if chunk.request.done:  # failed alone earlier in this step
                continue
            if chunk.sharded and eng.config.prefill_batch > 1:  # run below, with the rank's others of its length
                batches.setdefault((chunk.request.rank, chunk.tokens), []).append(chunk)
            else:
                self._run_chunk(chunk, out)
        for chunks in batches.values():
            for i in range(0, len(chunks), eng.config.prefill_batch):
                self._run_sharded_batch(chunks[i : i + eng.config.prefill_batch], out)
        if not plan.decode_only:  # read this step's decode tokens now (no step is chained on them)
            out.extend(self.settle())
        return out

    # ---- prefill ---------------------------------------------------------------------------------
    def _run_chunk(self, chunk: PrefillChunk, out: StepOutput) -> None:
        eng = self.eng
        req, start, end = chunk.request, chunk.start, chunk.end
        ctx = req.context
        tokens = np.asarray([ctx[start:end]], np.int32)
        images = None
        if req.images is not None and start < len(req.prompt) and tokenizer.IMAGE_ID in ctx[start:end]:
            if req.image_rows is None:  # the ViT runs once per request, at its first image chunk
                rows = self.isolated(req, eng.image_rows, req)
                if rows is FAILED:
                    return
                req.image_rows = rows
            # this chunk's placeholders take the rows after those of earlier chunks
            images = {"rows": req.image_rows, "first": jnp.int32(ctx[:start].count(tokenizer.IMAGE_ID))}
        step = eng.runner.prefill_step if chunk.sharded else None
        logits, exports, *tapped = eng.runner.forward(
            eng.kv_of(req),
            tokens,
            [self.table_of(req)],
            [req.slot],
            [start],
            step=step,
            images=images,
            export_offsets=[b - start for b in chunk.export],
        )
        if eng.spec is not None and self.isolated(req, eng.spec.after_chunk, eng, req, start, end, tapped[0]) is FAILED:
            return
        self._chunk_done(chunk, self._last_logits(chunk.last, logits)[0], exports, out)

    def _run_sharded_batch(self, chunks: list[PrefillChunk], out: StepOutput) -> None:
        """Sharded chunks of one rank and one length as one call on the prefill mesh, padded to a
        power of two with rows of the scratch slot and null pages (which write only those)."""
        eng = self.eng
        pad = (1 << (len(chunks) - 1).bit_length()) - len(chunks)
        reqs = [c.request for c in chunks]
        tokens = np.asarray(
            [r.context[c.start : c.end] for r, c in zip(reqs, chunks)] + [[0] * chunks[0].tokens] * pad, np.int32
        )
        tables = [self.table_of(r) for r in reqs] + [[NULL_BLOCK] * eng.max_pages] * pad
        slots = [r.slot for r in reqs] + [eng.scratch_slot] * pad
        starts = [c.start for c in chunks] + [0] * pad
        logits, _ = eng.runner.forward(eng.kv_of(reqs[0]), tokens, tables, slots, starts, step=eng.runner.prefill_step)
        eng.prefill_batches[len(chunks)] += 1
        for chunk, row in zip(chunks, self._last_logits(any(c.last for c in chunks), logits)):
            self._chunk_done(chunk, row, None, out)

    def _last_logits(self, needed: bool, logits):
        """A prefill call's last-position logits ([B, 1, V] on the device) as numpy f32 [B, V] where
        a chunk ends its prompt (its first token is chosen from them: the wait counts as the
        device's), else [None] * B: an intermediate chunk's logits are never read, so the host goes
        on while the device computes it."""
        if not needed:
            return [None] * logits.shape[0]
        self.wait_for(logits)
        return np.asarray(logits, np.float32)[:, -1]

    def _chunk_done(self, chunk: PrefillChunk, logits_v, exports, out: StepOutput) -> None:
        """A chunk's KV is in the pools: publish its pages and snapshots, and with the last chunk
        choose the request's first token (logits_v f32 [V]: its last position's; None unless last)."""
        req, end = chunk.request, chunk.end
        kv, manager = self.eng.kv_of(req), self.eng.manager_of(req)
        manager.commit_pages(req.request_id, end)
        blocks = manager.requests[req.request_id]  # each commit publishes the checkpoint block
        for i, boundary in enumerate(chunk.export):  # and gives the request a fresh one: re-read it
            kv.save_export(exports, i, blocks.checkpoint_block)
            manager.commit_snapshot(req.request_id, boundary)
        if chunk.snapshot_at_end:
            kv.save_state(req.slot, blocks.checkpoint_block)
            manager.commit_snapshot(req.request_id, end)
        if chunk.last:
            req.kv_len = end
            self.isolated(req, self._first_token, req, logits_v, out)

    def _first_token(self, req: Request, logits_v, out: StepOutput) -> None:
        """Choose a prefilled request's first token from its last position's logits (f32 [V]): an
        output token, or (a prefill engine with `on_prefilled`) the token it is handed over with."""
        eng = self.eng
        token, lp = self.choose(req, logits_v)
        if eng.role == "prefill" and eng.on_prefilled is not None:
            req.output.append(token)
            req.token_times_s.append(time.monotonic())
            req.token_mixed.append(True)
            if req.sampling.logprobs is not None:
                req.logprobs.append(lp)
            if eng.spec is not None:
                eng.spec.write_last_slot(eng, req, token)
            eng.on_prefilled(eng, req)  # hands the KV over while this engine still holds it
            out.handed_over.append(req)
        else:
            out.tokens.append((req, token, True, lp))

    # ---- decode ----------------------------------------------------------------------------------
    def _decode(self, reqs: list[Request], mixed: bool, out: StepOutput) -> None:
        """Dispatch one token for each of `reqs` (pages already extended by the scheduler), read by
        the next plan (or at this one's end)."""
        eng = self.eng
        if eng.spec is not None:  # a verify round
            rnd = eng.spec.dispatch(eng, reqs)
            self._inflight = _InFlight(reqs, rnd, rnd["out"], rnd["id"], mixed)
            return
        if eng.runner.decode_step is not None:  # a decode mesh: every rank on its own pools, synchronous
            self._decode_ranks(reqs, mixed, out)
            return
        try:
            rows = self.decode_rows(reqs, [r.output[-1] for r in reqs])
        except Exception:  # noqa: BLE001 - a row that cannot be built fails its request alone
            reqs = [r for r in reqs if self.isolated(r, self.decode_rows, [r], [r.output[-1]]) is not FAILED]
            if not reqs:
                return
            rows = self.decode_rows(reqs, [r.output[-1] for r in reqs])
        # the penalties count the output before the step's input token (output[-1]: the step counts it)
        eng.pools, tokens, did, lp = eng.runner.decode.dispatch(
            eng.params, eng.pools, rows, histories=self._histories(reqs, chained=False)
        )
        for r in reqs:
            r.kv_len += 1
        self._inflight = _InFlight(reqs, rows, (tokens, lp), did, mixed)

    def _decode_ranks(self, reqs: list[Request], mixed: bool, out: StepOutput) -> None:
        """One decode-mesh step: each rank's requests in its block of `rank_rows` rows, padded with
        rows of its scratch slot and null pages (ids in its own pools)."""
        eng = self.eng
        per_rank = [[r for r in reqs if r.rank == k] for k in range(len(eng.kvs))]
        n = max(map(len, per_rank))
        if eng.group:  # every rank of the group runs the fullest rank's rows
            from sharding.distributed import agree_max  # loads only in a process group

            (n,) = agree_max([n])
        if n == 0:
            return
        b = eng.runner.rank_rows(n)
        tokens, tables, slots, lengths, where = [], [], [], [], []
        for k, rs in enumerate(per_rank):
            pad = b - len(rs)
            tokens += [[r.output[-1]] for r in rs] + [[0]] * pad
            tables += [self.table_of(r) for r in rs] + [[NULL_BLOCK] * eng.max_pages] * pad
            slots += [r.slot for r in rs] + [eng.scratch_slot] * pad  # padding rows share the scratch slot
            lengths += [r.kv_len for r in rs] + [0] * pad
            where += [(r, k * b + i) for i, r in enumerate(rs)]
        # greedy rows without penalties or logprobs need only the argmax the devices took
        plain = lambda r: r.sampling.greedy and not r.sampling.penalized and r.sampling.logprobs is None
        greedy, logits = eng.runner.decode_ranks(
            eng.kvs,
            np.asarray(tokens, np.int32),
            np.asarray(tables, np.int32),
            np.asarray(slots, np.int32),
            np.asarray(lengths, np.int32),
            logits=not all(plain(r) for r, _ in where),
        )
        for r, row in where:
            r.kv_len += 1
            if plain(r):
                out.tokens.append((r, int(greedy[row]), mixed, None))
            else:
                self.isolated(r, self._chosen, r, logits[row], mixed, out)

    def _chosen(self, req: Request, logits_v, mixed: bool, out: StepOutput) -> None:
        token, lp = self.choose(req, logits_v)
        out.tokens.append((req, token, mixed, lp))

    def _chain_decode(self, reqs: list[Request], out: StepOutput) -> None:
        """Dispatch the next decode step of `reqs` on the in-flight step's device tokens (pages
        extended by `Scheduler.chain_plan`), then read the in-flight step's tokens into `out`."""
        eng = self.eng
        if eng.spec is not None:
            rnd = eng.spec.dispatch(eng, reqs, chained=True)
            previous, self._inflight = self._inflight, _InFlight(reqs, rnd, rnd["out"], rnd["id"], False)
            self._resolve(previous, out, successor=rnd)
            return
        rows = self.decode_rows(reqs, tokens=[0] * len(reqs))  # tokens: the device's, from the step in flight
        # the input token is the in-flight step's: the whole output so far comes before it
        eng.pools, tokens, did, lp = eng.runner.decode.dispatch(
            eng.params, eng.pools, rows, tokens_on_device=True, histories=self._histories(reqs, chained=True)
        )
        for r in reqs:
            r.kv_len += 1
        previous, self._inflight = self._inflight, _InFlight(reqs, rows, (tokens, lp), did, False)
        self._resolve(previous, out)

    def settle(self) -> StepOutput:
        """The in-flight decode step's tokens (waits for them), if one is in flight."""
        out = StepOutput()
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._resolve(previous, out)
        return out

    def _resolve(self, inflight: _InFlight, out: StepOutput, successor=None) -> None:
        """A dispatched decode step's tokens into `out` (waits for them)."""
        eng = self.eng
        self.wait_for(inflight.tokens)
        if eng.spec is not None:  # rows: the round's record
            out.tokens += eng.spec.resolve(eng, inflight.rows, successor, inflight.mixed)
            return
        tokens, lp = inflight.tokens
        tokens = np.asarray(tokens)
        eng.runner.decode.settle(inflight.rows, tokens, inflight.dispatch_id)
        lps = decode_logprobs(inflight.rows, lp) if lp is not None else [None] * len(inflight.reqs)
        out.tokens += [(r, int(t), inflight.mixed, e) for r, t, e in zip(inflight.reqs, tokens, lps)]

    @staticmethod
    def _histories(reqs: list[Request], *, chained: bool):
        """Per request with penalties, (its record, how many tokens it generated before the step's
        input token, a function giving them) (`DecodeRunner.dispatch`; the list is built only when
        the slot's counts must be rewritten): all of them when the input is the in-flight step's
        token, all but the last otherwise."""

        def entry(r):
            n = r.prior_output + len(r.output) - (0 if chained else 1)
            return r, n, lambda: r.generated()[:n]

        return [entry(r) if r.sampling.penalized else None for r in reqs]

    def decode_rows(self, reqs: list[Request], tokens: list[int]) -> DecodeRows:
        """The decode rows of `reqs` with input `tokens`, padded to the bucket of their count."""
        eng = self.eng
        return DecodeRows.build(
            eng.runner.decode_bucket(len(reqs)),
            tokens,
            [self.table_of(r) for r in reqs],
            [r.slot for r in reqs],
            [r.kv_len for r in reqs],
            [r.sampling for r in reqs],
            max_pages=eng.max_pages,
            null_page=NULL_BLOCK,
            scratch_slot=eng.scratch_slot,
        )

    # ---- KV in (offload resume, P/D handoff) -------------------------------------------------------
    def install_kv(self, req: Request, blocks, pages: list[np.ndarray], state: np.ndarray) -> None:
        """Write a request's page contents (those not already shared through its prefix hit) and
        its KDA state after `len(req.context)` tokens into the pools and its slot."""
        eng = self.eng
        first_new = blocks.hit.tokens // eng.page_tokens  # hit pages are shared: never written
        new_pages = blocks.page_table[first_new : len(pages)]
        kv = eng.kv_of(req)
        if new_pages:
            kv.pages.write(new_pages, pages[first_new : first_new + len(new_pages)])
        eng.manager_of(req).commit_pages(req.request_id, len(req.context))
        kv.write_snapshot(blocks.checkpoint_block, state)
        kv.restore_state(req.slot, blocks.checkpoint_block)

    def table_of(self, req: Request) -> list[int]:
        """`req`'s page table, padded with the null page to the engine's `max_pages`."""
        table = self.eng.manager_of(req).requests[req.request_id].page_table
        return table + [NULL_BLOCK] * (self.eng.max_pages - len(table))

    @staticmethod
    def choose(req: Request, logits_v: np.ndarray) -> tuple[int, TokenLogprobs | None]:
        """The next token of `req` (its absolute position seeds a sampled draw; its output so far
        counts for the penalties), and its logprobs if the request asked for them."""
        token = choose_token(
            logits_v, req.sampling, len(req.prompt) + len(req.output), req.generated() if req.sampling.penalized else ()
        )
        k = req.sampling.logprobs
        return token, None if k is None else logprobs_of(logits_v, token, k)
