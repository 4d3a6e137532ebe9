"""`kimik3 worker` and ``python -m serving.worker``: the worker process (flags:
`serving.worker.config.add_arguments`) from its flags to a serving uvicorn server, and its exit
code (`EXIT_ENGINE_FAULT` after an engine fault, for its supervisor to restart it)."""

from __future__ import annotations

import logging
import os
import threading
import time

import uvicorn
from prometheus_client import CollectorRegistry

import serving.worker
from serving.cli import standalone_main
from serving.metrics import CompileWatch
from serving.worker.app import create_app
from serving.worker.build import build_engine, warm_sampling_variants
from serving.worker.config import EXIT_ENGINE_FAULT, add_arguments
from serving.worker.loop import EngineLoop
from serving.worker.metrics import StatsLogger

log = logging.getLogger(__name__)


def run(args) -> int:
    """Serve one engine built from the parsed flags `args` until the server stops; 0, or
    `EXIT_ENGINE_FAULT` after an engine fault.  A flag the engine cannot honour is a ValueError."""
    _prepare_process(args)
    t0 = time.monotonic()
    _join_group(args)
    engine, host, info = build_engine(args)
    if not args.no_warmup:
        engine.warmup(sampled=True)  # API clients sample by default (temperature 1)
        warm_sampling_variants(engine)  # and may ask for logprobs or penalties
    log.info("worker %s ready in %.1f s", info["worker_id"], time.monotonic() - t0)
    registry = CollectorRegistry()
    loop = EngineLoop(
        engine,
        max_waiting=args.max_waiting,
        step_delay_s=args.step_delay_s,
        worker_id=info["worker_id"],
        registry=registry,
        model_name=args.served_model_name or f"kimik3-{info['config']}",
    )
    loop.compile_watch = CompileWatch().__enter__()  # what serving builds from here on (its /metrics)
    app = create_app(loop, info, registry=registry)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    )
    loop.on_fault = lambda: exit_after_fault(server)
    stats = StatsLogger(loop, args.log_stats_interval_s).start() if args.log_stats_interval_s else None
    try:
        server.run()
    finally:
        if stats is not None:
            stats.stop()
        if host is not None:
            host.close()
    if loop.failed:
        log.error("worker %s exits after an engine fault: %s", info["worker_id"], loop.failed)
        return EXIT_ENGINE_FAULT
    return 0


def _prepare_process(args) -> None:
    """The persistent compilation cache of `--compile-cache`, and the flags checked before any
    weight is read."""
    if args.compile_cache:
        import jax  # on use: importing the worker imports no JAX (serving.worker.build)

        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if args.log_stats_interval_s < 0:
        raise ValueError(f"--log-stats-interval-s must be >= 0 (0: no stats line); got {args.log_stats_interval_s}")


def _join_group(args) -> None:
    """Join the process group of `--coordinator` (JAX's multi-controller runtime) before any device
    is touched; without one, `--num-processes` / `--process-id` are an error."""
    if args.coordinator:
        from sharding import distributed  # sharding loads only in a process group

        if args.num_processes is None or args.process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
        distributed.initialize(
            distributed.ProcessGroup(args.coordinator, args.num_processes, args.process_id, args.cpu_devices),
            heartbeat_timeout_s=args.group_heartbeat_s,
        )
    elif args.num_processes or args.process_id is not None:
        raise ValueError("--num-processes and --process-id join a group: pass its --coordinator too")


def exit_after_fault(server, grace_s: float = 0.5, deadline_s: float = 30.0) -> None:
    """After an engine fault: let the failed requests' errors go out (`grace_s`), then shut the
    uvicorn `server` down gracefully (`run` then returns `EXIT_ENGINE_FAULT`); a shutdown that
    takes past `deadline_s` ends the process with that code anyway.  Returns at once."""

    def stop():
        time.sleep(grace_s)
        server.should_exit = True
        time.sleep(deadline_s)
        os._exit(EXIT_ENGINE_FAULT)

    threading.Thread(target=stop, name="exit-after-fault", daemon=True).start()


def main(argv=None) -> int:
    return standalone_main("kimik3 worker", serving.worker.__doc__, add_arguments, run, argv)
