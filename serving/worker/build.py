"""The worker's engine from its parsed flags: weights, draft, KV pool, meshes, shared store and the
facts /health reports (`build_engine`), and the sampling programs compiled before the first
request (`warm_sampling_variants`).

A flag that contradicts another, or a size the model or the device cannot hold, is a ValueError
naming the flag, raised before the engine is made (the order of the checks is the order a user
meets them in).  JAX and the model are imported here on use: importing the worker imports no JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cache.block_pool import NULL_BLOCK
from cache.guarded_tier import GuardedHostKVTier
from cache.mooncake_tier import MooncakeHostKVTier
from kimik3 import config
from kimik3.text import load_serving_tokenizer
from serving import flags
from serving.metrics import CompileWatch
from serving.sampling import SamplingParams, choose_token, logprobs_of


def default_cache_geometry(config_name: str) -> tuple[int, int]:
    """(page_tokens, kda_block_tokens): the demo's small blocks on tiny, docs/design.md's elsewhere."""
    return (32, 128) if config_name == "tiny" else (128, 1536)


def load_weights(cfg, checkpoint_dir: str | None, seed: int, dtype: str | None, manifest: str | None):
    """(params, cfg, dtype): a checkpoint's weights (a quantized one as `manifest`; its own config,
    not `cfg`) cast to `dtype` (default: as stored), or `cfg`'s random weights from `seed` in
    `dtype` (default: the config's).  What a worker serves and what `serving.llm.LLM` loads."""
    # JAX and the model load on use (the module docstring)
    import jax

    from kimik3 import model

    if checkpoint_dir is not None:
        from kimik3 import quant_store as store  # on use, as above

        params, cfg = store.load_params(checkpoint_dir, manifest)
        dtype = dtype or str(params["embed_vd"].dtype)
        return model.cast_params(params, jax.numpy.dtype(dtype)), cfg, dtype
    dtype = dtype or cfg.dtype
    return model.init_params(cfg, jax.random.PRNGKey(seed), dtype), cfg, dtype


def build_engine(args):
    """(engine, host tier or None, info dict) from parsed worker arguments."""
    from serving.engine import Engine, EngineConfig  # JAX: loads on use (the module docstring)

    checkpoint, manifest = getattr(args, "checkpoint", None), getattr(args, "manifest", None)
    if manifest and not checkpoint:
        raise ValueError("--manifest names the quantized weights of a checkpoint: pass --checkpoint DIR")
    params, cfg, dtype = load_weights(
        None if checkpoint else config.get_config(args.config), checkpoint, args.seed, args.dtype, manifest
    )
    draft = _draft(args, cfg, params)
    page, block = default_cache_geometry(cfg.name)
    page = args.page_tokens or page
    block = args.kda_block_tokens or block
    max_len = getattr(args, "max_model_len", None) or cfg.max_seq_len
    if max_len > cfg.max_seq_len:
        raise ValueError(f"--max-model-len {max_len} is past {cfg.name}'s {cfg.max_seq_len} positions")
    num_pages = pool_pages(args, cfg, params, page)
    max_pages = min(args.max_pages_per_request or -(-max_len // page), num_pages - 1)
    namespace = args.namespace or f"{cfg.name}/{dtype}/{_weights_name(args, params)}"
    host = _host_tier(args)
    tok = load_serving_tokenizer(getattr(args, "tokenizer", None), checkpoint, cfg.vocab_size)
    publish = getattr(args, "publish_to_host", None)
    if publish and host is None:
        raise ValueError("--publish-to-host writes to a shared store: pass --mooncake-master")
    if draft is None and getattr(args, "draft_tokens", None):
        raise ValueError("--draft-tokens is for speculative decoding: add --speculative eagle3")
    eos_id = getattr(args, "eos_id", None)
    # every EngineConfig field is a flag (`serving.flags`): those set pass through, the ones the
    # worker sizes itself are resolved here, the rest keep the dataclass's defaults
    values = {f.name: getattr(args, f.name, None) for f in flags.engine_fields()}
    values = {k: v for k, v in values.items() if v is not None}
    values.update(
        num_pages=num_pages,
        num_snapshots=args.num_snapshots or 4 * args.num_slots,
        page_tokens=page,
        kda_block_tokens=block,
        max_pages_per_request=max_pages,
        namespace=namespace,
        role=args.role,
        publish_to_host=host is not None if publish is None else publish,
        draft_tokens=_draft_tokens(args) if draft is not None else 0,
        eagle_tail="no_drop" if getattr(args, "eagle_no_drop", False) else args.eagle_tail,
        eos_id=tok.eos_id if eos_id is None else eos_id,
    )
    engine = Engine(params, cfg, EngineConfig(**values), host=host, draft=draft, mesh=meshes(args, cfg))
    sizes = {"namespace": namespace, "page_tokens": page, "kda_block_tokens": block}
    info = _info(args, engine, cfg, dtype, tok, host, sizes, min(max_len, max_pages * page), draft is not None)
    return engine, host, info


def _draft(args, cfg, params):
    """The EAGLE-3 draft of `--speculative eagle3` (None without it), after the flags it needs."""
    spec = getattr(args, "speculative", None)
    if spec is None and getattr(args, "draft_checkpoint", None):
        raise ValueError("--draft-checkpoint is for speculative decoding: add --speculative eagle3")
    if spec is None:
        return None
    if not args.draft_checkpoint:
        raise ValueError("--speculative eagle3 needs the draft: --draft-checkpoint DIR (`kimik3 train-eagle`)")
    if not args.checkpoint:
        raise ValueError("--speculative eagle3 needs the target the draft was trained for: --checkpoint DIR")
    if args.role != "both":  # the HTTP handoff carries no draft feature yet (in-process P/D: serving.disagg)
        raise ValueError("--speculative eagle3 workers serve colocated (--role both)")
    from kimik3 import eagle_train  # JAX: loads on use (the module docstring)

    draft = eagle_train.load_draft(args.draft_checkpoint, cfg, params)
    if args.eagle_no_drop and args.eagle_tail not in ("drop", "no_drop"):
        raise ValueError(f"--eagle-no-drop contradicts --eagle-tail {args.eagle_tail}")
    return draft


def _weights_name(args, params) -> str:
    """The weights' part of the cache namespace: random ones by their seed, a checkpoint's by a
    fingerprint (of its embedding and LM head: `eagle_train.fingerprint`) and its manifest, so
    workers of other weights (or other projections of the same) never share KV."""
    if not getattr(args, "checkpoint", None):
        return f"seed{args.seed}"
    from kimik3 import eagle_train  # JAX: loads on use (the module docstring)

    weights = f"ckpt-{eagle_train.fingerprint(params)}"
    if getattr(args, "manifest", None):
        weights += f"-{args.manifest}"
    return weights


def _host_tier(args):
    """The shared store of `--mooncake-master` (None without it), behind a deadline and a breaker:
    a dead store turns into misses, not stalled steps."""
    if not args.mooncake_master:
        return None
    return GuardedHostKVTier(
        MooncakeHostKVTier(args.mooncake_master, args.mooncake_metadata, staging_bytes=args.staging_mb << 20),
        timeout_s=args.store_timeout_s,
        cooldown_s=args.store_cooldown_s,
    )


def _info(args, engine, cfg, dtype: str, tok, host, sizes: dict, max_context: int, speculative: bool) -> dict:
    """The facts /health reports: what a router checks its workers agree on and sizes requests by.
    `sizes`: the cache's namespace, page_tokens and kda_block_tokens."""
    role = args.role
    return {
        "role": role,
        "worker_id": args.worker_id or f"{role}-{args.port}",
        "model": cfg.name,
        "config": cfg.name,
        "dtype": dtype,
        "seed": args.seed,
        **sizes,
        "max_context": max_context,
        "vocab_size": cfg.vocab_size,
        "store": bool(host),
        "capacity": engine.capacity(),
        "tokenizer": tok.describe(),  # the router checks that its tokenizer ends requests at the same id
        # a KV handoff's layout (/adopt): one page block, and the packed KDA state
        "page_shape": list(engine.pages.block_shape),
        "snapshot_size": int(engine.snapshot_size),
        "speculative": None
        if not speculative
        else {"method": "eagle3", "draft_tokens": engine.config.draft_tokens, "eagle_tail": engine.config.eagle_tail},
    }


def _draft_tokens(args) -> int:
    """k of a speculative worker: --draft-tokens, else 3."""
    k = getattr(args, "draft_tokens", None)
    return 3 if k is None else k


def pool_pages(args, cfg, params, page_tokens: int) -> int:
    """KV pages of the device pool: `--num-pages`, or with `--gpu-memory-utilization F` what F of the
    device's memory holds once the weights are in (the slots' and snapshots' states first, as
    `Engine.from_memory_budget` sizes them; vLLM's flag, read the same way).  With
    `--data-parallel-size` D on a decode worker every rank's device holds its own 1/D share of the
    slots and snapshots and what is left in pages (sized on device 0, which holds the most
    weights): D times that in all."""
    util = getattr(args, "gpu_memory_utilization", None)
    if util is None:
        return args.num_pages or 256
    if args.num_pages:
        raise ValueError("--num-pages and --gpu-memory-utilization both size the KV pool: pass one")
    if not 0.0 < util <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must lie in (0, 1]; got {util}")
    # JAX loads on use (the module docstring)
    import jax

    from serving import kv_pools

    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(
            f"--gpu-memory-utilization needs a device that reports its memory ({jax.default_backend()} "
            f"does not): pass --num-pages"
        )
    # what the steps' activations and workspaces need is left out of the pool: 10% of the share
    budget = 0.9 * util * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    dp = max(1, getattr(args, "data_parallel_size", 1)) if args.role != "prefill" else 1
    dp //= max(1, getattr(args, "num_processes", None) or 1)  # in a process group: this process's ranks
    slots = args.num_slots // dp
    pages = kv_pools.pages_in_budget(
        cfg,
        params["embed_vd"].dtype,
        budget,
        num_slots=slots,
        num_snapshots=(args.num_snapshots or 4 * args.num_slots) // dp,
        page_tokens=page_tokens,
        draft_tokens=_draft_tokens(args) if getattr(args, "speculative", None) else 0,
    )
    if pages < 2:
        raise ValueError(
            f"--gpu-memory-utilization {util}: {budget / 2**30:.2f} GiB left after the weights do not "
            f"hold {slots} slots' states and two pages"
        )
    return pages * dp


def meshes(args, cfg, devices=None):
    """The engine's mesh(es) from vLLM's flags: prefill over `--tensor-parallel-size` devices, decode
    over `--data-parallel-size`, the experts split over the same devices with
    `--enable-expert-parallel` (EP = TP for prefill, EP = DP for decode); None on one device."""
    from sharding import mesh as mesh_lib  # JAX: loads on use (the module docstring)

    tp, dp = getattr(args, "tensor_parallel_size", 1), getattr(args, "data_parallel_size", 1)
    ep = getattr(args, "enable_expert_parallel", False)
    if tp < 1 or dp < 1:
        raise ValueError(f"parallel sizes must be >= 1; got tensor {tp}, data {dp}")
    if getattr(args, "coordinator", None):
        # A process group serves as one DP engine: its decode mesh spans every process's devices,
        # each process's ranks together (`Engine.group`).
        import jax  # on use (the module docstring)

        if args.role == "prefill" or tp > 1:
            raise ValueError(
                "a process group serves DP decode (--role decode or both, --data-parallel-size); "
                "tensor-parallel prefill runs within one process"
            )
        if dp != len(jax.devices()):
            raise ValueError(
                f"a process group's decode mesh spans all its {len(jax.devices())} devices: pass "
                f"--data-parallel-size {len(jax.devices())}"
            )
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if args.role == "decode" and tp > 1:
        raise ValueError("a decode worker runs data-parallel attention: use --data-parallel-size")
    if args.role == "prefill" and dp > 1:
        raise ValueError("a prefill worker runs tensor-parallel attention: use --tensor-parallel-size")
    pre = (
        mesh_lib.prefill_mesh(tp, tp if ep else 1, devices, cfg) if tp > 1 or (ep and args.role == "prefill") else None
    )
    dec = mesh_lib.decode_mesh(dp, dp if ep else 1, devices, cfg) if dp > 1 or (ep and args.role == "decode") else None
    if pre is None and dec is None:
        return None
    return {"prefill": pre, "decode": dec, "both": (pre, dec)}[args.role]


def warm_sampling_variants(engine) -> int:
    """Build, before the first request, every program a request's sampling options can need that
    `Engine.warmup(sampled=True)` leaves to first use: the decode program's variant for
    presence / frequency penalties and logprobs (`serving.decode_runner.decode_program_ext`) in
    every decode bucket, greedy and sampled, with the write of a slot's penalty counts; and the
    one-row programs that choose a prefilled request's first token (sampled, penalized, both)
    and its logprobs (`serving.sampling.choose_token`, `logprobs_of`).  Without it a client's
    first request with logprobs or a penalty waits for a whole-model compile.

    The decode steps run rows of padding only (the scratch slot and null pages: nothing a
    request holds); the engine must be idle.  A speculative engine takes no penalties or
    logprobs, and a decode mesh samples on the host: they build only the one-row programs; a
    prefill engine samples first tokens only.  Returns the XLA programs built."""
    # JAX loads on use (the module docstring)
    import jax

    from serving.decode_runner import DecodeRows

    runner = engine.runner
    with CompileWatch() as watch:
        logits = np.zeros(engine.cfg.vocab_size, np.float32)
        for sp in (
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.0, presence_penalty=0.5),
            SamplingParams(temperature=1.0, frequency_penalty=0.5),
        ):
            choose_token(logits, sp, 1, [0])
        logprobs_of(logits, 0, 1)
        if engine.spec is None and runner.decode_step is None and engine.role != "prefill":
            scratch = engine.scratch_slot
            for b in sorted({runner.decode_bucket(n) for n in range(1, scratch + 1)}):
                for temperature in (0.0, 1.0):
                    rows = DecodeRows.build(
                        b, [], [], [], [], [], max_pages=engine.max_pages, null_page=NULL_BLOCK, scratch_slot=scratch
                    )
                    # row 0 (padding, inactive) asks for logprobs and holds penalty counts: the
                    # variant runs, and so does the write of its slot's counts
                    rows = dataclasses.replace(rows, temperature=np.full(b, temperature, np.float32), logprobs=(0,))
                    engine.pools, tokens, _, lp = runner.decode.dispatch(
                        engine.params, engine.pools, rows, histories=[(rows, 0, lambda: [])]
                    )
                    jax.block_until_ready((tokens, lp))
    return watch.count
