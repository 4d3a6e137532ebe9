"""Kimi-Linear against its all-MLA twin, served by one engine at the real shapes on one GPU: the
Kimi Linear report's speed figures (TPOT at long contexts, prefill, KV cache per token) as ratios
of two architectures with random weights.

* kl_decode: one decode step (TPOT) of the serving engine's decode program
  (`serving.decode_runner.decode_program`) for B requests of ctx cached tokens; the peer is the
  same step of the all-MLA twin (`kimik3.config.all_mla`).
* kl_prefill: one prompt of T tokens through the engine's chunked prefill program
  (`ModelRunner.forward`, chunk by chunk on paged pools); the peer is the twin's.

One architecture lives on the device at a time (Kimi-Linear and its twin take 29 GB each with
MXFP4 experts), drawn once a process: a benchmark runs every case of ours, frees it, then every
case of the twin, or the twin first where the previous benchmark left it (`_HELD`).  A case's row
comes out when the first model is timed and is yielded again, completed, with the second (the
runner rewrites its JSON at every row), so a run cut short keeps what it measured.  Params are
drawn on the device straight into the served layout (`kimik3.quant_store.init_served_params`,
the MXFP4 experts moved into the Hopper kernel's layout block by block).

Check: the fp32 reference cannot hold the full model, so each architecture's check runs the same
program (same kernels, manifest, synthetic pools, shuffled tables) on `check_config`: the
config itself where it is small (the ci preset), else the same variant cut to 3 layers, 32
experts and a 32768 vocabulary.  Its greedy tokens go against the fp32 model on the reference
kernels over the same pools (`serving_bench.margin_check`).

Registered in `benchmarks.registry` (suite "model").  Options (``--option kl_decode.KEY=VALUE``):
``manifest`` (the experts' storage, overriding the cases'), ``budget_s`` (this benchmark's own
time limit, within the run's ``--budget-s``), ``seed``; kl_decode also ``profile=1`` (each case's
device time by layer kind and half, `benchmarks.profile`, in extra.profile); kl_prefill also ``chunk`` (prefill
chunk tokens) and ``long=1`` (adds T = 256K and 512K: the twin's attention alone is ~10^17
FLOPs at 512K, minutes).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import profile
from benchmarks.serving_bench import margin_check, oracle, weights_read_bytes
from kimik3 import config, model, ops, quantization, sizing, tokenizer
from kimik3 import quant_store as store
from serving import kv_pools
from serving.decode_runner import DecodeRows, decode_program
from serving.model_runner import ModelRunner
from serving.sampling import GREEDY
from sharding import plan

log = logging.getLogger("benchmarks.kimi_linear")

FIRST_SHARE = 0.5  # of a benchmark's time budget, what the first model may take before the other's turn
LONG_T = (262144, 524288)  # kl_prefill's `long=1` cases
CHECK_CHUNK = 256  # prefill chunk tokens of a check config that is not its config (the fp32 reference is no-cache)
SMALL_PARAMS = 2e8  # configs below this many parameters are their own check config
CHECK_LAYOUTS = {"kda": ("kda", "kda", "mla"), "mla": ("mla", "mla", "mla")}
SCALES = {"pages": 0.5, "state": 0.05, "conv": 0.5}  # the synthetic pools' value ranges


# --------------------------------------------------------------------------- configs and params


def check_config(cfg: config.ModelConfig) -> config.ModelConfig:
    """The config a check's fp32 reference runs: `cfg` itself below SMALL_PARAMS parameters, else
    the same variant (every switch, width and head count) cut to 3 layers (KDA, KDA, MLA; the
    twin's all MLA; layer 0 dense), at most 32 routed experts (top-k unchanged) and a 32768-token
    vocabulary."""
    if sizing.param_count(cfg) < SMALL_PARAMS:
        return cfg
    layout = CHECK_LAYOUTS["kda" if "kda" in cfg.mixer_kinds else "mla"]
    return cfg.replace(
        name=f"{cfg.name}_check",
        n_layers=len(layout),
        mixer_layout=layout,
        dense_layers=min(cfg.dense_layers, 1),
        n_routed_experts=max(min(32, cfg.n_routed_experts), cfg.n_active_experts),
        vocab_size=min(cfg.vocab_size, 32768),
    )


def device_free_bytes() -> int | None:
    """Bytes the device's allocator can still hand out (its limit less what is in use), or None
    where the device reports no memory statistics (the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.1f} GB"


def build(cfg: config.ModelConfig, manifest: str, seed: int, *, kernel_layout: bool = True):
    """Random params of `cfg` in the served layout of `manifest`, drawn block by block on the device
    (`store.init_served_params`); with kernel_layout the MXFP4 experts are moved into the Hopper
    kernel's layout block by block (`ops.hopper_mxfp4_experts`, what the model runner does whole)."""
    t0 = time.monotonic()
    move = (lambda i, block: ops.hopper_mxfp4_experts(block, cfg.dtype)) if kernel_layout else None
    params = store.init_served_params(cfg, jax.random.PRNGKey(seed), manifest, on_layer=move)
    jax.block_until_ready(params)
    log.info(
        "%s (%s): drawn in %.1f s; device free %s",
        cfg.name,
        manifest,
        time.monotonic() - t0,
        _gb(device_free_bytes()),
    )
    return params


def release() -> None:
    """Let go of what the last architecture left (its params once the caller dropped them)."""
    gc.collect()
    log.info("released; device free %s", _gb(device_free_bytes()))


# --------------------------------------------------------------------------- synthetic pools


def _hash_fill(shape, dtype, salt: int, scale: float):
    """A deterministic value pattern of `shape` in [-scale, scale): a 32-bit hash (murmur3's
    finalizer) of each element's row and column, no two rows alike.  One fused write on the device."""
    rows, cols = shape[0], math.prod(shape[1:])
    u32 = lambda v: jnp.uint32(v & 0xFFFFFFFF)
    r = jax.lax.broadcasted_iota(jnp.uint32, (rows, cols), 0)
    c = jax.lax.broadcasted_iota(jnp.uint32, (rows, cols), 1)
    x = r * u32(0x9E3779B1) + c * u32(0x85EBCA77) + u32(salt)
    x = (x ^ (x >> 16)) * u32(0x7FEB352D)
    x = (x ^ (x >> 15)) * u32(0x846CA68B)
    x = x ^ (x >> 16)
    unit = (x >> 8).astype(jnp.float32) * (2.0 / (1 << 24)) - 1.0
    return (unit * scale).astype(dtype).reshape(shape)


@functools.partial(jax.jit, static_argnames=("cfg", "num_pages", "num_slots", "page_tokens", "dtype", "seed"))
def synthetic_pools(*, cfg, num_pages: int, num_slots: int, page_tokens: int, dtype: str, seed: int):
    """Paged pools (`model.init_paged_cache`'s layout) filled with `_hash_fill` patterns instead of
    a prefill: MLA pages in [-0.5, 0.5), KDA states in [-0.05, 0.05), conv rows in [-0.5, 0.5)."""
    shapes = jax.eval_shape(lambda: model.init_paged_cache(cfg, num_pages, num_slots, page_tokens, dtype))

    def fill(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        salt = seed * 0x632BE5AB + sum(ord(ch) * 31**i for i, ch in enumerate(name))
        return _hash_fill(leaf.shape, leaf.dtype, salt, SCALES[name.rsplit("/", 1)[-1]])

    return jax.tree_util.tree_map_with_path(fill, shapes)


def _pool_bytes(cfg, num_pages: int, num_slots: int, page: int, dtype) -> int:
    return num_pages * kv_pools.bytes_per_page(cfg, page, dtype) + num_slots * kv_pools.bytes_per_state(cfg, dtype)


def _fits(need: int, free: int | None) -> bool:
    return free is None or need + plan.RESERVE_BYTES <= free


# --------------------------------------------------------------------------- the two-phase driver


@dataclasses.dataclass
class Setting:
    """What one benchmark's cases share: page and KDA block sizes, the manifest, the seed, the
    kernels, its deadline and the time the first model may take (`FIRST_SHARE`)."""

    page: int
    kblock: int
    manifest: str | None  # None: each case's own
    seed: int
    kernels: str
    start: float
    end: float

    @property
    def first_until(self) -> float:
        return self.start + FIRST_SHARE * (self.end - self.start) if math.isfinite(self.end) else self.end


def _setting(ctx) -> Setting:
    page = 16 if ctx.ci else 128
    start = time.monotonic()
    budget = float(ctx.options.get("budget_s", "inf"))
    return Setting(
        page=page,
        kblock=12 * page,
        manifest=ctx.options.get("manifest"),
        seed=int(ctx.options.get("seed", "0")),
        kernels=ops.resolve("auto"),
        start=start,
        end=min(ctx.deadline, start + budget),
    )


def _groups(cases, manifest: str | None) -> dict:
    """{(config name, manifest): [(case as registered, case as run)]} in the cases' order (the
    manifest option replaces each case's)."""
    out: dict = {}
    for case in cases:
        run = (case[0], manifest or case[1], *case[2:])
        out.setdefault(run[:2], []).append((case, run))
    return out


def _new_row(ctx, run) -> dict:
    """A case's row before either model is measured (filled in by `_fill_ours` / `_fill_twin`)."""
    return ctx.row(run, None, None)


def _fill_ours(ctx, row: dict, run, chk: dict | None, fig: dict) -> None:
    """Ours' figure into `row`: timed (`ctx.row`'s fields), failed (its check failed: not timed) or
    skipped (why in extra.error)."""
    if "skip" in fig and not (chk is not None and not chk["ok"]):
        row.update(status="skipped", check=chk)
        row["extra"]["error"] = fig["skip"]
        return
    made = ctx.row(run, chk, None if "skip" in fig else fig["ms"], work=fig.get("work"), extra=fig.get("extra"))
    for key in ("check", "status", "ours_ms", "ceiling_kind", "fraction_of_ceiling"):
        row[key] = made[key]
    row["extra"].update(made["extra"])
    _ratio(row)


def _fill_twin(row: dict, twin: config.ModelConfig, chk: dict | None, fig: dict) -> None:
    """The twin's figure into `row`: peer and peer_ms, its own figures as extra.peer_*; or why not
    in extra.peer_error."""
    row["extra"]["peer_check"] = chk
    if "skip" in fig:
        row["extra"]["peer_error"] = fig["skip"]
    elif chk is not None and not chk["ok"]:
        row["extra"]["peer_error"] = "the twin's check failed: not timed"
    else:
        row["peer"], row["peer_ms"] = f"{twin.name} (all-MLA twin)", fig["ms"]
        for key, value in fig.get("extra", {}).items():
            row["extra"][f"peer_{key}"] = value
    _ratio(row)


def _ratio(row: dict) -> None:
    """ratio = ours / twin (the registry's: below 1, ours is faster); extra.speedup_vs_twin its inverse."""
    if row["ours_ms"] and row["peer_ms"]:
        row["ratio"] = row["ours_ms"] / row["peer_ms"]
        row["extra"]["speedup_vs_twin"] = row["peer_ms"] / row["ours_ms"]


def _two_phase(ctx, s: Setting, arch_runs):
    """The rows of every case, one model at a time: ours, then the twin, or the twin first where
    an earlier benchmark of this process left it on the device (`_HELD`).  A case's row is
    yielded when the first model's figure is in and again, completed, with the second's.
    arch_runs(cfg, manifest, runs, deadline) yields ("check", check) once, then (run, fig) per
    case: fig {"ms", "work", "extra"} or {"skip": why}."""
    for (name, manifest), pairs in _groups(ctx.cases(), s.manifest).items():
        cfg = config.get_config(name)
        twin = config.all_mla(cfg)
        runs = [r for _, r in pairs]
        order = [("ours", cfg), ("twin", twin)]
        if _HELD.get("key") == (twin, manifest, s.seed):
            order.reverse()
        rows: dict = {}
        for i, (role, arch) in enumerate(order):
            if i == 0:
                todo, deadline = runs, s.first_until
            else:  # the twin runs where ours was timed; ours runs wherever the twin ran
                todo, deadline = [r for r in runs if role == "ours" or rows[r]["ours_ms"]], s.end
            chk = None
            for key, value in _phase(arch_runs, arch, manifest, todo, deadline, role):
                if key == "check":
                    chk = value
                    continue
                row = rows.setdefault(key, _new_row(ctx, key))
                if role == "ours":
                    _fill_ours(ctx, row, key, chk, value)
                else:
                    _fill_twin(row, twin, chk, value)
                yield row
            for run in [r for r in runs if r not in rows]:  # never reached: no row yet
                rows[run] = _new_row(ctx, run)
                why = {"skip": f"skipped: the {role} phase did not reach it"}
                if role == "ours":
                    _fill_ours(ctx, rows[run], run, None, why)
                else:
                    _fill_twin(rows[run], twin, None, why)
                yield rows[run]


def _phase(arch_runs, cfg, manifest, runs, deadline, role):
    """arch_runs' items for one architecture; what it raises becomes a skip of its remaining cases
    (the error in the row); past `deadline` each case is a skip without building anything."""
    log.info("%s: %s (%s), %d cases", role, cfg.name, manifest, len(runs))
    if time.monotonic() > deadline or not runs:
        for run in runs:
            yield run, {"skip": "skipped: the budget was spent"}
        return
    done = set()
    try:
        for key, value in arch_runs(cfg, manifest, runs, deadline):
            if key != "check":
                done.add(key)
            yield key, value
    except Exception as e:  # noqa: BLE001 - reported in the rows
        log.exception("%s (%s) raised", cfg.name, manifest)
        why = f"{type(e).__name__}: {str(e)[:300]}"
        for run in runs:
            if run not in done:
                yield run, {"skip": why}
    finally:
        release()


# The last full-size architecture built in this process, kept on the device until another is
# needed: {"key": (cfg, manifest, seed), "params": its served params}.  kl_decode ends with the
# twin, which kl_prefill then measures first instead of drawing it again.
_HELD: dict = {}


def _drop_held(unless=None) -> None:
    if _HELD and _HELD.get("key") != unless:
        log.info("dropping %s (%s)", _HELD["key"][0].name, _HELD["key"][1])
        _HELD.clear()
        release()


def _checked_params(cfg, manifest: str, runs, s: Setting, check):
    """The generator part every arch_runs starts with: yields ("check", check(check config, plain
    params, served params)), then returns the served params of `cfg` (held in `_HELD`: drawn once
    per process while no other architecture is needed; the check's own where `cfg` is its own check
    config), or None after yielding a skip per run: the check failed, or the weights do not fit the
    device's free memory."""
    key = (cfg, manifest, s.seed)
    _drop_held(unless=key)  # another architecture's params go before this one's check is drawn
    ccfg = check_config(cfg)
    plain = build(ccfg, manifest, s.seed, kernel_layout=False)
    served = ops.hopper_mxfp4_experts(plain, ccfg.dtype)
    chk = check(ccfg, plain, served)
    yield "check", chk
    if not chk["ok"]:
        for run in runs:
            yield run, {"skip": "not timed: the check failed"}
        return None
    if _HELD.get("key") == key:
        log.info("%s (%s): params kept from the previous benchmark", cfg.name, manifest)
        return _HELD["params"]
    if ccfg is cfg:
        _HELD.update(key=key, params=served)
        return served
    del plain, served
    release()
    free = device_free_bytes()
    need = sizing.weight_bytes(cfg, quantization.MANIFESTS[manifest])
    if not _fits(need, free):
        for run in runs:
            yield run, {"skip": f"skipped: weights {_gb(need)} do not fit in {_gb(free)} free"}
        return None
    _HELD.update(key=key, params=build(cfg, manifest, s.seed))
    return _HELD["params"]


# --------------------------------------------------------------------------- decode


def _decode_steps(ctx) -> int:
    """Decode steps one case runs (its first call, warm-up, timed calls, a margin): each advances
    every row's length by one, so its pages must hold them."""
    return 2 + ctx.warmup + ctx.iters


def _decode_rows(cfg, b: int, n_ctx: int, steps: int, width: int, num_pages: int, page: int, seed: int):
    """DecodeRows for b requests of n_ctx cached tokens, pages for `steps` more, on shuffled pages
    (page 0 is the null page) and shuffled slots (the scratch slot is b), distinct first tokens."""
    rng = np.random.default_rng(seed * 1_000_003 + b * 7919 + n_ctx)
    per_seq = -(-(n_ctx + steps) // page)
    tables = rng.permutation(np.arange(1, num_pages))[: b * per_seq].reshape(b, per_seq)
    first = rng.integers(0, cfg.vocab_size, b)
    return DecodeRows.build(
        b,
        first.tolist(),
        list(tables),
        rng.permutation(b).tolist(),
        [n_ctx] * b,
        [GREEDY] * b,
        max_pages=width,
        null_page=0,
        scratch_slot=b,
    )


def _decode_check(cfg, manifest: str, s: Setting, plain, served, width: int) -> dict:
    """margin_check of one decode step of the engine's program (`served` params) against the fp32
    model on the reference kernels (`plain` params) on the same synthetic pools and rows: 8 rows
    (4 on the CPU) of 2 pages + 5 tokens, the program's page table `width` pages wide (the timed
    cases' widest: the kernels `kimik3.ops` picks by the table's span are theirs), the reference's
    cut to the pages in use."""
    b = 4 if jax.default_backend() == "cpu" else 8
    n_ctx = 2 * s.page + 5
    per_seq = -(-(n_ctx + 1) // s.page)
    num_pages = b * per_seq + 1
    pools = synthetic_pools(
        cfg=cfg, num_pages=num_pages, num_slots=b + 1, page_tokens=s.page, dtype=cfg.dtype, seed=s.seed + 1
    )
    rows = _decode_rows(cfg, b, n_ctx, 1, max(width, per_seq), num_pages, s.page, s.seed + 1)
    ref_pools = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, pools)
    view = model.paged_view(ref_pools, rows.tables[:b, :per_seq], rows.slots[:b], rows.lengths[:b])
    p32, cfg32 = oracle(plain, cfg)
    with jax.default_matmul_precision("highest"):
        ref, _ = model.forward_step_jit(
            p32,
            jnp.asarray(rows.tokens[:b, None]),
            jnp.asarray(rows.lengths[:b, None]),
            view,
            None,
            cfg=cfg32,
            expert_path="grouped",
            kernels="reference",
        )
    ref = np.asarray(ref[:, -1])
    del ref_pools, view, p32
    _, io = decode_program(served, pools, jax.device_put(rows.as_dict()), cfg=cfg, kernels=s.kernels, greedy=True)
    chk = margin_check(ref, np.asarray(io["tokens"])[:b], cfg)
    chk.update(config=cfg.name, rows=b, ctx=n_ctx)
    log.info("%s (%s) decode check: %s", cfg.name, manifest, chk)
    return chk


def decode_work(cfg, manifest: str, b: int, n_ctx: int, dtype) -> dict:
    """Bytes one decode step must move: the weights it reads (`serving_bench.weights_read_bytes`,
    with the embedding table counted by the b rows it reads), every row's latent KV, every row's
    KDA state read and written.  Also the cache per token of context (KV + state over ctx)."""
    embed_bits = quantization.BITS_PER_VALUE[quantization.MANIFESTS[manifest].format_of("embed_vd")]
    weights = weights_read_bytes(cfg, b, manifest) - (cfg.vocab_size - b) * cfg.d_model * embed_bits / 8
    kv_token, state = plan.cache_bytes_per_request(cfg, 1, jnp.dtype(dtype).name)
    kv = b * n_ctx * kv_token
    return {
        "weights": weights,
        "kv": kv,
        "state": 2 * b * state,
        "bytes": weights + kv + 2 * b * state,
        "cache_bytes_per_token": (n_ctx * kv_token + state) / n_ctx,
    }


def _decode_arch(ctx, s: Setting):
    """arch_runs for kl_decode: the check, then per batch bucket (in the cases' order) one pool
    sized for its longest case that fits, filled once, and one compiled program (one page-table
    width: the longest case's) timing each of its cases."""
    steps = _decode_steps(ctx)

    def runs_of(cfg, manifest, runs, deadline):
        widest = max(-(-(r[3] + steps) // s.page) for r in runs)
        params = yield from _checked_params(
            cfg, manifest, runs, s, lambda c, p, q: _decode_check(c, manifest, s, p, q, widest)
        )
        if params is None:
            return
        dtype = params["embed_vd"].dtype
        buckets: dict = {}
        for run in runs:
            buckets.setdefault(run[2], []).append(run)
        for b, bruns in buckets.items():
            if time.monotonic() > deadline:  # no pool filled for cases that will not run
                for r in bruns:
                    yield r, {"skip": "skipped: the budget was spent"}
                continue
            width = max(-(-(r[3] + steps) // s.page) for r in bruns)
            free = device_free_bytes()
            pages_of = lambda n: 1 + b * -(-(n + steps) // s.page)
            need = lambda n: _pool_bytes(cfg, pages_of(n), b + 1, s.page, dtype) + b * cfg.vocab_size * 4
            fit = [r for r in bruns if _fits(need(r[3]), free)]
            for r in bruns:
                if r not in fit:
                    yield r, {"skip": f"skipped: its pools ({_gb(need(r[3]))}) do not fit in {_gb(free)} free"}
            if not fit:
                continue
            num_pages = pages_of(max(r[3] for r in fit))
            t0 = time.monotonic()
            holder = {
                "pools": synthetic_pools(
                    cfg=cfg, num_pages=num_pages, num_slots=b + 1, page_tokens=s.page, dtype=dtype.name, seed=s.seed
                )
            }
            jax.block_until_ready(holder["pools"])
            log.info(
                "%s B%d: pools of %d pages filled in %.2f s (%s); device free %s",
                cfg.name,
                b,
                num_pages,
                time.monotonic() - t0,
                _gb(_pool_bytes(cfg, num_pages, b + 1, s.page, dtype)),
                _gb(device_free_bytes()),
            )
            for i, r in enumerate(fit):
                # the bucket's first case compiles its program; the others reuse it and take
                # seconds, so they run up to the benchmark's end rather than this model's share
                if time.monotonic() > (deadline if i == 0 else s.end):
                    yield r, {"skip": "skipped: the budget was spent"}
                    continue
                yield r, _decode_case(ctx, s, cfg, r, params, holder, width, num_pages)
            del holder
            release()
        del params

    return runs_of


def _decode_case(ctx, s: Setting, cfg, run, params, holder, width: int, num_pages: int) -> dict:
    _, manifest, b, n_ctx = run
    rows = _decode_rows(cfg, b, n_ctx, _decode_steps(ctx), width, num_pages, s.page, s.seed)
    held = {"io": jax.device_put(rows.as_dict())}

    def step():  # the decode program alone, back to back on its buffers (no host reads)
        holder["pools"], held["io"] = decode_program(
            params, holder["pools"], held["io"], cfg=cfg, kernels=s.kernels, greedy=True
        )
        return held["io"]["tokens"]

    t0 = time.monotonic()
    jax.block_until_ready(step())
    first_s = time.monotonic() - t0
    ms = ctx.time(step)
    work = decode_work(cfg, manifest, b, n_ctx, params["embed_vd"].dtype)
    bw = ctx.ceilings.get("memory_gbs")
    extra = dict(
        tok_s=b / ms * 1e3,
        first_call_s=first_s,
        weight_gb=work["weights"] / 1e9,
        kv_gb=work["kv"] / 1e9,
        state_gb=work["state"] / 1e9,
        cache_bytes_per_token=work["cache_bytes_per_token"],
        table_pages=width,
        fraction_of_ceiling=work["bytes"] / (ms * 1e-3) / 1e9 / bw if bw else None,
    )
    if ctx.options.get("profile") == "1":  # where the step's device time goes, by layer kind and half
        extra["profile"] = profile.device_profile(step, 3, profile.model_part(cfg.mixer_kinds))
    log.info("%s %s: %.3f ms a step (first call %.1f s)", cfg.name, ctx.label(run), ms, first_s)
    return {"ms": ms, "work": {"bytes": work["bytes"]}, "extra": extra}


def kl_decode(ctx):
    """kl_decode: per case, one decode step of Kimi-Linear (ours) and of its all-MLA twin (peer),
    the engine's decode program on synthetic pools of ctx tokens a row (`_decode_arch`)."""
    s = _setting(ctx)
    yield from _two_phase(ctx, s, _decode_arch(ctx, s))


# --------------------------------------------------------------------------- prefill


def prefill_flops(cfg, t: int, chunk: int) -> float:
    """FLOPs of a prefill of t tokens: 2 x the active weights (less the embedding and the head) per
    token and the head once; MLA's expanded causal attention, H x (qk + v) x t^2 per layer; KDA's
    chunked form, about H x (6 K V + 2 C (K + V)) per token per layer (C: its chunk)."""
    lookups = 2 * cfg.vocab_size * cfg.d_model  # embedding and head
    linear = 2 * t * (sizing.active_param_count(cfg) - lookups) + 2 * cfg.d_model * cfg.vocab_size
    n_mla, n_kda = cfg.mixer_kinds.count("mla"), cfg.mixer_kinds.count("kda")
    attn = n_mla * cfg.mla_heads * (cfg.mla_qk_dim + cfg.v_head_dim) * float(t) ** 2
    k = cfg.kda_head_dim
    kda = n_kda * t * cfg.kda_heads * (6 * k * k + 2 * cfg.kda_chunk_size * 2 * k)
    return float(linear + attn + kda)


def _prompt(rng, cfg, n: int) -> np.ndarray:
    """n random token ids of the vocabulary, none of them <|image|> (a prompt without its images)."""
    tokens = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
    tokens[tokens == tokenizer.IMAGE_ID] = 0
    return tokens


def _chunks(t: int, chunk: int, page: int, kblock: int, slots: int):
    """The engine's chunks of a t-token prompt: (start, end, export offsets): KDA-block
    boundaries and the prompt's last full page strictly inside a chunk are exported by its pass
    (`Scheduler.plan_chunk`), at most `slots` of them."""
    bounds = sorted(set(range(kblock, t, kblock)) | ({t // page * page} if t // page * page < t else set()))
    out, start = [], 0
    while start < t:
        end = min(start + chunk, t)
        inside = [b - start for b in bounds if start < b < end]
        out.append((start, end, inside[:slots]))
        start = end
    return out


class _Prefill:
    """One prompt at a time through a `ModelRunner`'s unsharded chunk program on its own pools (one
    request: slot 0, the scratch slot 1), pages shuffled."""

    def __init__(self, params, cfg, s: Setting, chunk: int, max_t: int):
        self.cfg, self.s, self.chunk = cfg, s, chunk
        self.runner = ModelRunner(
            params,
            cfg,
            kernels=s.kernels,
            role="both",
            mesh=None,
            dispatch="auto",
            num_slots=1,
            page_tokens=s.page,
            prefill_chunk_tokens=chunk,
            max_step_tokens=chunk + 1,
            export_slots=chunk // s.kblock + 2,
            scan_layers="none",
        )
        self.width = -(-max_t // s.page)
        self.num_pages = self.width + 1
        self.kv = types.SimpleNamespace(
            pools=model.init_paged_cache(cfg, self.num_pages, 2, s.page, params["embed_vd"].dtype)
        )

    def run(self, tokens, seed: int, *, limit: int | None = None):
        """Prefill `tokens` [T] as a fresh request (its KDA slot zeroed first) on shuffled pages;
        returns the last chunk's logits [1, 1, V] on the device.  limit: run only this many chunks."""
        t = len(tokens)
        pages = np.random.default_rng(seed).permutation(np.arange(1, self.num_pages))[: -(-t // self.s.page)]
        table = np.zeros((1, self.width), np.int32)
        table[0, : len(pages)] = pages
        self.kv.pools = _zero_slot(self.kv.pools, 0)
        logits = None
        parts = _chunks(t, self.chunk, self.s.page, self.s.kblock, self.runner.export_slots)
        for start, end, offsets in parts[:limit]:
            logits, *_ = self.runner.forward(
                self.kv,
                np.asarray(tokens[None, start:end], np.int32),
                table,
                np.zeros(1, np.int32),
                np.asarray([start], np.int32),
                export_offsets=offsets,
            )
        return logits


@functools.partial(jax.jit, donate_argnums=0)
def _zero_slot(pools, slot):
    """The pools with KDA slot `slot` of every layer zeroed (a fresh request's state), in place."""
    n = pools["kda"]["state"].shape[0] // 2
    rows = slot + 2 * jnp.arange(n)
    kda = {k: v.at[rows].set(0) for k, v in pools["kda"].items()}
    return dict(pools, kda=kda)


def _prefill_check(cfg, manifest: str, s: Setting, plain, served, chunk: int) -> dict:
    """margin_check of the greedy token after prefilling two prompts of 2.5 chunks and 3 tokens (the
    last chunk padded) through the chunk program (`served`), against the fp32 model on the
    reference kernels without a cache (`plain`)."""
    rng = np.random.default_rng(s.seed + 2)
    lengths = (2 * chunk + chunk // 2 + 3,) * 2  # one length: one reference program
    pre = _Prefill(served, cfg, s, chunk, max(lengths))
    p32, cfg32 = oracle(plain, cfg)
    refs, tokens = [], []
    for i, n in enumerate(lengths):
        prompt = _prompt(rng, cfg, n)
        logits = pre.run(prompt, s.seed + i)
        tokens.append(int(np.argmax(np.asarray(logits)[0, -1])))
        with jax.default_matmul_precision("highest"):
            ref = model.forward(p32, cfg32, jnp.asarray(prompt[None]), kernels="reference")[0]
        refs.append(np.asarray(ref[0, -1]))
    chk = margin_check(np.stack(refs), tokens, cfg)
    chk.update(config=cfg.name, prompts=list(lengths), chunk=chunk)
    log.info("%s (%s) prefill check: %s", cfg.name, manifest, chk)
    return chk


def _prefill_arch(ctx, s: Setting, chunk: int):
    """arch_runs for kl_prefill: the check (chunks of 256 tokens on `check_config`, of `chunk` on
    a config that is its own), then one runner and pool sized for the longest prompt that fits,
    timing each case: the first chunk once (its compile), the first 3 chunks twice (warm-up), then
    the whole prompt, 3 times below 16K tokens, 2 below 64K, else once (1 on the CPU); the figure
    is the mean, the last run's logits waited for."""

    def runs_of(cfg, manifest, runs, deadline):
        params = yield from _checked_params(
            cfg,
            manifest,
            runs,
            s,
            lambda c, p, q: _prefill_check(c, manifest, s, p, q, chunk if c is cfg else CHECK_CHUNK),
        )
        if params is None:
            return
        dtype = params["embed_vd"].dtype
        free = device_free_bytes()
        need = lambda t: _pool_bytes(cfg, -(-t // s.page) + 1, 2, s.page, dtype)
        fit = [r for r in runs if _fits(need(r[2]), free)]
        for r in runs:
            if r not in fit:
                yield r, {"skip": f"skipped: its pools ({_gb(need(r[2]))}) do not fit in {_gb(free)} free"}
        if fit and time.monotonic() > deadline:
            for r in fit:
                yield r, {"skip": "skipped: the budget was spent"}
        elif fit:
            pre = _Prefill(params, cfg, s, chunk, max(r[2] for r in fit))
            for r in fit:
                if time.monotonic() > deadline:
                    yield r, {"skip": "skipped: the budget was spent"}
                    continue
                yield r, _prefill_case(ctx, s, cfg, r, pre)
            del pre
        del params

    return runs_of


def _prefill_case(ctx, s: Setting, cfg, run, pre: _Prefill) -> dict:
    _, manifest, t = run
    tokens = _prompt(np.random.default_rng(s.seed + t), cfg, t)
    t0 = time.monotonic()
    jax.block_until_ready(pre.run(tokens, s.seed, limit=1))  # the chunk program's compile
    first_s = time.monotonic() - t0
    for _ in range(2):  # warm: the pools as a chunk's outputs, the slot reset, a chunk that exports
        jax.block_until_ready(pre.run(tokens, s.seed, limit=3))
    reps = 1 if ctx.ci else 3 if t < 16384 else 2 if t < 65536 else 1
    t0 = time.perf_counter()
    for i in range(reps):
        logits = pre.run(tokens, s.seed + i)
    jax.block_until_ready(logits)
    ms = (time.perf_counter() - t0) / reps * 1e3
    flops = prefill_flops(cfg, t, pre.chunk)
    tf = ctx.ceilings.get("compute_tflops")
    kv_token, state = plan.cache_bytes_per_request(cfg, 1, jnp.dtype(cfg.dtype).name)
    extra = dict(
        tok_s=t / ms * 1e3,
        first_chunk_s=first_s,
        chunk_tokens=pre.chunk,
        chunks=-(-t // pre.chunk),
        runs=reps,
        tflop=flops / 1e12,
        cache_bytes_per_token=(t * kv_token + state) / t,
        fraction_of_ceiling=flops / (ms * 1e-3) / 1e12 / tf if tf else None,
    )
    log.info("%s %s: %.1f ms (%.0f tok/s; first chunk %.1f s)", cfg.name, ctx.label(run), ms, extra["tok_s"], first_s)
    return {"ms": ms, "work": {"flops": flops}, "extra": extra}


def kl_prefill(ctx):
    """kl_prefill: per case, one T-token prompt prefilled by Kimi-Linear (ours) and by its all-MLA
    twin (peer) through the engine's chunk program (`_prefill_arch`)."""
    s = _setting(ctx)
    chunk = int(ctx.options.get("chunk", "32" if ctx.ci else "4096"))
    if ctx.options.get("long") == "1" and not ctx.ci:
        name, manifest = ctx.bench.shapes["full"][0][:2]
        extra = tuple((name, manifest, t) for t in LONG_T)
        shapes = dict(ctx.bench.shapes, full=ctx.bench.shapes["full"] + extra)
        ctx = dataclasses.replace(ctx, bench=dataclasses.replace(ctx.bench, shapes=shapes))
    yield from _two_phase(ctx, s, _prefill_arch(ctx, s, chunk))
