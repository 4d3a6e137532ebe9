"""What an engine is configured with, and the checks on what a request or a KV handoff brings:
`EngineConfig` (frozen; sizes, role, kernels, caching, speculation), `check_cache_salt`,
`check_handoff` (also what the worker checks before anything reaches an engine)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kimik3 import tokenizer
from serving.model_runner import SCAN_CHOICES

__all__ = ["MAX_CACHE_SALT_CHARS", "EngineConfig", "check_cache_salt", "check_handoff"]

MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt) -> None:
    """A tenant salt is None or a non-empty string of at most MAX_CACHE_SALT_CHARS; else ValueError."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")


def check_handoff(prompt: list[int], token: int, pages, state, *, vocab_size: int, page_tokens: int) -> None:
    """ValueError unless a KV handoff is well formed: token ids in range, one page per
    `page_tokens` prompt tokens, finite page and state values."""
    if any(t < 0 or t >= vocab_size for t in prompt) or not 0 <= token < vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    if len(pages) != -(-len(prompt) // page_tokens):
        raise ValueError(f"{len(prompt)} prompt tokens need {-(-len(prompt) // page_tokens)} pages; got {len(pages)}")
    if not (np.isfinite(state).all() and all(np.isfinite(p).all() for p in pages)):
        raise ValueError("the KV handoff holds values that are not finite")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that sizes and shapes an engine, one object shared by the worker, demo, coverage
    and benchmarks.

    num_pages / num_slots / num_snapshots: pool sizes (a slot per concurrent request; one more
    is kept as scratch).  max_step_tokens: tokens one step may run (decode rows + prefill chunk
    tokens); default one full prefill chunk plus a decode row per slot.
    prefill_tokens_while_decoding: prefill tokens a step may run beside decode rows (None: what
    the budget leaves): lower it to bound TPOT while prompts arrive.
    role: "both" (colocated), "prefill" (stops after the first token; `on_prefilled` hands the
    request over while its KV is still held), or "decode".
    publish_to_host: write each finished request's pages and snapshots to the host tier at once
    (a shared store then serves them to other engines), not only when they are evicted.
    dispatch: the sharded MoE's all-to-all ("auto", "dense", "ragged"; see `sharding.layers`).
    scan_layers: which unsharded programs run the repeated [KDA, KDA, KDA, MLA] periods as one
    scan step over stacked weights (`kimik3.stacked`; same tokens, about half the blocks to
    compile per shape): "prefill" (default; decode programs read the unrolled layers, see
    `serving.model_runner.ModelRunner`), "all" (one stacked copy of the weights), or "none".
    encoder_cache_bytes: device bytes of ViT embeddings kept across requests by (tenant, image
    content) (`cache.media.l3`); 0: none (the ViT then runs on a request's images
    together, once per request).
    encoder_cache_to_host: with a host tier, the ViT rows the engine computes are written there
    too and an encoder-cache miss looks there first, so another engine on the same store finds
    them (keyed by namespace, tenant and image).
    prefix_caching: False: requests never share prefix blocks (the media ablation's "no L4").
    draft_tokens: k > 0, EAGLE-3 speculative decoding with the `draft` the engine is given (k
    drafted tokens per verify pass, `serving.spec_decode`); eagle_tail: the prefix-hit rule for
    the draft's rows of the last matched page ("drop", "no_drop", "exact").
    eos_id: the tokenizer's end-of-sequence id (`kimik3.text`): stop_at_eos requests end there.
    prefill_batch: with a prefill mesh, a step's sharded chunks of one rank and one length run as
    one batch of up to this many requests (padded to a power of two with rows of the scratch slot
    and null pages), so a prefill pool fills its TP ranks; warm-up compiles every batch size."""

    num_pages: int
    num_slots: int = 8
    num_snapshots: int = 16
    page_tokens: int = 128
    kda_block_tokens: int = 1536
    max_pages_per_request: int | None = None
    prefill_chunk_tokens: int = 512
    max_step_tokens: int | None = None
    prefill_tokens_while_decoding: int | None = None
    kernels: str = "auto"
    namespace: str | None = None
    role: str = "both"
    publish_to_host: bool = False
    dispatch: str = "auto"
    scan_layers: str = "prefill"
    encoder_cache_bytes: int = 64 << 20
    encoder_cache_to_host: bool = False
    prefix_caching: bool = True
    draft_tokens: int = 0
    eagle_tail: str = "drop"
    eos_id: int = tokenizer.EOS_ID
    prefill_batch: int = 1

    def __post_init__(self):
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode; got {self.role!r}")
        if self.num_slots < 1 or self.num_pages < 2:
            raise ValueError(f"num_slots ({self.num_slots}) must be >= 1 and num_pages ({self.num_pages}) >= 2")
        if self.step_tokens <= self.num_slots * (1 + self.draft_tokens):
            raise ValueError(
                f"max_step_tokens ({self.step_tokens}) must exceed num_slots ({self.num_slots}) x "
                f"(1 + draft_tokens ({self.draft_tokens})): a step with every slot decoding must "
                f"leave room for prefill"
            )
        if self.scan_layers not in SCAN_CHOICES:
            raise ValueError(f"scan_layers must be one of {SCAN_CHOICES}; got {self.scan_layers!r}")
        if self.prefill_tokens_while_decoding is not None and self.prefill_tokens_while_decoding < 1:
            raise ValueError("prefill_tokens_while_decoding must be >= 1 (or None)")
        if self.prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1; got {self.prefill_batch}")
        from kimik3.speculative import MAX_DRAFT_TOKENS
        from serving.spec_decode import TAIL_MODES

        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"draft_tokens must be in [0, {MAX_DRAFT_TOKENS}] (0: no speculation); got {self.draft_tokens}"
            )
        if self.eagle_tail not in TAIL_MODES:
            raise ValueError(f"eagle_tail must be one of {TAIL_MODES}; got {self.eagle_tail!r}")

    @property
    def step_tokens(self) -> int:
        # every decode row runs 1 + k tokens (a speculative verify pass), charged before prefill
        return self.max_step_tokens or self.prefill_chunk_tokens + self.num_slots * (1 + self.draft_tokens)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
