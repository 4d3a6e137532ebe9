"""A request as the engine holds it: what the client asked for, what it produced, and where its
state lives.

The client's fields (prompt, sampling, images, salt) are fixed at submission; the engine's
results (output, token times, logprobs, cache hits, error) grow as steps run.  The rest is
the serving state the scheduler plans with and the model runner reads; the scheduler owns it
and changes it when it plans a step (`serving.scheduler`) or applies a step's output, the
speculative decoder owns the ``draft_*`` fields.  Every field is public and documented here so
that no other module reaches into a private one.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from serving.sampling import GREEDY, SamplingParams

__all__ = ["Request"]


@dataclasses.dataclass(eq=False)  # a request is itself: `in` / `remove` on the queues compare identity, not
class Request:  # ~35 fields (an O(rows^2) cost each decode step at 32 rows)
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_at_eos: bool = False
    arrival_s: float = dataclasses.field(default_factory=time.monotonic)
    sampling: SamplingParams = GREEDY
    images: np.ndarray | None = None  # [N, S, S, C] for the prompt's <|image|> placeholders
    mm_items: tuple = ()  # cache.block_hash.MMItem per image: its content hash enters the block hashes
    # The tenant's prefix-cache salt (vLLM's `cache_salt`): it enters block 0's hash, so a request
    # hits only blocks its own tenant stored (and `cached_tokens` never reveals another's prompt).
    cache_salt: str | None = None
    # the prompt's last tokens that are this request's own earlier output (a failover's or a store
    # handoff's continuation): the presence / frequency penalties count them with `output`
    prior_output: int = 0
    # ---- results, filled by the engine
    output: list[int] = dataclasses.field(default_factory=list)
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    token_mixed: list[bool] = dataclasses.field(default_factory=list)  # its step also ran prefill (metrics)
    logprobs: list = dataclasses.field(default_factory=list)  # per output token, with sampling.logprobs set
    cached_tokens: int = 0
    cached_tokens_host: int = 0
    admitted_s: float | None = None
    done: bool = False
    error: str | None = None
    # why it failed when the failure was its own (`Engine.fail_request`): "invalid" (a value it
    # carries could not be used), "request" (other host-side work of its own raised); None:
    # not its own (cancelled, out of capacity, an engine fault).  Another engine would fail it
    # the same way, so a router must not retry it elsewhere.
    fault: str | None = None
    # ---- serving state (the scheduler's)
    slot: int = -1  # its KDA slot in its rank's pools; -1 while it holds none
    rank: int = 0  # the rank whose pools hold its KV (DP decode: `Scheduler` over one manager per rank)
    context: list[int] = dataclasses.field(default_factory=list)  # tokens to prefill (prompt, + output on resume)
    planned_len: int = 0  # tokens of `context` whose KV is in the cache or planned into it
    kv_len: int = 0  # tokens whose KV is in the pools (or dispatched there): a decode step writes at this position
    snapshots_due: list[int] = dataclasses.field(default_factory=list)  # KDA snapshot boundaries not yet planned
    offload_keys: list[str] | None = None  # host-tier entries of its KV while preempted
    resume_kv: tuple | None = None  # (page contents, packed KDA state) fetched back for re-admission
    image_rows: object = None  # the images' ViT embeddings [N * P, D], computed once at first prefill
    # ---- speculative decoding (`serving.spec_decode`): drafted tokens kept per verify pass, the
    # prompt tokens the tail rule gave up ("drop"), or the tail slot it recomputed ("exact")
    accepted: list[int] = dataclasses.field(default_factory=list)
    tail_dropped_tokens: int = 0
    tail_recomputed: bool = False
    draft_pending: int = 0  # draft slots pending before the next verify (their features in the pools)
    draft_table: list[int] | None = None  # the draft's block table where it differs from the target's
    extra_pages: list[int] = dataclasses.field(default_factory=list)  # pages held beside the table, freed at release

    @property
    def prefilling(self) -> bool:
        """Part of `context` is not yet planned into the cache."""
        return self.planned_len < len(self.context)

    def generated(self) -> list[int]:
        """Every token this request generated so far (what the penalties count): the prompt's
        `prior_output` tail, then `output`."""
        return self.prompt[len(self.prompt) - self.prior_output :] + self.output
