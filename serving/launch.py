"""`kimik3 launch`: a whole deployment on this machine in one command.

    kimik3 launch --config tiny --port 8000 --prefill 1 --decode 1

starts a Mooncake store (`mooncake_master` + a memory server, cache/mooncake_tier.py) unless
`--no-store`, the prefill and decode workers (`serving.worker`) and the router
(serving/router.py), each its own process on a free 127.0.0.1 port (the router on `--host`
and `--port`), waits until they answer their health checks, and serves until SIGINT or SIGTERM, when it stops
the router, then the workers, then the store.  A worker (or the router) that exits on its
own is restarted on its port (at most `--max-restarts` times; the first restart at once, each
later one after a backoff that doubles from `--restart-backoff-s` up to 30 s); KV it had published
stays in the store.  A worker whose engine faulted fails its requests, reports "failed" and exits
(`serving.worker.EXIT_ENGINE_FAULT`), so it is restarted the same way.  A store service that exits
(the master, the memory server, the metadata server) and the `--redis` server are restarted the
same way; until the store is back, workers answer store lookups with misses (their tier's circuit
breaker, cache/guarded_tier.py) and report "degraded" on /health, and until Redis is back the
router's L1 lookups are misses.  `--state-file` always holds the live pids.

The workers' options: every `serving.engine_config.EngineConfig` field is a launch flag of the
same name (`serving.flags`: `--num-pages`, `--prefill-chunk-tokens`, vLLM's `--max-num-seqs`,
...), passed to every worker when set, as are vLLM's `--max-model-len`,
`--tensor-parallel-size` (prefill workers, or colocated ones), `--data-parallel-size` (decode
workers, or colocated ones), `--enable-expert-parallel`, `--speculative-config` and
`--log-stats-interval-s`; `--worker-args` comes last and wins.  With no prefill workers the
decode workers are colocated (role both).  A worker spans `--tensor-parallel-size` /
`--data-parallel-size` GPUs of `--gpus`, taken in turn; more than the machine has is a one-line
error naming the flag before anything starts (`Deployment.check`).  `kimik3 serve`
(`serving.serve`) is this command with one colocated worker and no store.

Secrets reach the children through their environments (`serving.deployment_env`), never their
command lines (which `ps` shows): the deployment's internal token (`serving.internal_auth`), a
store secret every child shares (`KIMIK3_STORE_SECRET`: 32 random bytes, hex, made at start
unless launch's own environment has one; `cache.store_auth`), and for the router alone the
clients' API key (`KIMIK3_API_KEY`, from `--api-key @FILE` or launch's environment) and key file
(`KIMIK3_API_KEY_FILE`, from `--api-key-file` or launch's environment; `serving.router_auth`).

With `--decode-group` the decode workers form one process group on JAX's multi-controller
runtime: one DP engine over all their devices (`--group-devices` each), each worker
serving its own requests on its own devices' ranks while all decode together.  A member that
exits takes the others down (they cannot step without it), so the launcher restarts the whole
group, on the same ports, around a fresh coordinator.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

from cache.mooncake_tier import MooncakeServices
from serving import flags
from serving.cli import standalone_main

# the flags and their checks (`serving.launch_flags`) and the children (`serving.child_process`) are
# importable from here too
from serving.child_process import Child, free_port, stop_process, wait_healthy
from serving.deployment_env import API_KEY_ENV, API_KEY_FILE_ENV, TOKEN, child_env
from serving.launch_flags import add_arguments, check_api_keys, check_max_model_len, check_model

__all__ = [
    "Child",
    "Deployment",
    "add_arguments",
    "check_api_keys",
    "check_max_model_len",
    "check_model",
    "child_env",
    "free_port",
    "main",
    "run",
    "stop_process",
    "wait_healthy",
]

log = logging.getLogger(__name__)


class Deployment:
    """The store, the workers and the router of one `kimik3 launch`."""

    def __init__(self, args, stop: threading.Event | None = None, progress=None):
        """progress(message): called as each piece comes up (the CLI prints them: a worker's
        warm-up compiles take a while); None: log only."""
        self.args = args
        self.stop_event = stop
        self.progress = progress or (lambda message: None)
        # `kimik3 serve` without --log-dir: the router's and the workers' logs go to this terminal
        self.console = bool(getattr(args, "console_logs", False)) and not args.log_dir
        self.log_dir = args.log_dir or tempfile.mkdtemp(prefix="kimik3-launch-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.services = None
        self.redis = None  # the shared L1 fetch cache (`--redis`)
        self.workers: list[Child] = []
        self.router: Child | None = None
        self.store_restarts: dict[str, int] = {}
        self._restart_at: dict[str, float] = {}  # a child that exited: when its restart is due (backoff)

    def _log_path(self, name: str) -> str | None:
        return None if self.console else os.path.join(self.log_dir, f"{name}.log")

    @property
    def colocated(self) -> bool:
        """No prefill workers and no decode group: the decode workers serve whole requests (role both)."""
        return self.args.prefill == 0 and not self.args.decode_group

    def worker_role(self, role: str) -> str:
        """The --role a worker started for `role` ("prefill" or "decode") runs with."""
        return "both" if role == "decode" and self.colocated else role

    def devices_per_worker(self, role: str) -> int:
        """Devices one worker of `role` spans: --tensor-parallel-size for prefill, --data-parallel-size
        for decode, the larger for a colocated worker (its prefill and decode meshes share them);
        a decode group's member takes one (or --group-devices on CPU)."""
        tp, dp = self.args.tensor_parallel_size or 1, self.args.data_parallel_size or 1
        role = self.worker_role(role)
        if role == "decode" and self.args.decode_group:
            return 1
        return {"prefill": tp, "decode": dp, "both": max(tp, dp)}[role]

    def _worker_argv(self, role: str, index: int, port: int) -> list[str]:
        a = self.args
        name = f"{role}-{index}"
        role = self.worker_role(role)
        argv = [
            sys.executable,
            "-m",
            "serving.worker",
            "--role",
            role,
            "--port",
            str(port),
            "--config",
            a.config,
            "--seed",
            str(a.seed),
            "--worker-id",
            name,
            "--log-level",
            a.log_level,
        ]
        if a.dtype:
            argv += ["--dtype", a.dtype]
        if a.max_model_len:
            argv += ["--max-model-len", str(a.max_model_len)]
        if a.tensor_parallel_size and role in ("prefill", "both"):
            argv += ["--tensor-parallel-size", str(a.tensor_parallel_size)]
        if a.data_parallel_size and role in ("decode", "both"):
            argv += ["--data-parallel-size", str(a.data_parallel_size)]
        if a.enable_expert_parallel and not (role == "decode" and a.decode_group):  # the group adds its own
            argv.append("--enable-expert-parallel")
        if a.log_stats_interval_s is not None:
            argv += ["--log-stats-interval-s", str(a.log_stats_interval_s)]
        if a.speculative_config:
            argv += flags.speculative_argv(a.speculative_config)
        argv += flags.engine_flag_argv(a, skip=("role",))
        if self.services is not None:
            argv += ["--mooncake-master", self.services.master_addr, "--mooncake-metadata", self.services.metadata_url]
        if a.checkpoint:
            argv += ["--checkpoint", a.checkpoint] + (["--manifest", a.manifest] if a.manifest else [])
        if a.served_model_name:
            argv += ["--served-model-name", a.served_model_name]
        if a.tokenizer:
            argv += ["--tokenizer", a.tokenizer]
        return argv + shlex.split(a.worker_args or "")

    def _join_groups(self) -> None:
        """Give each process group's members a fresh coordinator (on member 0) and their ids: the
        decode mesh spans every member's devices (`--group-devices` each; one GPU each on GPUs)."""
        for group in sorted({w.group for w in self.workers if w.group}):
            members = [w for w in self.workers if w.group == group]
            coordinator = f"127.0.0.1:{free_port()}"
            per = 1 if self.gpus else self.args.group_devices
            for i, w in enumerate(members):
                if "--coordinator" in w.argv:
                    del w.argv[w.argv.index("--coordinator") :]  # the group options come last
                w.argv += [
                    "--coordinator",
                    coordinator,
                    "--num-processes",
                    str(len(members)),
                    "--process-id",
                    str(i),
                    "--data-parallel-size",
                    str(per * len(members)),
                    "--enable-expert-parallel",
                ]
                if not self.gpus:
                    w.argv += ["--cpu-devices", str(per)]

    def _assigned_gpus(self) -> list[list[str]]:
        """The GPUs of each worker in start order (prefill workers, then decode): `--gpus` in turn,
        `devices_per_worker` of them each (wrapping around, so workers may share)."""
        gpus, out, pos = self.gpus, [], 0
        for role, n in (("prefill", self.args.prefill), ("decode", self.args.decode)):
            for _ in range(n):
                k = self.devices_per_worker(role)
                out.append([gpus[(pos + j) % len(gpus)] for j in range(k)])
                pos += k
        return out

    def worker_env(self, index: int) -> dict:
        """The devices of worker `index` (in start order: prefill workers, then decode): its GPUs of
        `--gpus` (`_assigned_gpus`), `CUDA_VISIBLE_DEVICES` naming them, and its JAX memory cap,
        `--gpu-memory-utilization` split between the workers that share a GPU.  {} without GPUs."""
        if not self.gpus:
            return {}
        assigned = self._assigned_gpus()
        mine = assigned[index]
        sharing = max(sum(1 for other in assigned if gpu in other) for gpu in mine)
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(mine),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{self.args.gpu_memory_utilization / sharing:.4f}",
        }

    def check(self) -> None:
        """ValueError, one line naming the flag, for what the workers could not honour on this
        machine: more devices per worker than it has (`devices_per_worker`; one on a machine
        without GPUs), slots that do not split over the data-parallel ranks, a decode group with
        its own data-parallel size, speculative decoding outside a colocated worker."""
        a = self.args
        for flag, value in (
            ("--tensor-parallel-size", a.tensor_parallel_size),
            ("--data-parallel-size", a.data_parallel_size),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1; got {value}")
        if a.decode_group and a.data_parallel_size:
            raise ValueError("--data-parallel-size: a --decode-group's members span one device each (--decode N)")
        have = len(self.gpus) or 1
        where = f"{len(self.gpus)} GPU(s) in --gpus" if self.gpus else "no GPU (one CPU device)"
        tp, dp = a.tensor_parallel_size or 1, a.data_parallel_size or 1
        if tp > 1 and not (a.prefill or self.colocated):
            raise ValueError("--tensor-parallel-size shards prefill: a decode group without prefill workers runs none")
        for flag, n in (("--tensor-parallel-size", tp), ("--data-parallel-size", dp)):
            if n > have:
                raise ValueError(f"{flag} {n}: a worker would span {n} devices and this machine has {where}")
        slots = a.num_slots if a.num_slots is not None else 8
        if dp > 1 and slots % dp:
            raise ValueError(f"--max-num-seqs / --num-slots {slots} does not split over --data-parallel-size {dp}")
        if a.speculative_config:
            flags.speculative_argv(a.speculative_config)  # what it cannot honour, named first
            if not self.colocated:
                raise ValueError("--speculative-config: speculative decoding runs in colocated workers (--prefill 0)")
            if a.draft_tokens is not None:
                raise ValueError("--speculative-config holds num_speculative_tokens: drop --draft-tokens")
            if not a.checkpoint:
                raise ValueError("--speculative-config: the draft needs its trained target (a checkpoint directory)")

    @functools.cached_property
    def gpus(self) -> list[str]:
        """`--gpus`: a comma list of device ids, "auto" (every GPU nvidia-smi lists), or "none"."""
        spec = self.args.gpus
        if spec == "none":
            return []
        if spec != "auto":
            ids = [g.strip() for g in spec.split(",") if g.strip()]
            if not ids:
                raise ValueError(f"--gpus {spec!r}: name device ids, e.g. 0,1, or auto / none")
            return ids
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return []
        return (
            [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]
            if out.returncode == 0
            else []
        )

    def _router_env(self) -> dict:
        """Secrets the router reads from its environment (never its command line, which `ps` shows):
        the shared L1's URL with its password, the clients' API key and key file (`--api-key
        @FILE`, `--api-key-file`, else launch's own $KIMIK3_API_KEY / $KIMIK3_API_KEY_FILE)."""
        env = {"KIMIK3_L1_REDIS": self.redis.url} if self.redis is not None else {}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the router computes nothing on a GPU: it takes none
        key = (flags.read_api_key(self.args.api_key) if self.args.api_key else None) or os.environ.get(API_KEY_ENV)
        if key:
            env[API_KEY_ENV] = key
        key_file = getattr(self.args, "api_key_file", None) or os.environ.get(API_KEY_FILE_ENV)
        if key_file:
            env[API_KEY_FILE_ENV] = os.path.abspath(key_file)  # the router runs in the repo's directory
        return env

    def start(self) -> "Deployment":
        a = self.args
        self.check()
        if not a.no_store:
            self.services = MooncakeServices(
                segment_bytes=a.store_mb << 20, log_dir=os.path.join(self.log_dir, "mooncake")
            )
            os.makedirs(self.services.log_dir, exist_ok=True)
            self.services.start()
            log.info("mooncake store at %s", self.services.master_addr)
            self.progress(f"Mooncake store at {self.services.master_addr}")
        if a.redis:
            from cache.media.redis_server import RedisServer  # loads httpx (the serve extra): only --redis needs it

            self.redis = RedisServer(max_memory_mb=a.redis_mb, log_dir=os.path.join(self.log_dir, "redis")).start()
            log.info("L1 fetch cache (redis) at %s", self.redis.url)
        if a.decode_group and a.decode < 2:
            raise ValueError("--decode-group makes the decode workers one process group: pass --decode 2 or more")
        if a.decode_group and self.gpus and a.group_devices != 1:
            raise ValueError("on GPUs each group member takes one GPU: --group-devices 1")
        for role, n in (("prefill", a.prefill), ("decode", a.decode)):
            for i in range(n):
                port = free_port()
                grouped = role == "decode" and a.decode_group
                self.workers.append(
                    Child(
                        f"{role}-{i}",
                        self._worker_argv(role, i, port),
                        port,
                        self._log_path(f"{role}-{i}"),
                        env=self.worker_env(len(self.workers)),
                        group="decode" if grouped else None,
                    )
                )
        self._join_groups()
        for w in self.workers:
            w.spawn()
        t0 = time.monotonic()
        self.progress(
            f"starting {len(self.workers)} worker(s): each loads its weights and compiles its steps "
            f"({'logs below' if self.console else 'logs in ' + self.log_dir})"
        )
        for w in self.workers:
            wait_healthy(w.url, w.proc, a.startup_timeout_s, self.stop_event)
            log.info("%s ready at %s (pid %d)", w.name, w.url, w.proc.pid)
            self.progress(f"{w.name} ready after {time.monotonic() - t0:.1f} s")
        argv = (
            [
                sys.executable,
                "-m",
                "serving.router",
                "--host",
                a.host,
                "--port",
                str(a.port),
                "--config",
                a.config,
                "--log-level",
                a.log_level,
            ]
            + (["--checkpoint", a.checkpoint] if a.checkpoint else [])
            + (["--model-name", a.served_model_name] if a.served_model_name else [])
            + (["--tokenizer", a.tokenizer] if a.tokenizer else [])
        )
        pre = [w.url for w in self.workers if w.name.startswith("prefill")]
        dec = [w.url for w in self.workers if w.name.startswith("decode")]
        if pre:
            argv += ["--prefill", *pre]
        if dec:
            argv += ["--decode", *dec]
        if self.services is not None:
            argv += ["--mooncake-master", self.services.master_addr, "--mooncake-metadata", self.services.metadata_url]
        self.router = Child(
            "router",
            argv + shlex.split(a.router_args or ""),
            a.port,
            self._log_path("router"),
            # the L1's URL holds its password: in the environment, not on the command line
            env=self._router_env(),
        )
        self.router.spawn()
        wait_healthy(self.router.url, self.router.proc, a.startup_timeout_s, self.stop_event)
        return self

    def state(self) -> dict:
        pids = {c.name: c.proc.pid for c in self.workers + [self.router] if c and c.proc}
        if self.services is not None:
            pids["mooncake_master"] = self.services.master.pid
            pids["mooncake_memory_server"] = self.services.memory_server.pid
            pids["mooncake_metadata_server"] = self.services.metadata.pid
        if self.redis is not None:
            pids["redis"] = self.redis.proc.pid
        return {
            "router": self.router.url + "/v1" if self.router else None,
            "prefill": [w.url for w in self.workers if w.name.startswith("prefill")],
            "decode": [w.url for w in self.workers if w.name.startswith("decode")],
            "store": self.services.master_addr if self.services else None,
            "pids": pids,
            "log_dir": self.log_dir,
        }

    RESTART_BACKOFF_MAX_S = 30.0

    def _restart_due(self, name: str, restarts: int) -> bool:
        """Whether `name`, which exited after `restarts` restarts, may be restarted now: the first
        time at once, then after `--restart-backoff-s` doubling with each restart (at most
        RESTART_BACKOFF_MAX_S), so a child that keeps failing does not spin."""
        now = time.monotonic()
        if name not in self._restart_at:
            base = getattr(self.args, "restart_backoff_s", 1.0)
            delay = 0.0 if restarts == 0 else min(self.RESTART_BACKOFF_MAX_S, base * 2 ** (restarts - 1))
            self._restart_at[name] = now + delay
            if delay:
                log.warning("%s exited again; restarting it in %.1f s", name, delay)
        if now < self._restart_at[name]:
            return False
        del self._restart_at[name]
        return True

    def supervise(self) -> bool:
        """Restart children (workers, router), store services (master, memory server, metadata
        server) and the Redis L1 that exited on their own (a worker exits after an engine fault),
        on their own ports, each at most `--max-restarts` times, with backoff (`_restart_due`).
        Returns whether anything was restarted (its pid changed)."""
        changed = False
        for group in sorted({w.group for w in self.workers if w.group}):
            members = [w for w in self.workers if w.group == group]
            gone = [w for w in members if w.proc.poll() is not None]
            if not gone:
                continue
            if max(w.restarts for w in members) >= self.args.max_restarts:
                raise RuntimeError(
                    f"process group {group!r} lost {gone[0].name} (code {gone[0].proc.returncode}) "
                    f"after {members[0].restarts} restarts"
                )
            for w in members:  # the others cannot step without it (and stop on the group's heartbeat anyway)
                if w.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(w.proc.pid, signal.SIGKILL)
            if not self._restart_due(f"group {group}", max(w.restarts for w in members)):
                continue
            log.warning(
                "%s of process group %r exited with code %s; restarting the group",
                gone[0].name,
                group,
                gone[0].proc.returncode,
            )
            for w in members:
                stop_process(w.proc, timeout_s=5)
            self._join_groups()
            for w in members:
                w.restarts += 1
                w.spawn()
            changed = True
        for w in [w for w in self.workers if not w.group] + [self.router]:
            if w.proc.poll() is not None:
                if w.restarts >= self.args.max_restarts:
                    raise RuntimeError(f"{w.name} exited (code {w.proc.returncode}) {w.restarts + 1} times")
                if not self._restart_due(w.name, w.restarts):
                    continue
                w.restarts += 1
                log.warning("%s exited with code %s; restarting it on port %d", w.name, w.proc.returncode, w.port)
                w.spawn()
                changed = True
        if self.services is not None:
            for name in self.services.supervise():
                self.store_restarts[name] = self.store_restarts.get(name, 0) + 1
                if self.store_restarts[name] > self.args.max_restarts:
                    raise RuntimeError(f"the store's {name} exited {self.store_restarts[name]} times")
                changed = True
        if self.redis is not None and self.redis.proc.poll() is not None:
            changed |= self._restart_redis()
        return changed

    def _restart_redis(self) -> bool:
        """Restart the exited Redis L1 on its port with its password (the router's URL stays
        valid; its L1 lookups are misses meanwhile).  Whether it is back."""
        from cache.media.redis_server import RedisUnavailable  # as RedisServer above

        n = self.store_restarts.get("redis", 0)
        if n >= self.args.max_restarts:
            raise RuntimeError(f"redis exited (code {self.redis.proc.returncode}) {n + 1} times")
        if not self._restart_due("redis", n):
            return False
        self.store_restarts["redis"] = n + 1
        log.warning("redis exited with code %s; restarting it on port %d", self.redis.proc.returncode, self.redis.port)
        try:
            self.redis.start()
        except RedisUnavailable as e:  # tried again, after the backoff, on the next pass
            log.error("redis did not come back: %s", e)
            return False
        return True

    def write_state(self, path: str) -> None:
        """The deployment's URLs and live pids, with the internal token the admin routes take
        (0600), replaced atomically."""
        tmp = path + ".tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(dict(self.state(), internal_token=TOKEN), f)
        os.replace(tmp, path)

    def stop(self) -> None:
        stop_process(self.router.proc if self.router else None)
        for w in self.workers:  # signal all first, then wait: they shut down in parallel
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.proc.pid, signal.SIGTERM)
        for w in self.workers:
            stop_process(w.proc)
        if self.services is not None:
            self.services.stop()
        if self.redis is not None:
            self.redis.stop()


