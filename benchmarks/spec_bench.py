"""EAGLE-3 speculative decoding: the serving engine with a draft against the same engine without,
and the draft's acceptance through the speculative reference.

Registered in `benchmarks.registry` (spec_decode, spec_acceptance).  Options (either benchmark):
`target=DIR` and `draft=DIR` (a trained target checkpoint and its `kimik3.eagle_train` draft; else
random weights, whose acceptance says nothing but whose rounds cost what trained ones do),
`corpus=NAME` (prompts from its held-out split with a trained target), `dtype=` (the target's
serving dtype; default bfloat16, float32 on the ci preset).
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.serving_bench import random_params, teacher_forced_check
from kimik3 import checkpoint, eagle, model, speculative
from kimik3.generate import generate
from serving.engine import Engine, EngineConfig


def _models(ctx, name: str, dtype: str):
    """(target params in dtype, cfg, draft, EagleConfig, trained?)."""
    if ctx.options.get("target"):
        from kimik3 import eagle_train  # the training pipeline's packages: only with trained weights

        params, cfg = checkpoint.restore(ctx.options["target"])
        draft, ecfg = eagle_train.load_draft(ctx.options["draft"], cfg, params)
        trained = True
    else:
        params, cfg = random_params(name)
        ecfg = eagle.default_config(cfg)
        draft = eagle.init_draft(jax.random.PRNGKey(1), cfg, ecfg, params)
        trained = False
    return model.cast_params(params, jnp.dtype(dtype)), cfg.replace(dtype=dtype), draft, ecfg, trained


def _prompts(ctx, n: int, size: int, trained: bool) -> list[list[int]]:
    rng = np.random.default_rng(0)
    if trained:
        from kimik3 import corpus  # the corpus pipeline's packages: only with a trained target

        held = corpus.load(ctx.options.get("corpus", "auto")).held_out
        return [held[s : s + size].tolist() for s in rng.integers(0, held.size - size, n)]
    return [rng.integers(32, 127, size).tolist() for _ in range(n)]  # printable bytes: no special tokens


def _serve(eng, prompts, max_new: int):
    reqs = [eng.submit(p, max_new) for p in prompts]
    eng.run()
    return reqs


def _ms_per_token(reqs) -> float:
    """Decode ms per token: tokens after each request's first, over the span from the first
    request's first token to the last token."""
    first = min(r.token_times_s[0] for r in reqs)
    last = max(r.token_times_s[-1] for r in reqs)
    return 1e3 * (last - first) / max(sum(len(r.output) - 1 for r in reqs), 1)


def spec_decode(ctx):
    """spec_decode: B greedy requests through an engine with the draft (k tokens a round) and
    through one without; each engine serves the batch first untimed (its compiles), then timed."""
    for case in ctx.cases():
        yield ctx.attempt(case, "default", functools.partial(_spec_row, ctx, case))


def _spec_row(ctx, case):
    name, b, k, prompt_len, max_new = case
    dtype = ctx.options.get("dtype", "float32" if ctx.ci else "bfloat16")
    params, cfg, draft, ecfg, trained = _models(ctx, name, dtype)
    prompts = _prompts(ctx, b, prompt_len, trained)
    page = 16 if ctx.ci else 128
    ec = EngineConfig(
        num_pages=max(64, 4 * b * -(-(prompt_len + max_new + 16) // page)),
        num_slots=b,
        num_snapshots=4 * b,
        page_tokens=page,
        kda_block_tokens=12 * page,
        prefill_chunk_tokens=256,
    )
    warm = 1 if ctx.ci else 2  # the second pass meets prefix hits, whose prefill shapes differ

    def measured(eng):
        for _ in range(warm):
            _serve(eng, prompts, max_new)
        if eng.spec is not None:
            eng.spec.stats = type(eng.spec.stats)()  # the timed pass's rounds only
        t0 = time.perf_counter()
        reqs = _serve(eng, prompts, max_new)
        return reqs, time.perf_counter() - t0

    spec_engine = Engine(params, cfg, ec.replace(draft_tokens=k), draft=(draft, ecfg))
    spec, spec_wall = measured(spec_engine)
    st = spec_engine.spec.stats
    chk = teacher_forced_check(params, cfg, [(p, r.output) for p, r in zip(prompts, spec)])
    extra = {
        "trained": trained,
        "dtype": dtype,
        "spec_wall_s": spec_wall,
        "acceptance": st.acceptance,
        "accept_length": st.accept_length,
        "round_ms_p50": 1e3 * statistics.median(st.round_s) if st.round_s else None,
    }

    def peer_ms():
        plain, wall = measured(Engine(params, cfg, ec))
        extra["plain_wall_s"] = wall
        extra["same_tokens"] = sum(r.output == s.output for r, s in zip(plain, spec))
        return _ms_per_token(plain)

    return ctx.row(case, chk, _ms_per_token(spec), peer_ms=peer_ms, extra=extra)


def spec_acceptance(ctx):
    """spec_acceptance: greedy `speculative_generate` at k drafted tokens on held-out prompts (random
    ones without a trained target), checked token for token against the oracle."""
    for case in ctx.cases():
        yield ctx.attempt(case, "default", functools.partial(_acceptance_row, ctx, case))


def _acceptance_row(ctx, case):
    name, n_prompts, k, prompt_len, max_new = case
    params, cfg, draft, ecfg, trained = _models(ctx, name, "float32")
    prompts = _prompts(ctx, n_prompts, prompt_len, trained)
    with jax.default_matmul_precision("highest"):  # both fp32 paths exact: TF32 would swap near-ties on a GPU
        oracle = [generate(params, cfg, p, max_new).tokens for p in prompts]
        runs = [speculative.speculative_generate(params, cfg, draft, ecfg, p, max_new, k) for p in prompts]
    wrong = sum(not np.array_equal(r.tokens, o) for r, o in zip(runs, oracle))
    acc = [a for r in runs for a in r.accepted]
    extra = {
        "trained": trained,
        "acceptance": sum(acc) / max(len(acc) * k, 1),
        "accept_length": float(np.mean([a + 1 for a in acc])) if acc else None,
        "by_position": [float(np.mean([a >= j for a in acc])) for j in range(1, k + 1)] if acc else [],
        "target_passes": len(acc) + len(runs),
        "accept_length_p50_by_prompt": statistics.median(r.accept_length for r in runs),
    }
    chk = {"max_err": wrong / len(runs), "tol": 0.0, "ok": wrong == 0}
    return ctx.row(case, chk, None, extra=extra)
