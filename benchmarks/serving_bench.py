"""Serving benchmark: colocated vs prefill/decode disaggregated at rising load.

    PYTHONPATH=$PWD python3 benchmarks/serving_bench.py --config small [--out DIR]
    PYTHONPATH=$PWD python3 benchmarks/serving_bench.py --config tiny --quick     # CPU smoke test

For each mode and each load (N concurrent requests of `--prompt` tokens and
`--output` new tokens) it reports TTFT / TPOT / throughput percentiles, then
the largest load whose median TPOT stays under `--tpot-target-ms` per mode
(the production design's colocated experiment).  It also times one decode
step at batch B against its roofline: bytes of weights plus KV and KDA state
read per step over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from kimik3 import compile_cache, config, model, quantization, sizing, stacked
from kimik3.quant import store
from serving import metrics
from serving.disagg import DisaggregatedServer
from serving.engine import Engine, EngineConfig
from serving.model_runner import SCAN_CHOICES, DecodeRows, DecodeRunner, decode_program
from serving.sampling import GREEDY


def programs() -> int:
    """Compiled model step programs in this process (`model._forward`, the engines' `forward_step` and
    `serving.model_runner.decode_program`)."""
    return model._forward._cache_size() + model.forward_step._cache_size() + decode_program._cache_size()


def make(params, cfg, mode, args):
    ec = EngineConfig(num_pages=args.pages, num_slots=args.max_load, num_snapshots=2 * args.max_load,
                      page_tokens=args.page_tokens, kda_block_tokens=args.page_tokens * 12,
                      max_pages_per_request=-(-(args.prompt + args.output) // args.page_tokens) + 1,
                      prefill_chunk_tokens=args.chunk, kernels=args.kernels,
                      prefill_tokens_while_decoding=args.prefill_while_decoding, scan_layers=args.scan)
    if mode == "colocated":
        return Engine(params, cfg, ec)
    devices = pd_devices(args)
    engines = []
    for role, device in zip(("prefill", "decode"), devices):
        with jax.default_device(device) if device is not None else contextlib.nullcontext():
            # params committed to the engine's device, its pools made there: its steps run there
            p = jax.device_put(params, device) if device is not None else params
            engines.append(Engine(p, cfg, ec.replace(role=role)))
    return DisaggregatedServer(*engines, concurrent=args.pd_stepping == "concurrent", devices=devices)


def pd_devices(args):
    """(prefill device, decode device) from --pd-devices "i,j" (None, None: the default device)."""
    if not args.pd_devices:
        return (None, None)
    ids = [int(x) for x in args.pd_devices.split(",")]
    if len(ids) != 2 or max(ids) >= len(jax.devices()):
        raise SystemExit(f"--pd-devices wants two of the {len(jax.devices())} devices' indices; got {args.pd_devices}")
    return tuple(jax.devices()[i] for i in ids)


def run_load(server, n, args, seed, output=None):
    """n requests of --prompt tokens, all at once, or one every --arrival-ms (long prompts
    arriving while the earlier ones decode: the interference P/D is meant to remove)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, args.prompt).tolist() for _ in range(n)]
    interval_s = getattr(args, "arrival_ms", 0) / 1e3
    t0 = time.monotonic()
    next_s, i = t0, 0
    try:
        while i < n or server.has_work():
            while i < n and time.monotonic() >= next_s:
                server.submit(prompts[i], output or args.output, request_id=f"r{seed}-{i}")
                i, next_s = i + 1, next_s + interval_s
            if server.has_work():
                server.step()
            elif i < n:
                time.sleep(max(0.0, min(0.001, next_s - time.monotonic())))
    finally:
        if isinstance(server, DisaggregatedServer):
            server.close()
    return metrics.summarize(f"N={n}", server.records()[-n:], time.monotonic() - t0)


def expected_experts(cfg, rows: int) -> float:
    """Routed experts a decode step over `rows` requests (padded to any bucket) reads per MoE layer,
    expected under uniform routing: each row picks k of G distinct experts (the bucket's idle
    rows are routed to none: `LatentMoE(real_bt=)`)."""
    g, k = cfg.n_routed_experts, cfg.n_active_experts
    return g * (1 - ((g - k) / g) ** rows)


