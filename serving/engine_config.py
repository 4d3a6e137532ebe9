"""What an engine is configured with, and the checks on what a request or a KV handoff brings:
`EngineConfig` (frozen; sizes, role, kernels, caching, speculation), `check_cache_salt`,
`check_handoff` (also what the worker checks before anything reaches an engine)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kimik3 import tokenizer

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


# the choices of EngineConfig's string fields, here so that building the command line imports no
# JAX (tests/serving/test_serve.py checks them against the modules that define them)
KERNEL_CHOICES = ("auto", "reference", "pallas")  # kimik3.ops.KERNEL_CHOICES
ROLE_CHOICES = ("both", "prefill", "decode")
DISPATCH_CHOICES = ("auto", "dense", "ragged")  # sharding.layers.DISPATCH_CHOICES
SCAN_CHOICES = ("prefill", "all", "none")  # serving.model_runner.SCAN_CHOICES
TAIL_CHOICES = ("drop", "no_drop", "exact")  # serving.spec_decode.TAIL_MODES
SNAPSHOT_CHOICES = ("in_pass", "align")  # serving.scheduler.SchedulerConfig.snapshots


def _field(default=dataclasses.MISSING, help_text: str = "", **flag):
    """A field whose metadata holds its command-line help and how the flag is spelled: `choices`
    (a string field's values), `aliases` (vLLM's names for the same flag).  `serving.flags` builds
    one flag per field from it."""
    return dataclasses.field(default=default, metadata={"help": help_text, **flag})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that sizes and shapes an engine, one object shared by the worker, demo, coverage
    and benchmarks.  Each field's metadata holds what it means (``metadata["help"]``): `kimik3
    worker`, `kimik3 launch` and `kimik3 serve` take every field as a flag of the same name with
    dashes (`serving.flags.add_engine_flags`), and `kimik3 CMD --help` prints that text."""

    num_pages: int = _field(help="KV pages in the device pool (one is the null page)")
    num_slots: int = _field(
        8,
        "concurrent requests: a KDA state slot each (one more is kept as scratch); vLLM's --max-num-seqs",
        aliases=("--max-num-seqs",),
    )
    num_snapshots: int = _field(16, "KDA state snapshots kept for prefix hits")
    page_tokens: int = _field(128, "tokens per KV page (vLLM's --block-size)", aliases=("--block-size",))
    kda_block_tokens: int = _field(1536, "tokens between KDA state snapshots (a multiple of page_tokens)")
    kda_snapshots: str = _field(
        "in_pass",
        "how a prefill takes its KDA snapshots: in_pass exports every boundary inside a chunk from the "
        "chunk's own pass; align ends a chunk at each boundary and keeps the state after it, as "
        "vLLM's mamba_cache_mode=align does (more, shorter chunks; the same snapshots and tokens)",
        choices=SNAPSHOT_CHOICES,
    )
    max_pages_per_request: int | None = _field(None, "a request's page-table length (None: the pool)")
    prefill_chunk_tokens: int = _field(512, "prompt tokens per prefill chunk")
    max_step_tokens: int | None = _field(
        None,
        "tokens one step may run, decode rows and prefill chunks together (None: one full prefill "
        "chunk plus a decode row per slot); vLLM's --max-num-batched-tokens",
        aliases=("--max-num-batched-tokens",),
    )
    prefill_tokens_while_decoding: int | None = _field(
        None,
        "prefill tokens a step may run beside decode rows (None: what the step budget leaves); lower it "
        "to bound the time per output token while prompts arrive",
    )
    kernels: str = _field("auto", "the kernels the steps call (kimik3.ops)", choices=KERNEL_CHOICES)
    namespace: str | None = _field(
        None, "the cache keys' namespace: engines that share a store share KV only within one"
    )
    role: str = _field(
        "both",
        "both: whole requests (colocated); prefill: stops after the first token and hands the "
        "request over with its KV; decode: continues requests another engine prefilled",
        choices=ROLE_CHOICES,
    )
    publish_to_host: bool = _field(
        False,
        "write each finished request's pages and snapshots to the host tier at once (a shared store "
        "then serves them to other engines), not only when they are evicted",
    )
    dispatch: str = _field("auto", "the sharded MoE's all-to-all (sharding.layers)", choices=DISPATCH_CHOICES)
    scan_layers: str = _field(
        "prefill",
        "which unsharded programs run the repeated [KDA, KDA, KDA, MLA] periods as one scan step "
        "over stacked weights (same tokens, about half the blocks to compile per shape): prefill "
        "(decode programs read the unrolled layers), all (one stacked copy of the weights) or none",
        choices=SCAN_CHOICES,
    )
    encoder_cache_bytes: int = _field(
        64 << 20,
        "device bytes of ViT embeddings kept across requests by (tenant, image content) "
        "(cache.media.l3); 0: none (the ViT runs on a request's images together, once per request)",
    )
    encoder_cache_to_host: bool = _field(
        False,
        "with a host tier, the ViT rows the engine computes are written there too and an "
        "encoder-cache miss looks there first, so another engine on the same store finds them",
    )
    prefix_caching: bool = _field(
        True,
        "requests share the KV of their common prefixes (off: never; the media ablation's no L4)",
        aliases=("--enable-prefix-caching",),
    )
    draft_tokens: int = _field(
        0,
        "k > 0: EAGLE-3 speculative decoding with the engine's draft, k drafted tokens per verify "
        "pass (serving.spec_decode)",
    )
    eagle_tail: str = _field(
        "drop",
        "the speculative prefix-hit rule for the draft's rows of the last matched page: drop the "
        "page, keep its draft rows (no_drop), or recompute its tail slot (exact)",
        choices=TAIL_CHOICES,
    )
    eos_id: int = _field(
        tokenizer.EOS_ID, "the tokenizer's end-of-sequence id (kimik3.text): stop_at_eos requests end there"
    )
    prefill_batch: int = _field(
        1,
        "with a prefill mesh, a step's sharded chunks of one rank and one length run as one batch "
        "of up to this many requests (padded to a power of two); warm-up compiles every batch size",
    )

    def __post_init__(self):
        if self.role not in ROLE_CHOICES:
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
        if self.kda_snapshots not in SNAPSHOT_CHOICES:
            raise ValueError(f"kda_snapshots must be one of {SNAPSHOT_CHOICES}; got {self.kda_snapshots!r}")
        if self.prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1; got {self.prefill_batch}")
        # JAX-side modules: importing engine_config (the flags, --help) imports no JAX
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