def run(args, prog: str = "kimik3 launch") -> int:
    """Check the flags (one line naming a flag the deployment cannot honour: exit 2), start the
    deployment and serve until SIGINT or SIGTERM (exit 0), or until a child cannot be kept up (1)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    say = lambda message: print(f"{prog}: {message}", flush=True)  # noqa: E731
    dep = None
    # the children run in the repository's directory: paths are the caller's, made absolute
    if args.checkpoint:
        args.checkpoint = os.path.abspath(args.checkpoint)
    if args.tokenizer and os.path.exists(args.tokenizer):
        args.tokenizer = os.path.abspath(args.tokenizer)
    try:
        check_model(args)
        check_max_model_len(args)
        check_api_keys(args)
        dep = Deployment(args, stop, progress=say)
        dep.check()
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        dep.start()
        state = dep.state()
        if args.state_file:
            dep.write_state(args.state_file)
        logs = "logs on this terminal" if dep.console else f"logs in {dep.log_dir}"
        print(
            f"kimik3: serving {args.checkpoint or args.config} at {state['router']} ({args.prefill} prefill, "
            f"{args.decode} {'colocated' if dep.colocated else 'decode'} workers"
            f"{', Mooncake store ' + state['store'] if state['store'] else ''}); {logs}; Ctrl-C stops",
            flush=True,
        )
        while not stop.wait(0.5):
            if dep.supervise() and args.state_file:  # restarted children have new pids
                dep.write_state(args.state_file)
    except RuntimeError as e:
        log.error("%s", e)
        print(f"{prog}: {e} ({'logs above' if dep.console else 'logs in ' + dep.log_dir})", file=sys.stderr, flush=True)
        code = 1
    finally:
        dep.stop()
        for s, h in previous.items():
            signal.signal(s, h)
    return code


def main(argv=None) -> int:
    return standalone_main("kimik3 launch", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
