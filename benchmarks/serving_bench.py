"""The serving engine: its decode program against the bytes a step must read, and the engine under
load (colocated, or prefill / decode disaggregated).

Registered in `benchmarks.registry` (decode_step, serving_load).  `demo_figures` reads the
figures of a `kimik3 demo` run's output.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from kimik3 import config, model, quantization, sizing, stacked
from serving import metrics
from serving.disagg import DisaggregatedServer
from serving.engine import Engine, EngineConfig
from serving.decode_runner import DecodeRows, DecodeRunner, decode_program
from serving.sampling import GREEDY

log = logging.getLogger("benchmarks.serving")


@functools.cache
def random_params(name: str, seed: int = 0):
    """(params in the config's dtype, cfg) of a config drawn at random, once per process."""
    cfg = config.get_config(name)
    return model.init_params(cfg, jax.random.PRNGKey(seed)), cfg


@functools.cache
def serving_params(name: str, seed: int = 0):
    """`random_params` in the serving layout the engines' programs read."""
    params, cfg = random_params(name, seed)
    return stacked.serving_layout(params, cfg, scan=False)


def token_margin(cfg) -> float:
    """How far below the oracle's best logit a chosen token may lie, over the row's logit range,
    before it counts as off: an engine in bf16 rounds differently from the fp32 oracle, which swaps
    near-ties (random weights' logits are nearly flat)."""
    return 1e-3 if cfg.dtype == "float32" else 0.1


def off_share(cfg) -> float:
    """The share of positions that may be off by more than `token_margin`: none in fp32; in bf16 a
    few near-ties, where a wrong page, slot or state puts nearly every position off."""
    return 0.0 if cfg.dtype == "float32" else 0.25


def margin_check(ref_logits, tokens, cfg) -> dict:
    """{max_err: the share of positions whose chosen token lies more than `token_margin` below the
    oracle's best (over the row's logit range: 0 its argmax, 1 its worst), tol: `off_share`, ok,
    worst_margin}."""
    ref = np.asarray(ref_logits, np.float32).reshape(-1, np.shape(ref_logits)[-1])
    tokens = np.asarray(tokens).reshape(-1)
    gap = ref.max(-1) - ref[np.arange(len(tokens)), tokens]
    margin = gap / np.maximum(ref.max(-1) - ref.min(-1), 1e-30)
    share = float(np.mean(margin > token_margin(cfg))) if len(tokens) else 1.0
    return {
        "max_err": share,
        "tol": off_share(cfg),
        "ok": share <= off_share(cfg),
        "worst_margin": float(margin.max()) if len(tokens) else None,
    }


def oracle(params, cfg):
    """The params and config the oracle runs: fp32, on the reference kernels (at the highest matmul
    precision: TF32 would blur it on a GPU)."""
    return model.cast_params(params, jnp.float32), cfg.replace(dtype="float32")


def teacher_forced_check(params, cfg, runs: list[tuple[list[int], list[int]]]) -> dict:
    """margin_check of every (prompt, output)'s tokens against the fp32 model on the reference
    kernels over prompt + output (no cache): each position sees the context the engine saw.
    params / cfg: the engine's, in its dtype (the tolerances follow it)."""
    p32, cfg32 = oracle(params, cfg)
    logits, tokens = [], []
    for prompt, out in runs:
        if not out:
            return {"max_err": 1.0, "tol": off_share(cfg), "ok": False, "worst_margin": None}
        seq = jnp.asarray([list(prompt) + list(out[:-1])], jnp.int32)
        with jax.default_matmul_precision("highest"):
            logits.append(np.asarray(model.forward(p32, cfg32, seq, kernels="reference")[0][0, len(prompt) - 1 :]))
        tokens += list(out)
    return margin_check(np.concatenate(logits), tokens, cfg)


def engine_config(cfg, n: int, prompt: int, output: int, ci: bool, **kw) -> EngineConfig:
    page = 16 if ci else 128
    per_request = -(-(prompt + output) // page) + 1
    return EngineConfig(
        num_pages=2 * n * (per_request + 1) + 8,
        num_slots=n,
        num_snapshots=2 * n,
        page_tokens=page,
        kda_block_tokens=page * 12,
        max_pages_per_request=per_request,
        prefill_chunk_tokens=64 if ci else 2048,
        **kw,
    )


def expected_experts(cfg, rows: int) -> float:
    """Routed experts a decode step over `rows` requests reads per MoE layer, expected under
    uniform routing (each row picks k of G distinct experts; a bucket's idle rows none)."""
    g, k = cfg.n_routed_experts, cfg.n_active_experts
    return g * (1 - ((g - k) / g) ** rows)


def weights_read_bytes(cfg, rows: int, manifest: str = "bf16") -> float:
    """Weight bytes a decode step reads: every weight but the routed experts, and of those the
    `expected_experts` share."""
    rules = quantization.MANIFESTS[manifest]
    bits = quantization.BITS_PER_VALUE[rules.format_of("layer_1/moe/w_gate_elf")]
    per_expert = 3 * cfg.moe_latent_dim * cfg.moe_expert_dim * bits / 8  # gate, up, down
    n_moe = sum(cfg.ffn_kind(i) == "moe" for i in range(cfg.n_layers))
    routed = n_moe * cfg.n_routed_experts * per_expert
    return sizing.weight_bytes(cfg, rules) - routed * (1 - expected_experts(cfg, rows) / cfg.n_routed_experts)


def decode_step(ctx):
    """decode_step: the engine's decode program for B requests of ctx cached tokens (shuffled
    pages), back to back on its persistent buffers; beside it the engine's chained loop."""
    for case in ctx.cases():
        yield ctx.attempt(case, "default", functools.partial(_decode_step_row, ctx, case))


def _decode_step_row(ctx, case):
    name, b, n_ctx = case
    params = serving_params(name)
    cfg = random_params(name)[1]
    ec = engine_config(cfg, b, n_ctx, 8, ctx.ci)
    eng = Engine(params, cfg, ec)
    per_seq = -(-n_ctx // ec.page_tokens) + 1
    rng = np.random.default_rng(b)
    free = rng.permutation(np.arange(1, eng.manager.page_pool.num_blocks))  # page 0 is the null page
    table = free[: b * per_seq].reshape(b, per_seq)
    slots, lengths = rng.permutation(b), np.full(b, n_ctx)
    # distinct tokens per row, as real requests have (identical rows would route to the same experts)
    first = rng.integers(0, cfg.vocab_size, b).astype(np.int32)
    runner, bucket = DecodeRunner(cfg, eng.kernels), eng.runner.decode_bucket(b)
    pools = eng.pools
    ref_pools = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, pools)
    view = model.paged_view(
        ref_pools, jnp.asarray(table, jnp.int32), jnp.asarray(slots, jnp.int32), jnp.asarray(lengths, jnp.int32)
    )
    p32, cfg32 = oracle(params, cfg)
    with jax.default_matmul_precision("highest"):
        ref, _ = model.forward_step_jit(
            p32,
            jnp.asarray(first[:, None]),
            jnp.full((b, 1), n_ctx, jnp.int32),
            view,
            None,
            cfg=cfg32,
            expert_path="grouped",
            kernels="reference",
        )
    del ref_pools, view, p32
    held = {
        "pools": pools,
        "rows": DecodeRows.build(
            bucket,
            first.tolist(),
            table.tolist(),
            slots.tolist(),
            lengths.tolist(),
            [GREEDY] * b,
            max_pages=eng.max_pages,
            null_page=0,
            scratch_slot=eng.scratch_slot,
        ),
    }
    held["pools"], tokens, did, _ = runner.dispatch(params, held["pools"], held["rows"])
    tokens = np.asarray(tokens)
    chk = margin_check(ref[:, -1], tokens[:b], cfg)
    runner.settle(held["rows"], tokens, did)
    held["rows"] = held["rows"].advanced(tokens)

    def replay():  # the decode program alone, back to back on its buffers (no host reads)
        held["pools"], runner._io[bucket] = decode_program(
            params, held["pools"], runner._io[bucket], cfg=cfg, kernels=eng.kernels, greedy=True
        )
        return runner._io[bucket]["tokens"]

    def advance(rows):  # what the device did: active rows advance, padding rows stay
        return dataclasses.replace(rows, lengths=rows.lengths + rows.active)

    def chained(n):  # the engine's decode-only phase: step i + 1 goes out before step i is read
        t0 = time.perf_counter()
        held["pools"], prev, _, _ = runner.dispatch(params, held["pools"], held["rows"], tokens_on_device=True)
        for _ in range(n - 1):
            held["rows"] = advance(held["rows"])
            held["pools"], nxt, _, _ = runner.dispatch(params, held["pools"], held["rows"], tokens_on_device=True)
            np.asarray(prev)
            prev = nxt
        np.asarray(prev)
        held["rows"] = advance(held["rows"])
        return (time.perf_counter() - t0) / n * 1e3

    weights = weights_read_bytes(cfg, b)
    kv = b * n_ctx * cfg.mla_latent_dim * cfg.mixer_kinds.count("mla") * jnp.dtype(eng.dtype).itemsize
    state = 2 * b * Engine.bytes_per_state(cfg, eng.dtype)
    extra = dict(
        bucket=bucket,
        weight_gb=weights / 1e9,
        kv_gb=kv / 1e9,
        state_gb=state / 1e9,
        experts_read=expected_experts(cfg, b),
    )
    if chk["ok"]:
        chained(2)
        extra["chained_step_ms"] = chained(ctx.iters * 5)
        census = common.hlo_census(
            decode_program.lower(params, held["pools"], runner._io[bucket], cfg=cfg, kernels=eng.kernels, greedy=True)
            .compile()
            .as_text()
        )
        extra["launches"] = census["launches"]
    return ctx.row(case, chk, lambda: ctx.time(replay), work={"bytes": weights + kv + state}, extra=extra)


def demo_figures(text: str) -> dict:
    """Warm-up seconds, peak RSS GiB and the colocated row's TPOT figures from `kimik3 demo`'s output."""
    out = {}
    m = re.search(r"warm-up \(compiles\) ([\d.]+) s", text)
    out["warmup_s"] = float(m.group(1)) if m else None
    m = re.search(r"peak RSS of this process ([\d.]+) GiB", text)
    out["peak_rss_gib"] = float(m.group(1)) if m else None
    m = re.search(r"after each phase: ([^)]*)\)", text)
    out["rss_phases_gib"] = m.group(1) if m else None
    row = next((line for line in text.splitlines() if line.startswith("| colocated |")), None)
    if row:
        cells = [c.strip() for c in row.strip("|").split("|")]
        out["tpot_p50_ms"] = float(cells[4].split("/")[0])
        split = cells[5].split("/")
        out["tpot_decode_only_p50_ms"], out["tpot_mixed_p50_ms"] = (float(x) for x in split)
    return out


def _server(params, cfg, ec: EngineConfig, mode: str):
    if mode == "default":
        return Engine(params, cfg, ec)
    return DisaggregatedServer(
        Engine(params, cfg, ec.replace(role="prefill")), Engine(params, cfg, ec.replace(role="decode")), concurrent=True
    )


def run_load(server, prompts: list[list[int]], output: int, tag: str):
    """Submit every prompt at once and step until done; (summary, [(prompt, output tokens)])."""
    t0 = time.monotonic()
    reqs = [server.submit(p, output, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    try:
        while server.has_work():
            server.step()
    finally:
        if isinstance(server, DisaggregatedServer):
            server.close()
    wall = time.monotonic() - t0
    view = (
        (lambda r: server.requests.get(r.request_id, r)) if isinstance(server, DisaggregatedServer) else (lambda r: r)
    )
    runs = [(p, list(view(r).output)) for p, r in zip(prompts, reqs)]
    return metrics.summarize(tag, server.records()[-len(prompts) :], wall), runs


def serving_load(ctx):
    """serving_load: N requests at once through a fresh engine (or P/D pair) after a warm-up load of
    the same shape; ours_ms is TPOT p50."""
    for case in ctx.cases():
        for mode in ["default"] + ctx.wanted():
            yield ctx.attempt(case, mode, functools.partial(_load_row, ctx, case, mode))


def _load_row(ctx, case, mode: str):
    name, n, prompt, output = case
    params, cfg = serving_params(name), random_params(name)[1]
    ec = engine_config(cfg, n, prompt, output, ctx.ci)
    rng = np.random.default_rng(n)
    prompts = [rng.integers(0, 256, prompt).tolist() for _ in range(n)]
    programs = lambda: model.forward_step_jit._cache_size() + decode_program._cache_size()
    t0 = time.monotonic()
    if not ctx.ci:  # every prefill chunk and decode bucket compiled before anything is timed
        warm = _server(params, cfg, ec, mode)
        for eng in [warm] if mode == "default" else [warm.prefill, warm.decode]:
            eng.warmup()
        del warm
    run_load(
        _server(params, cfg, ec, mode),
        [rng.integers(0, 256, prompt).tolist() for _ in range(n)],
        min(output, 4),
        "warm",
    )
    warm_s, before = time.monotonic() - t0, programs()
    s, runs = run_load(_server(params, cfg, ec, mode), prompts, output, f"load{n}")
    chk = teacher_forced_check(random_params(name)[0], cfg, runs[:1])
    return ctx.row(
        case,
        chk,
        1e3 * s.tpot_s["p50"],
        variant=mode,
        extra=dict(
            ttft_p50_ms=1e3 * s.ttft_s["p50"],
            ttft_p99_ms=1e3 * s.ttft_s["p99"],
            tpot_p99_ms=1e3 * s.tpot_s["p99"],
            tpot_decode_only_p50_ms=1e3 * s.tpot_decode_only_s["p50"],
            throughput_tok_s=s.throughput_tok_s,
            warmup_s=warm_s,
            new_programs=programs() - before,
        ),
    )
