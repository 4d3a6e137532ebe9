"""kl_prefix: prefix caching on Kimi-Linear at the real shapes, the design's headline: TTFT of
multi-turn agent sessions whose contexts grow turn by turn, one engine build serving them three
ways (`MODES`), same run, same prompts:

* ``in_pass``: KDA snapshots at every block boundary exported by the prefill chunk's own pass
  (``EngineConfig.kda_snapshots="in_pass"``, ours);
* ``align``: the same snapshots, each boundary ending a chunk and the state kept after it, as
  vLLM's ``mamba_cache_mode=align`` does (``kda_snapshots="align"``);
* ``none``: no prefix caching (``prefix_caching=False``): every turn prefills its whole context.

A session's turn k prompt is its turn k-1 prompt, the turn's output tokens (synthetic: the
workload's, so every mode prefills the same tokens) and new input; contexts grow linearly from
`first` to `last` tokens over `turns` turns.  All sessions' turn k arrive together (a burst),
the next turn after every session's previous one ended.  Each mode runs on a fresh engine (empty
caches) over the same compiled programs: a warm-up session first compiles every chunk length the
timed runs use (`new_programs` in the row says if one was missed).

The row: ours_ms = in_pass TTFT p50, peer = align; ``extra`` the p50 / p99 of all three, the
prefix-hit share, snapshot bytes held at the end, and how many first tokens equal the in_pass
run's (bf16: chunk boundaries differ between the modes, so a near-tie may flip).  Check: the
engine's chunk program against the fp32 model (`kimi_linear._prefill_check`).
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from benchmarks import kimi_linear as kl
from kimik3 import config
from serving import metrics
from serving.engine import Engine
from serving.engine_config import EngineConfig
from serving.decode_runner import decode_program

log = logging.getLogger("benchmarks.kl_prefix")

MODES = ("in_pass", "align", "none")


def session_prompts(cfg, sessions: int, turns: int, first: int, last: int, seed: int) -> list[list[np.ndarray]]:
    """[session][turn] prompt token ids: turn 0 has `first` tokens, each later turn extends the
    previous prompt to about first + k (last - first) / (turns - 1) tokens (one synthetic output
    token, then new input), no <|image|> id."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sessions):
        prompts = [kl._prompt(rng, cfg, first)]
        for k in range(1, turns):
            target = first + k * (last - first) // max(1, turns - 1)
            grow = max(1, target - len(prompts[-1]))
            prompts.append(np.concatenate([prompts[-1], kl._prompt(rng, cfg, grow)]))
        out.append(prompts)
    return out


