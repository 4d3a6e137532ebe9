"""EAGLE-3 speculative decoding in the serving engine: the draft's paged KV and the round.

The draft head (`kimik3.eagle`) keeps its MLA latent rows in a pool of its own, indexed by the
target's page ids (a request's draft rows live on its target block table; a prefix hit that
shares the target's pages shares the draft rows written with them, and `serving.kv_pools`'s
page blocks carry both to the host tier).  Draft slot i reads (g_i, x_{i+1}): the fused target
taps at position i and the token after it, so slot i can be written only once x_{i+1} is
known.  Per running request (its KDA slot) the engine keeps the fused features of the slots
not written yet, `pending` [k + 1, D], and how many there are (1 .. k + 1).

A decode round for a batch is one program (`spec_step`), from L committed tokens and t0 (the
last emitted token, at position L)::

    catch-up   the pending slots L - c .. L - 1 on the target's features: draft rows final
    chain      d_1 from slot L - 1, then slots L .. L + k - 2 on the draft's own hidden states
               (rows overwritten by the next catch-up)
    verify     the target over [t0, d_1 .. d_k] at L .. L + k in one pass: KDA at one token a
               chunk, exporting its state after each token; MLA rows written; logits [B, k + 1, V]

    accept     `accept_on_device`: `kimik3.speculative.accept`'s rule (greedy, or rejection
               sampling, so every emitted token is distributed as the target's)
    commit     each KDA layer's state and conv rows after the a + 1 kept tokens into the slot,
               the kept positions' features as the next round's pending ones

    advance    the round's own rows for the next one (t0, L + a + 1, the emitted tokens as the next
               catch-up: `advance_rows`), so the engine dispatches round n + 1 on them before the
               host reads round n (`SpecDecoder.dispatch` / `resolve`, as the plain engine chains
               its decode steps); the host writes rows only where they changed (a new page, a
               request joining or leaving)

and the host reads the kept tokens and a (B x (k + 2) int32), its one wait per round, while the
next round runs.  MLA rows past the new length are never read (each lies after every later
query and is overwritten by the next verify).  The verify pass's KDA is the recurrent kernel on
the state pool by slot, exporting every token's state (`kimik3.ops.kda` at chunk size 1).

Prefill chunks tap the target too (`kimik3.model.paged_step(..., taps=...)`): after each chunk
the draft writes the rows of slots start - 1 .. end - 2 and keeps slot end - 1 pending
(`prefill_draft`).  After a prefix hit of h tokens (`tail` rule, `TAIL_MODES`): "drop" (the
manager's hit excludes the last matched page: its draft rows are recomputed with the target
over it), "no_drop" (the matched draft rows are kept, the tail slot h - 1 as it was written:
for another continuation it may be stale, which costs acceptance, never tokens), "exact" (the
page is kept and only slot h - 1 is recomputed, from the fused feature every page keeps of its
last slot (`tail_g`), into a private copy of the page's draft rows).  Drop does not shut out
staleness entirely (nor does vLLM's rule): the page it keeps last ends on a slot that reads the
first token of the dropped page, and that slot was written by whichever request published the
kept page, whose next page may have differed.  Only "exact" recomputes the slot a hit ends on.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_pool import NULL_BLOCK, NoFreeBlocks
from kimik3 import eagle, speculative
from kimik3.config import ModelConfig
from serving.decode_runner import _overwrite, refresh_rows
from serving.sampling import seed_words
from serving.spec_programs import (
    TAIL_MODES,
    prefill_draft,
    write_slot,
    set_pending,
    copy_draft_page,
    DEVICE_KEYS,
    spec_step,
    advance_rows,
    catch_up_tokens,
    prefill_draft_tokens,
    draft_fingerprint,
)


@dataclasses.dataclass
class SpecStats:
    rounds: int = 0  # verify passes (per request row)
    drafted: int = 0
    kept: int = 0
    chained: int = 0  # batched rounds dispatched before the round before them was read
    # host seconds of each batched round (the latest; a long-running server keeps no more)
    round_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=4096))

    @property
    def acceptance(self) -> float:
        return self.kept / self.drafted if self.drafted else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify pass (kept drafts + the target's own)."""
        return (self.kept + self.rounds) / self.rounds if self.rounds else 0.0


