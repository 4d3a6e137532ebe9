"""The engine's side of a direct P/D handoff: a prefill engine exports a prefilled request's KV
(`export_kv`, `export_draft_feature`), a decode engine adopts it (`adopt`) and decodes on.

`Handoff` is a base of `serving.engine.Engine`; its methods use the engine's pieces (scheduler,
executor, pools, draft) and are part of the engine's public API."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from serving import request_checks as checks
from serving.engine_config import check_cache_salt, check_handoff
from serving.request import Request
from serving.sampling import GREEDY, SamplingParams, TokenLogprobs

__all__ = ["Handoff"]


class Handoff:
    """`adopt`, `export_kv` and `export_draft_feature` of an `Engine`."""

    def adopt(
        self,
        prompt: Sequence[int],
        first_token: int,
        max_new_tokens: int,
        pages: list[np.ndarray],
        state: np.ndarray,
        *,
        request_id: str,
        arrival_s: float,
        stop_at_eos: bool = False,
        sampling: SamplingParams = GREEDY,
        images=None,
        cache_salt: str | None = None,
        draft_feature: np.ndarray | None = None,
        first_logprobs: TokenLogprobs | None = None,
    ) -> Request | None:
        """Take over a request another engine prefilled (direct P/D handoff): its prompt's
        page contents and its KDA state after the whole prompt (and, for a speculative engine,
        its draft's rows in the pages and `draft_feature`, the fused target feature of the last
        prompt slot: `export_draft_feature`; with `sampling.logprobs`, the first token's
        `first_logprobs` when the caller has them).  None if it does not fit now."""
        check_cache_salt(cache_salt)
        checks.check_sampling(sampling, speculative=self.spec is not None)
        checks.check_draft_feature(draft_feature, d_model=self.cfg.d_model, speculative=self.spec is not None)
        check_handoff(
            list(prompt), first_token, pages, state, vocab_size=self.cfg.vocab_size, page_tokens=self.page_tokens
        )
        checks.check_max_new_tokens(max_new_tokens)
        if not self.scheduler.free_slots:
            return None
        images, mm_items = self._check_images(list(prompt), images)
        req = Request(
            request_id,
            list(prompt),
            max_new_tokens,
            stop_at_eos,
            arrival_s=arrival_s,
            sampling=sampling,
            images=images,
            mm_items=mm_items,
            cache_salt=cache_salt,
        )
        # placed on a rank and given its blocks and slot there; the tail rule's drop applies to
        # handoffs too (exact: kept as written, as no_drop)
        blocks = self.scheduler.begin(req, list(prompt))
        if blocks is None:
            return None
        try:
            req.admitted_s = time.monotonic()
            req.cached_tokens = blocks.hit.tokens
            req.cached_tokens_host = blocks.hit.pages_host * self.page_tokens
            req.context = list(prompt)
            self.executor.install_kv(req, blocks, pages, state)
            req.planned_len = req.kv_len = len(prompt)
            if self.spec is not None:
                self.spec.adopted(self, req, draft_feature)
            self.running.append(req)
            self.scheduler.emit(req, first_token, logprobs=first_logprobs)
        except BaseException as err:  # its blocks and slot go back before the caller hears of it
            self.fail_request(req, err)
            raise
        return req

    def export_kv(self, req: Request) -> tuple[list[np.ndarray], np.ndarray]:
        """(prompt page contents, packed KDA state) of a request this engine holds."""
        table = self.manager_of(req).requests[req.request_id].page_table
        return self.kv_of(req).read_kv(table, len(req.prompt), req.slot)

    def export_draft_feature(self, req: Request) -> np.ndarray:
        """f32 [D]: the fused target feature of a prefilled request's last prompt slot, the draft
        row a speculative decode engine writes first (with the token after it)."""
        if self.spec is None:
            raise ValueError("this engine has no draft")
        return np.asarray(self.kv.dpools["pending"][req.slot, 0])
