"""One child process of a deployment and the calls around it: `Child` (its argv, port, log and
environment, spawned in a process group of its own in the repository's directory), `free_port`,
`wait_healthy` (its /health answers 200) and `stop_process` (SIGTERM to its group, then SIGKILL).
`kimik3 launch` (`serving.launch.Deployment`) runs its store, workers and router as such children.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import time

from serving.deployment_env import ROOT, child_env

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str, proc: subprocess.Popen | None, timeout_s: float, stop: threading.Event | None = None
) -> None:
    """Poll `url`/health until it answers 200; RuntimeError if the process exits, time runs out
    or `stop` is set."""
    import httpx  # optional: httpx (the serve extra); launch imports this module without it

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise RuntimeError("interrupted while starting")
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} was not healthy within {timeout_s:g} s")


def stop_process(proc: subprocess.Popen | None, timeout_s: float = 10.0, sig=signal.SIGTERM) -> None:
    """Signal a child's process group, wait, then SIGKILL it if it is still there."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("pid %d ignored %s; killing it", proc.pid, signal.Signals(sig).name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)


@dataclasses.dataclass
class Child:
    name: str
    argv: list[str]
    port: int
    log_path: str | None  # None: the child writes to this process's stdout and stderr
    proc: subprocess.Popen | None = None
    restarts: int = 0
    env: dict = dataclasses.field(default_factory=dict)  # added to child_env()
    group: str | None = None  # a process group's name: its members restart together

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> None:
        out = open(self.log_path, "a") if self.log_path else None
        self.proc = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env=dict(child_env(self.port), **self.env),
            cwd=ROOT,
            start_new_session=True,
        )
        if out is not None:
            out.close()