def engine_config(cfg, s: kl.Setting, sessions: int, last: int, chunk: int, ci: bool) -> EngineConfig:
    """One engine's sizes for `sessions` concurrent sessions of up to `last` tokens: pages for every
    session's context twice over (the previous turn's cached blocks beside the new turn's) and
    snapshots for each session's boundaries of two turns."""
    per_request = -(-(last + 2) // s.page) + 1
    block = s.page * (2 if ci else 8)  # a chunk bucket (`prefill_buckets`): align's chunks run unpadded
    return EngineConfig(
        num_pages=2 * sessions * per_request + 8,
        num_slots=sessions,
        num_snapshots=2 * sessions * (last // block + 2),
        page_tokens=s.page,
        kda_block_tokens=block,
        max_pages_per_request=per_request,
        prefill_chunk_tokens=chunk,
        kernels=s.kernels,
        scan_layers="none",
    )


def run_mode(params, cfg, ec: EngineConfig, mode: str, prompts, tag: str) -> dict:
    """Every session's turns through a fresh engine in `mode`: (summary, first tokens, snapshot
    bytes held at the end, new programs compiled while timing)."""
    ec = ec.replace(kda_snapshots="align" if mode == "align" else "in_pass", prefix_caching=mode != "none")
    eng = Engine(params, cfg, ec)
    programs = lambda: kl.model.forward_step_jit._cache_size() + decode_program._cache_size()
    before, t0, records, firsts = programs(), time.monotonic(), [], []
    for turn in range(len(prompts[0])):
        reqs = [eng.submit(p[turn].tolist(), 1, request_id=f"{tag}-{i}-{turn}") for i, p in enumerate(prompts)]
        while eng.has_work():
            eng.step()
        firsts += [r.output[0] for r in reqs]
        records += eng.records()[-len(reqs) :]
    wall = time.monotonic() - t0
    held = sum(m.snap_pool.num_cached for m in eng.managers)
    out = dict(
        summary=metrics.summarize(f"{tag}-{mode}", records, wall),
        firsts=firsts,
        snapshot_bytes=held * eng.capacity()["state_bytes"],
        snapshots=held,
        new_programs=programs() - before,
    )
    del eng
    kl.release()
    return out


def _case(ctx, s: kl.Setting, cfg, run, params, chunk: int) -> dict:
    _, manifest, sessions, turns, first, last = run
    ec = engine_config(cfg, s, sessions, last, chunk, ctx.ci)
    prompts = session_prompts(cfg, sessions, turns, first, last, s.seed)
    warm = session_prompts(cfg, 1, turns, first, last, s.seed + 1)
    t0 = time.monotonic()
    for mode in ("in_pass", "align"):  # every chunk length both modes use, compiled before timing
        run_mode(params, cfg, ec, mode, warm, "warm")
    warm_s = time.monotonic() - t0
    res = {m: run_mode(params, cfg, ec, m, prompts, "load") for m in MODES}
    ms = {m: {q: 1e3 * r["summary"].ttft_s[q] for q in ("p50", "p99")} for m, r in res.items()}
    ref = res["in_pass"]["firsts"]
    extra = dict(
        ttft_p50_ms={m: v["p50"] for m, v in ms.items()},
        ttft_p99_ms={m: v["p99"] for m, v in ms.items()},
        cache_rate={m: r["summary"].cache_rate for m, r in res.items()},
        snapshot_gb={m: r["snapshot_bytes"] / 1e9 for m, r in res.items()},
        snapshots={m: r["snapshots"] for m, r in res.items()},
        same_first_tokens={m: int(sum(a == b for a, b in zip(r["firsts"], ref))) for m, r in res.items()},
        requests=len(ref),
        new_programs={m: r["new_programs"] for m, r in res.items()},
        ttft_p50_vs_none=ms["in_pass"]["p50"] / ms["none"]["p50"],
        ttft_p50_vs_align=ms["in_pass"]["p50"] / ms["align"]["p50"],
        kda_block_tokens=ec.kda_block_tokens,
        chunk_tokens=chunk,
        warmup_s=warm_s,
    )
    log.info("%s %s: TTFT p50 %s ms, p99 %s ms", cfg.name, ctx.label(run), extra["ttft_p50_ms"], extra["ttft_p99_ms"])
    return {"ms": ms["in_pass"]["p50"], "peer_ms": ms["align"]["p50"], "extra": extra}


def kl_prefix(ctx):
    """kl_prefix: per case, TTFT p50 of the sessions with in-pass KDA snapshots (ours) against
    vLLM's align mode (peer) and no prefix caching (extra), one engine build."""
    s = kl._setting(ctx)
    chunk = int(ctx.options.get("chunk", "64" if ctx.ci else "4096"))
    for (name, manifest), pairs in kl._groups(ctx.cases(), s.manifest).items():
        cfg = config.get_config(name)
        runs = [r for _, r in pairs]
        check = lambda c, p, q: kl._prefill_check(c, manifest, s, p, q, chunk if c is cfg else kl.CHECK_CHUNK)
        gen = kl._checked_params(cfg, manifest, runs, s, check)
        chk, params, done = None, None, set()
        try:
            while True:
                key, value = next(gen)
                if key == "check":
                    chk = value
                else:  # a skip: the check failed or the weights do not fit
                    done.add(key)
                    row = ctx.row(key, chk, None)
                    row.update(status="skipped")
                    row["extra"]["error"] = value["skip"]
                    yield row
        except StopIteration as stop:
            params = stop.value
        for run in runs:
            if run in done:
                continue
            if params is None or time.monotonic() > s.end:
                row = ctx.row(run, chk, None)
                row.update(status="skipped")
                row["extra"]["error"] = "skipped: the budget was spent"
                yield row
                continue
            try:
                fig = _case(ctx, s, cfg, run, params, chunk)
            except Exception as e:  # noqa: BLE001 - reported in the row
                log.exception("%s raised", ctx.label(run))
                row = ctx.row(run, chk, None)
                row.update(status="skipped")
                row["extra"]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                yield row
                continue
            yield ctx.row(run, chk, fig["ms"], peer_ms=fig["peer_ms"], extra=fig["extra"])
        del params
        kl._drop_held()
        jax.clear_caches()