def weights_read_bytes(cfg, rows: int, manifest: str = "bf16") -> float:
    """Weight bytes a decode step reads, stored as `manifest` says: every weight but the routed
    experts, and of those the `expected_experts` share (B1 reads 4 of 32, B32 nearly all)."""
    rules = quantization.MANIFESTS[manifest]
    bits = quantization.BITS_PER_VALUE[rules.format_of("layer_1/moe/w_gate_elf")]
    per_expert = 3 * cfg.moe_latent_dim * cfg.moe_expert_dim * bits / 8  # gate, up, down
    n_moe = sum(cfg.ffn_kind(i) == "moe" for i in range(cfg.n_layers))
    routed = n_moe * cfg.n_routed_experts * per_expert
    share = expected_experts(cfg, rows) / cfg.n_routed_experts
    return sizing.weight_bytes(cfg, rules) - routed * (1 - share)


def decode_roofline(params, cfg, args, copy_gbs, b):
    """One decode step at batch B with `context` cached tokens per sequence vs its byte roofline;
    with `--profile-step`, also the step's busiest device ops (rows of section "profile")."""
    ctx = args.prompt
    t0 = time.monotonic()
    say = lambda what: print(f"decode B{b}: {what} at {time.monotonic() - t0:.1f} s", flush=True)
    eng = make(params, cfg, "colocated", args)
    table = np.arange(1, 1 + b * (-(-ctx // args.page_tokens) + 1)).reshape(b, -1) % eng.manager.page_pool.num_blocks
    pad = np.zeros((b, eng.max_pages - table.shape[1]), np.int64)
    rows = (np.concatenate([table, pad], 1), np.arange(b), np.full(b, ctx))  # host arrays: the view is donated
    positions = jnp.full((b, 1), ctx, jnp.int32)
    pools = [eng.pools]
    # Distinct tokens per row, as real requests have: identical rows (all token 0 over zero pools)
    # route every row to the same top-k experts, so a step would read k of the experts' weights
    # where a real B32 batch reads nearly all of them (the roofline counts them all).
    first = np.random.default_rng(b).integers(0, cfg.vocab_size, b).astype(np.int32)
    tokens = jnp.asarray(first[:, None])

    forward = {}
    if args.forward_step:  # the pre-runner path (logits to the host): one more program to compile per batch
        def step():  # pools donated and threaded through, context fixed at ctx
            logits, out = model.forward_step(params, tokens, positions,
                                             model.paged_view(pools[0], *rows), None, cfg=cfg,
                                             expert_path="grouped", kernels=eng.kernels)
            pools[0] = model.pools_of(out)
            return logits

        forward["forward_step_ms"] = common.time_jax(step)
        forward["forward_pipelined_ms"], forward["forward_host_ms"] = common.time_pipelined(step)

    # The engine's decode path: `serving.model_runner` (persistent buffers, sampling on the device),
    # at the engine's bucket for b requests (at least 8 rows: a one-row step would also meet XLA's
    # dot strength reduction, broadcast-multiply + reduce, which writes every weight-sized product).
    runner, bucket = DecodeRunner(cfg, eng.kernels), eng.runner.decode_bucket(b)
    held = {"pools": pools[0], "rows": DecodeRows.build(bucket, first.tolist(), rows[0].tolist(), rows[1].tolist(),
                                                          rows[2].tolist(), [GREEDY] * b, max_pages=eng.max_pages,
                                                          null_page=0, scratch_slot=eng.scratch_slot)}

    def engine_step():  # dispatch, read the tokens (the host waits), advance: a synchronous loop
        held["pools"], tokens, did, _ = runner.dispatch(params, held["pools"], held["rows"])
        out = np.asarray(tokens)
        runner.settle(held["rows"], out, did)
        held["rows"] = held["rows"].advanced(out)
        return tokens

    runner_ms = common.time_jax(engine_step, iters=10)
    say("decode program compiled and timed")
    overwrites = runner.overwrites

    def advance(rows):  # what the device did: active rows advance, padding rows stay (no overwrite)
        return dataclasses.replace(rows, lengths=rows.lengths + rows.active)

    def async_steps(n=20):  # the engine's decode-only phase: step i+1 goes out before step i is read
        t0 = time.perf_counter()
        held["pools"], prev, _, _ = runner.dispatch(params, held["pools"], held["rows"], tokens_on_device=True)
        for _ in range(n - 1):
            held["rows"] = advance(held["rows"])
            held["pools"], tokens, _, _ = runner.dispatch(params, held["pools"], held["rows"],
                                                          tokens_on_device=True)
            np.asarray(prev)
            prev = tokens
        np.asarray(prev)
        held["rows"] = advance(held["rows"])
        return (time.perf_counter() - t0) / n * 1e3

    async_steps(3)
    before = runner.overwrites
    async_ms = async_steps()
    async_overwrites = runner.overwrites - before  # 0: the loop chained on the device's buffers

    def replay():  # the decode program alone, back to back on its buffers (no host reads)
        held["pools"], runner._io[bucket] = decode_program(params, held["pools"], runner._io[bucket], cfg=cfg,
                                                            kernels=eng.kernels, greedy=True)
        return runner._io[bucket]["tokens"]

    replay_ms, replay_host_ms = common.time_pipelined(replay, iters=10)
    # launches of the program the engine runs (lower().compile() hits the compile the runner did)
    compiled = decode_program.lower(params, held["pools"], runner._io[bucket], cfg=cfg, kernels=eng.kernels,
                                    greedy=True).compile()
    census = common.hlo_census(compiled.as_text())
    if args.dump_step_hlo:
        with open(os.path.join(args.out, f"decode_step_B{b}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
    # what the engine's decode program spends its device time on (the engine runs it, not forward_step)
    profile = []
    if args.profile_step:
        every = common.profile_kernels(replay, top=None)
        device = [r for r in every if r["where"] == "device"]
        profile = [dict(r, case=f"B{b}") for r in device[:42] + [r for r in every if r["where"] == "host"]]
        profile += [dict(r, case=f"B{b}") for r in common.by_source(every, common.hlo_sources(compiled.as_text()))]
    weights = weights_read_bytes(cfg, b, args.manifest or "bf16")
    kv = b * ctx * cfg.mla_latent_dim * cfg.mixer_kinds.count("mla") * jnp.dtype(eng.dtype).itemsize
    state = 2 * b * Engine.bytes_per_state(cfg, eng.dtype)
    roof_ms = (weights + kv + state) / (copy_gbs * 1e9) * 1e3
    return dict(section="decode step vs roofline", case=f"B{b} ctx{ctx}", decode_bucket=bucket, async_step_ms=async_ms,
                runner_step_ms=runner_ms, runner_overwrites=overwrites, async_overwrites=async_overwrites, replay_ms=replay_ms, replay_host_ms=replay_host_ms,
                **forward,
                roofline_ms=roof_ms, of_roofline=roof_ms / async_ms,
                weight_gb=weights / 1e9, experts_read=expected_experts(cfg, b), kv_gb=kv / 1e9, state_gb=state / 1e9, launches=census["launches"],
                ops=str(census["ops"])[:200]), profile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--loads", default="1,4,16,32")
    ap.add_argument("--tpot-target-ms", type=float, default=50.0)
    ap.add_argument("--page-tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--kernels", default="auto", help="auto | reference | pallas (kimik3.ops)")
    ap.add_argument("--manifest", default=None, help="serve the random weights quantized as this manifest (fp8_attn, ...)")
    ap.add_argument("--modes", default="colocated,pd", help="serving modes to sweep (colocated, pd)")
    ap.add_argument("--pd-stepping", default="concurrent", choices=("concurrent", "serial"),
                    help="P/D: each engine in its own thread (as separate instances run), or one loop stepping "
                         "both (a decode step then waits for every prefill step)")
    ap.add_argument("--arrival-ms", type=float, default=0.0,
                    help="submit a load's requests one every this many ms (0: all at once)")
    ap.add_argument("--pd-devices", default=None,
                    help='P/D: the prefill and decode engines\' devices, e.g. "0,1" (two GPUs; default: one device)')
    ap.add_argument("--profile-step", action="store_true",
                    help="trace the timed decode step with jax.profiler and tabulate its busiest device ops")
    ap.add_argument("--dump-step-hlo", action="store_true",
                    help="write the timed decode step's optimized HLO to --out (decode_step_B<b>.hlo.txt)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip loads that start after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--decode-batches", default=None,
                    help="batches of the decode-step section, e.g. 1,32 (default: the largest load)")
    ap.add_argument("--prefill-while-decoding", type=int, default=None,
                    help="EngineConfig.prefill_tokens_while_decoding (default: what the step budget leaves)")
    ap.add_argument("--scan", default="prefill", choices=SCAN_CHOICES,
                    help="EngineConfig.scan_layers: which programs scan the repeated periods (kimik3.stacked)")
    ap.add_argument("--forward-step", action="store_true",
                    help="also time model.forward_step (logits to the host) at each decode batch: one more compile each")
    ap.add_argument("--compile-cache", default=None,
                    help="persistent XLA cache dir (default $KIMIK3_COMPILE_CACHE or ~/.cache/kimik3/xla; 'off')")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    compile_cache.enable(args.compile_cache)  # as the demo does: a second run skips the compiles
    if args.quick:
        args.prompt, args.output, args.loads, args.chunk, args.page_tokens = 48, 6, "1,2", 64, 16
    loads = [int(x) for x in args.loads.split(",")]
    args.max_load = max(loads)
    args.pages = args.max_load * (-(-(args.prompt + args.output) // args.page_tokens) + 2) * 2 + 8
    cfg = config.get_config(args.config)
    # the layout the engines' decode programs read (the decode section times those programs)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    if args.manifest:  # the weights quantized as the manifest stores them (`kimik3.quant.store`)
        params = store.quantize_params(params, cfg, args.manifest)
    params = stacked.serving_layout(params, cfg, scan=args.scan == "all")
    xla_copy_gbs = common.copy_gbs()
    torch_gbs = common.torch_copy_gbs()
    copy_gbs = torch_gbs or xla_copy_gbs  # the honest ceiling: torch's copy_ where it runs
    rows = [dict(section="roofline", case=f"{jax.devices()[0].device_kind}", copy_gbs=copy_gbs,
                 torch_copy_gbs=torch_gbs, xla_copy_gbs=xla_copy_gbs)]
    common.write_results(args.out, "serving_bench", rows)  # a run cut short keeps what it measured
    best = {}
    t_start = time.monotonic()
    for mode in [m for m in args.modes.split(",") if m]:
        # Engine.warmup compiles every prefill chunk and decode bucket; a pass per load with short
        # outputs then warms the handoff's bookkeeping ops, so the sweep measures serving only.
        t0 = time.monotonic()
        server = make(params, cfg, mode, args)
        devices = (None,) if mode == "colocated" else pd_devices(args)
        for eng, device in zip([server] if mode == "colocated" else [server.prefill, server.decode], devices):
            with jax.default_device(device) if device is not None else contextlib.nullcontext():
                eng.warmup(threads=os.cpu_count())  # every chunk length and decode bucket, compiled concurrently
        print(f"warm-up {mode} compiles: {time.monotonic() - t0:.1f} s, {programs()} programs",
              flush=True)
        for n in loads:
            t1 = time.monotonic()
            run_load(make(params, cfg, mode, args), n, args, seed=999, output=4)
            print(f"warm-up {mode} N={n}: {time.monotonic() - t1:.1f} s, {programs()} programs",
                  flush=True)
        rows.append(dict(section="warm-up", mode=mode, seconds=time.monotonic() - t0,
                         programs=programs()))
        common.write_results(args.out, "serving_bench", rows)
        for n in loads:
            if time.monotonic() - t_start > args.budget_s:
                print(f"budget spent: skipping {mode} N={n}", flush=True)
                continue
            before = programs()
            s = run_load(make(params, cfg, mode, args), n, args, seed=n)
            rows.append(dict(section="load sweep", mode=mode, load=n, throughput_tok_s=s.throughput_tok_s,
                             ttft_p50_ms=1e3 * s.ttft_s["p50"], ttft_p99_ms=1e3 * s.ttft_s["p99"],
                             tpot_p50_ms=1e3 * s.tpot_s["p50"], tpot_p99_ms=1e3 * s.tpot_s["p99"],
                             tpot_decode_only_p50_ms=1e3 * s.tpot_decode_only_s["p50"],
                             tpot_mixed_p50_ms=1e3 * s.tpot_mixed_s["p50"],
                             new_programs=programs() - before))
            common.write_results(args.out, "serving_bench", rows)
            if 1e3 * s.tpot_s["p50"] <= args.tpot_target_ms:
                best[mode] = max(best.get(mode, 0), n)
    rows.append(dict(section=f"largest load with TPOT p50 <= {args.tpot_target_ms} ms",
                     colocated=best.get("colocated", 0), pd=best.get("pd", 0)))
    for b in [int(x) for x in (args.decode_batches or str(args.max_load)).split(",")]:
        t0 = time.monotonic()
        step_row, profile = decode_roofline(params, cfg, args, copy_gbs, b)
        print(f"decode section B{b}: {time.monotonic() - t0:.1f} s", flush=True)
        rows += [step_row] + profile
        common.write_results(args.out, "serving_bench", rows)
    print(f"total {time.monotonic() - t_start:.0f} s", flush=True)
    common.write_results(args.out, "serving_bench", rows)


if __name__ == "__main__":
    main()
