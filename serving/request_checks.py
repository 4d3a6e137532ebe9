"""What a request brings, checked before it reaches a step: ValueError naming the field, so a
client's bad input is that client's 400 and never an engine fault (`serving.engine.Engine.submit`
and `adopt` call these)."""

from __future__ import annotations

import numpy as np

from cache.block_hash import image_items
from kimik3 import model, tokenizer
from kimik3.config import ModelConfig
from serving.engine_config import check_cache_salt
from serving.decode_runner import DecodeRows
from serving.sampling import SamplingParams

__all__ = ["check_draft_feature", "check_images", "check_max_new_tokens", "check_prompt", "check_sampling"]


def check_max_new_tokens(max_new_tokens) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
        raise ValueError(f"max_new_tokens must be an integer; got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")


def check_prompt(prompt, *, vocab_size: int, prior_output: int = 0, cache_salt=None) -> list[int]:
    """The prompt as a list of ints: non-empty, ids in the vocabulary; `prior_output` (its own
    earlier output tail) within it; `cache_salt` a tenant's salt (`check_cache_salt`)."""
    check_cache_salt(cache_salt)
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("empty prompt")
    if any(t < 0 or t >= vocab_size for t in prompt):
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    if not (isinstance(prior_output, int) and 0 <= prior_output < len(prompt)):
        raise ValueError(
            f"prior_output must lie in [0, {len(prompt)}) (the prompt's own output tail); got {prior_output!r}"
        )
    return prompt


def check_sampling(sampling, *, speculative: bool) -> None:
    """ValueError unless `sampling` is a `SamplingParams` that becomes a decode row (the device's
    dtypes) and the engine serves it (a speculative engine: no filters, penalties or logprobs)."""
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a serving.sampling.SamplingParams; got {type(sampling).__name__}")
    try:
        DecodeRows.build(1, [0], [[]], [0], [0], [sampling], max_pages=1, null_page=0, scratch_slot=0)
    except (TypeError, OverflowError, ValueError) as err:
        raise ValueError(f"sampling parameters out of range: {err}") from None
    if not speculative:
        return
    if not sampling.greedy and (sampling.top_p < 1.0 or sampling.filtered):
        raise ValueError(
            "top_p < 1, top_k and min_p are not supported with speculative decoding (its acceptance "
            "rule keeps the full distribution at the temperature)"
        )
    if sampling.penalized or sampling.logprobs is not None:
        raise ValueError(
            "presence / frequency penalties and logprobs are not supported with speculative "
            "decoding (its verify pass scores drafts without them)"
        )


def check_images(prompt: list[int], images, cfg: ModelConfig, *, prefill_mesh: bool) -> tuple[np.ndarray | None, tuple]:
    """(images as an array [N, S, S, C], one MMItem per image) for a prompt's <|image|>
    placeholders, or ValueError (prefill_mesh: the engine shards prefill, which takes no images)."""
    if images is None and cfg.vit is None:  # no vision encoder: the placeholder's id is text
        return None, ()
    n_slots = prompt.count(tokenizer.IMAGE_ID)
    if images is None:
        if n_slots:
            raise ValueError(f"the prompt holds {n_slots} <|image|> placeholders but no images were given")
        return None, ()
    if prefill_mesh:
        raise ValueError("images on an engine with a prefill mesh are not supported yet")
    arr = np.asarray(model.check_images(images, np.asarray([prompt]), cfg))  # checks shape, count, values
    # hashed as given (the router hashes the uint8 pixels it sends the same way)
    return arr, image_items(prompt, np.asarray(images), cfg.vit.tokens_per_image, tokenizer.IMAGE_ID)


def check_draft_feature(feature, *, d_model: int, speculative: bool) -> None:
    """A handoff's draft feature: f32 [d_model], finite, given exactly when the engine drafts."""
    if not speculative:
        if feature is not None:
            raise ValueError("a speculative handoff (with a draft feature) needs a decode engine with the same draft")
        return
    if feature is None or np.shape(feature) != (d_model,):
        raise ValueError(
            f"a speculative engine adopts a handoff with its draft feature [{d_model}] (from an engine with the same draft)"
        )
    if not np.isfinite(feature).all():
        raise ValueError("the draft feature holds values that are not finite")
