"""Greedy generation, and the oracle every faster path is held against.

`generate(..., use_cache=False)` is the oracle: params cast to fp32 and the
*whole* sequence recomputed at every step, with no state carried between
steps.  The token buffer has a fixed length (prompt + max_new_tokens) so one
compiled program serves every step; positions past the current one hold
padding that causality keeps out of the logits that are read.

`generate(..., use_cache=True)` prefills the prompt once into an explicit
cache and decodes one token per step, in the params' own dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import ops, tokenizer
from kimik3.config import ModelConfig
from kimik3.model import forward_step_jit, cast_params, forward, init_cache, prepare_inputs

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    tokens: np.ndarray  # int32 [N] generated ids (prompt excluded)
    logits: np.ndarray  # float32 [N, vocab]: logits that chose tokens[i]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _oracle_step(params, buf, images, cur, *, cfg):
    """Full recompute of `buf` [1, L]; returns logits at position cur - 1."""
    positions = jnp.arange(buf.shape[1], dtype=jnp.int32)[None]
    logits, _ = forward_step_jit(
        params, buf, positions, None, images, cfg=cfg, expert_path="grouped", kernels="reference"
    )
    return jax.lax.dynamic_index_in_dim(logits[0], cur - 1, keepdims=False)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"), donate_argnums=(2,))
def _decode_step(params, token, cache, *, cfg, kernels):
    positions = cache["lengths"][:, None]
    logits, cache = forward_step_jit(
        params, token, positions, cache, None, cfg=cfg, expert_path="grouped", kernels=kernels
    )
    return logits[:, -1], cache


def generate(
    params,
    cfg: ModelConfig,
    prompt_tokens,
    max_new_tokens: int,
    images=None,
    use_cache: bool = False,
    *,
    stop_at_eos: bool = False,
    kernels: str = "auto",
    choose=None,
    eos_id: int = tokenizer.EOS_ID,
) -> GenerateResult:
    """Greedy decoding of one prompt.

    Args:
      prompt_tokens: 1-D sequence of ids (may contain <|image|> placeholders).
      max_new_tokens: tokens to generate (fewer if `stop_at_eos` meets EOS).
      images: [N, S, S, C] for the placeholders, or None.
      use_cache: False = the oracle (fp32, full recompute every step, reference kernels).
      kernels: for the cached path, "auto" | "reference" | "pallas" (see `kimik3.ops`).
      eos_id: the tokenizer's end of sequence (`stop_at_eos`).
      choose: (logits f32 [vocab], output so far: list[int]) -> the next id; default argmax
        (a reference for a logits processor, e.g. the serving penalties).
    Returns:
      GenerateResult(tokens [n], logits [n, vocab]).
    """
    prompt = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
    if prompt.size == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    total = prompt.size + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({prompt.size} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
            f"the context limit max_seq_len={cfg.max_seq_len}"
        )
    out_tokens, out_logits = [], []
    if not use_cache:
        params32 = cast_params(params, jnp.float32)
        _, _, imgs = prepare_inputs(cfg, prompt[None], images=images)
        imgs = None if imgs is None else imgs.astype(jnp.float32)
        buf = np.zeros((1, total), np.int32)
        buf[0, : prompt.size] = prompt
        for i in range(max_new_tokens):
            cur = prompt.size + i
            logits = np.asarray(_oracle_step(params32, jnp.asarray(buf), imgs, cur, cfg=cfg))
            tok = int(np.argmax(logits)) if choose is None else int(choose(logits, list(out_tokens)))
            out_tokens.append(tok)
            out_logits.append(logits)
            buf[0, cur] = tok
            if stop_at_eos and tok == eos_id:
                break
    else:
        # Whole 128-token pages, so the paged kernels can view the cache as pages.
        cache = init_cache(cfg, 1, min(cfg.max_seq_len, -(-total // 128) * 128), dtype=_param_dtype(params))
        kernels = ops.resolve(kernels)
        logits, cache = forward(params, cfg, prompt[None], images=images, cache=cache, kernels=kernels)
        last = np.asarray(logits[0, -1], np.float32)
        for i in range(max_new_tokens):
            tok = int(np.argmax(last)) if choose is None else int(choose(last, list(out_tokens)))
            out_tokens.append(tok)
            out_logits.append(last)
            if (stop_at_eos and tok == eos_id) or i == max_new_tokens - 1:
                break
            logits, cache = _decode_step(params, jnp.asarray([[tok]], jnp.int32), cache, cfg=cfg, kernels=kernels)
            last = np.asarray(logits[0], np.float32)
    log.debug("generated %d tokens (use_cache=%s)", len(out_tokens), use_cache)
    return GenerateResult(np.asarray(out_tokens, np.int32), np.stack(out_logits).astype(np.float32))


def _param_dtype(params):
    return params["embed_vd"].dtype