class SpecDecoder:
    """The engine's speculative decoding: the draft, its pools' bookkeeping, and the round (see
    the module docstring).  The engine calls `on_admit` after a request's slot is restored,
    `after_chunk` after each prefill chunk, and `decode` for the decode rows of a step."""

    def __init__(
        self, draft, ecfg: eagle.EagleConfig, cfg: ModelConfig, *, k: int, tail: str, kernels: str, page_tokens: int
    ):
        speculative.check_draft(cfg, ecfg, draft, k)
        if tail not in TAIL_MODES:
            raise ValueError(f"eagle_tail must be one of {TAIL_MODES}; got {tail!r}")
        self.draft = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), draft)
        self.ecfg, self.cfg, self.k, self.tail, self.kernels = ecfg, cfg, k, tail, kernels
        self.page_tokens = page_tokens
        self.taps = tuple(ecfg.taps)
        self.fingerprint = draft_fingerprint(draft)
        self.stats = SpecStats()
        # per decode bucket: the rows on the device, what the host knows they hold (None for the
        # entries a round in flight is advancing), and the id of the latest round dispatched on them
        self._io: dict[int, dict] = {}
        self._held: dict[int, dict | None] = {}
        self._last: dict[int, int] = {}
        self._dispatched = 0
        self._resolved_s = None  # when the latest round was read (chained rounds' period)
        self.overwrites = 0  # rounds whose rows had to be (partly) written from the host

    def _mark_tails(self, kv, table: list[int], first: int, count: int) -> None:
        """Slots first .. first + count - 1 were written on target features: the pages they end
        now hold their tail feature (`KVPools.tail_known`)."""
        p = self.page_tokens
        for end in range(-(-(first + 1) // p) * p, first + count + 1, p):  # slot end - 1 ends a page
            kv.tail_known[table[(end - 1) // p]] = True

    def programs(self) -> int:
        """Compiled speculative programs so far (rounds per bucket, prefill drafting per chunk length)."""
        return sum(f._cache_size() for f in (spec_step, prefill_draft, write_slot, set_pending, copy_draft_page))

    def warmup(self, eng) -> int:
        """Compile and run once, on scratch rows, the round of every decode bucket and the
        drafting of every prefill chunk length.  Returns the number of new programs."""
        before = self.programs()
        # a P/D prefill engine never decodes: no rounds to compile
        buckets = (
            []
            if eng.role == "prefill"
            else sorted({eng.runner.decode_bucket(n) for n in range(1, eng.scratch_slot + 1)})
        )
        for bucket in buckets:
            rows = self._rows(eng, [], bucket)
            eng.kv.pools, eng.kv.dpools, io, out = spec_step(
                eng.params,
                self.draft,
                eng.kv.pools,
                eng.kv.dpools,
                self._place(eng, rows),
                cfg=self.cfg,
                kernels=self.kernels,
                taps=self.taps,
                k=self.k,
                page_tokens=self.page_tokens,
            )
            # the two writes `_buffers` makes (a chained round's entries, every entry); the
            # buffers are left holding `rows`
            io = _overwrite(io, self._place(eng, {key: v for key, v in rows.items() if key not in DEVICE_KEYS}))
            self._io[bucket], self._held[bucket] = _overwrite(io, self._place(eng, rows)), rows
            jax.block_until_ready(self._io[bucket])
        null = jnp.full((eng.max_pages,), NULL_BLOCK, jnp.int32)
        for t, step in eng.runner.prefill_lengths():
            if step is None:
                taps = jax.device_put(
                    jnp.zeros((1, t, len(self.taps), self.cfg.d_model), eng.dtype),
                    eng.kv.dpools["pending"].devices().pop(),
                )  # committed, as a chunk's are
                eng.kv.dpools = prefill_draft(
                    self.draft,
                    eng.params["embed_vd"],
                    eng.kv.dpools,
                    taps,
                    jnp.zeros((1, t), jnp.int32),
                    jnp.int32(0),
                    jnp.int32(0),
                    jnp.bool_(False),
                    jnp.int32(eng.scratch_slot),
                    null,
                    cfg=self.cfg,
                    kernels=self.kernels,
                    page_tokens=self.page_tokens,
                )
        scratch, page = jnp.int32(eng.scratch_slot), jnp.int32(NULL_BLOCK)  # the exact rule's and adopt's moves
        if eng.role == "prefill":  # its last prompt slots (`write_last_slot`)
            eng.kv.dpools = write_slot(
                self.draft,
                eng.params["embed_vd"],
                eng.kv.dpools,
                scratch,
                jnp.int32(0),
                jnp.int32(0),
                null,
                cfg=self.cfg,
                kernels=self.kernels,
                page_tokens=self.page_tokens,
            )
        eng.kv.dpools = copy_draft_page(eng.kv.dpools, page, page)
        eng.kv.dpools = set_pending(eng.kv.dpools, scratch, jnp.zeros((self.cfg.d_model,), jnp.float32))
        jax.block_until_ready(eng.kv.dpools["pending"])
        return self.programs() - before

    # ---- admission ---------------------------------------------------------------------------
    def on_admit(self, eng, req, blocks) -> None:
        """A request's slot was restored after a prefix hit of blocks.hit.tokens (h): with the
        "exact" rule the tail slot h - 1 is recomputed into a private copy of its page's draft rows."""
        req.draft_pending, req.draft_table, req.tail_recomputed = 0, None, False
        h = blocks.hit.tokens
        if h == 0 or self.tail != "exact":
            return
        idx = h // self.page_tokens - 1
        shared = blocks.page_table[idx]
        if not eng.kv.tail_known[shared]:
            return  # its feature did not travel with the page: kept as written (as no_drop)
        try:
            (private,) = eng.manager.page_pool.allocate(1)
        except NoFreeBlocks:  # no free page: kept as written
            return
        req.extra_pages.append(private)
        eng.kv.dpools = copy_draft_page(eng.kv.dpools, jnp.int32(shared), jnp.int32(private))
        eng.kv.dpools = set_pending(eng.kv.dpools, jnp.int32(req.slot), eng.kv.dpools["tail_g"][shared])
        table = list(blocks.page_table)
        table[idx] = private
        req.draft_table = table
        req.draft_pending, req.tail_recomputed = 1, True

    def adopted(self, eng, req, feature) -> None:
        """A handed-over request (`Engine.adopt`): its pages carry the draft's rows of slots
        0 .. n - 2; slot n - 1 waits on `feature` and the first token."""
        req.draft_table, req.tail_recomputed = None, False
        eng.kv.dpools = set_pending(eng.kv.dpools, jnp.int32(req.slot), jnp.asarray(feature, jnp.float32))
        req.draft_pending = 1

    def draft_table(self, eng, req) -> list[int]:
        table = eng.table_of(req)
        if req.draft_table is not None:
            table[: len(req.draft_table)] = req.draft_table
        return table

    # ---- prefill -----------------------------------------------------------------------------
    def after_chunk(self, eng, req, start: int, end: int, taps) -> None:
        """The draft rows of a prefill chunk [start, end) of req.context (taps [1, T, 3, D])."""
        from_prev = req.draft_pending > 0
        toks, count = prefill_draft_tokens(req.context, start, end, from_prev, taps.shape[1])
        table = self.draft_table(eng, req)
        p = self.page_tokens
        eng.kv.tail_known[np.asarray(table[start // p : -(-end // p)], np.int64)] = False  # written anew here
        eng.kv.dpools = prefill_draft(
            self.draft,
            eng.params["embed_vd"],
            eng.kv.dpools,
            taps,
            jnp.asarray([toks], jnp.int32),
            jnp.int32(start),
            jnp.int32(end - start),
            jnp.bool_(from_prev),
            jnp.int32(req.slot),
            jnp.asarray(table, jnp.int32),
            cfg=self.cfg,
            kernels=self.kernels,
            page_tokens=self.page_tokens,
        )
        self._mark_tails(eng.kv, table, start - 1 if from_prev else start, count)
        req.draft_pending = 1

    def write_last_slot(self, eng, req, token: int) -> None:
        """A prefill engine's request, prefilled: its last prompt slot n - 1 waits on the token after
        the prompt, which the engine has now sampled.  A decode engine writes that slot in its
        first round; a prefill engine decodes nothing, so it writes it here: its prefix cache
        then holds the page whole (a later hit there reads a written row, and the exact rule
        finds the page's tail feature)."""
        n = len(req.context)
        if n % self.page_tokens:
            return  # the slot lies in a partial page, which no prefix hit can reach
        table = self.draft_table(eng, req)
        eng.kv.dpools = write_slot(
            self.draft,
            eng.params["embed_vd"],
            eng.kv.dpools,
            jnp.int32(req.slot),
            jnp.int32(n - 1),
            jnp.int32(token),
            jnp.asarray(table, jnp.int32),
            cfg=self.cfg,
            kernels=self.kernels,
            page_tokens=self.page_tokens,
        )
        self._mark_tails(eng.kv, table, n - 1, 1)

    # ---- decode ------------------------------------------------------------------------------
    def _rows(self, eng, reqs, bucket: int) -> dict:
        """A round's inputs for `reqs`, padded to `bucket` rows (scratch slot, null pages, inactive)."""
        k, pad = self.k, bucket - len(reqs)
        null = [NULL_BLOCK] * eng.max_pages
        return {
            "t0": np.asarray([r.output[-1] for r in reqs] + [0] * pad, np.int32),
            "lengths": np.asarray([r.kv_len for r in reqs] + [1] * pad, np.int32),
            "catch_n": np.asarray([r.draft_pending for r in reqs] + [1] * pad, np.int32),
            "catch_tokens": np.asarray(
                [catch_up_tokens(r.prompt, r.output, r.kv_len, r.draft_pending, k + 1) for r in reqs]
                + [[0] * (k + 1)] * pad,
                np.int32,
            ),
            "tables": np.asarray([eng.table_of(r) for r in reqs] + [null] * pad, np.int32),
            "draft_tables": np.asarray([self.draft_table(eng, r) for r in reqs] + [null] * pad, np.int32),
            "slots": np.asarray([r.slot for r in reqs] + [eng.scratch_slot] * pad, np.int32),
            "active": np.asarray([1] * len(reqs) + [0] * pad, np.int32),
            "temperature": np.asarray([r.sampling.temperature for r in reqs] + [0.0] * pad, np.float32),
            "seed": np.asarray([seed_words(r.sampling.seed) for r in reqs] + [(0, 0)] * pad, np.uint32),
        }

    @staticmethod
    def _place(eng, rows: dict) -> dict:
        """rows on the pools' device (speculation runs on one), committed as every later round's
        rows are: one program per bucket, not one per placement."""
        return jax.device_put(rows, next(iter(eng.kv.dpools["pending"].devices())))

    def _buffers(self, eng, rows: dict, chained: bool) -> dict:
        """The bucket's rows on the device; where any entry of `rows` differs from what they hold,
        the whole group is written in (chained: all but the device-advanced entries, which the
        round in flight leaves)."""
        bucket = len(rows["slots"])
        io, held = self._io.pop(bucket, None), self._held.get(bucket)
        if chained and io is None:
            raise RuntimeError(f"no earlier round of bucket {bucket} to chain on")
        if io is None:
            self.overwrites += 1
            return self._place(eng, rows)
        keys = [key for key in rows if not (chained and key in DEVICE_KEYS)]
        io, wrote = refresh_rows(io, held, rows, keys, place=lambda v: self._place(eng, v))
        self.overwrites += wrote
        return io

    def dispatch(self, eng, reqs, chained: bool = False):
        """Enqueue one verify round for `reqs` (pages extended for it: by the scheduler, or for a
        chained round by `Scheduler.chain_plan`) without waiting; chained: on the rows the round
        in flight leaves on the device (its tokens not read yet).  Returns the in-flight record
        for `resolve`."""
        rows = self._rows(eng, reqs, eng.runner.decode_bucket(len(reqs)))
        if chained:
            rows = dict(rows, **{key: None for key in DEVICE_KEYS})  # filled when the round before is read
        io = self._buffers(eng, rows, chained)
        eng.kv.pools, eng.kv.dpools, io, out = spec_step(
            eng.params,
            self.draft,
            eng.kv.pools,
            eng.kv.dpools,
            io,
            cfg=self.cfg,
            kernels=self.kernels,
            taps=self.taps,
            k=self.k,
            page_tokens=self.page_tokens,
        )
        bucket = len(rows["slots"])
        self._dispatched += 1
        self.stats.chained += int(chained)
        # the round advances DEVICE_KEYS: unknown until it is read
        self._io[bucket], self._last[bucket] = io, self._dispatched
        self._held[bucket] = dict(rows, **{key: None for key in DEVICE_KEYS})
        return {
            "reqs": list(reqs),
            "rows": rows,
            "out": out,
            "id": self._dispatched,
            "chained": chained,
            "t": time.perf_counter(),
        }

    def resolve(self, eng, rnd: dict, successor: dict | None = None, mixed: bool = False) -> list[tuple]:
        """Read a dispatched round (its one wait on the device): each request's kept drafts and the
        target's next token, as (request, token, mixed, None) in order (`StepOutput.tokens`: the
        scheduler drops those after a request's end); successor: the round chained on it, whose
        device-advanced rows this one's tokens determine.  Requests that ended since (EOS,
        cancellation) get none."""
        k, rows = self.k, rnd["rows"]
        out = np.asarray(rnd["out"])
        now = time.perf_counter()
        after = advance_rows(rows, out, k)
        if successor is not None:
            successor["rows"].update({key: after[key] for key in DEVICE_KEYS})
        if self._last.get(len(rows["slots"])) == rnd["id"]:
            self._held[len(rows["slots"])] = after
        keep = out[:, k + 1] + 1
        emitted = []
        for i, r in enumerate(rnd["reqs"]):
            if r.done or r not in eng.running:
                continue
            self._mark_tails(eng.kv, self.draft_table(eng, r), r.kv_len - r.draft_pending, r.draft_pending)
            r.kv_len += int(keep[i])
            r.draft_pending = int(keep[i])
            r.accepted.append(int(keep[i]) - 1)
            self.stats.rounds += 1
            self.stats.drafted += k
            self.stats.kept += int(keep[i]) - 1
            emitted += [(r, int(tok), mixed, None) for tok in out[i, : keep[i]].tolist()]
        # a chained round's period is the time between reads; a lone round's, dispatch to read
        start = self._resolved_s if rnd["chained"] and self._resolved_s is not None else rnd["t"]
        self.stats.round_s.append(now - start)
        self._resolved_s = now
        return emitted
