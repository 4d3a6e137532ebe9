"""A redis-server on 127.0.0.1 for the shared L1 (tests, `kimik3 launch --redis`): Debian's
`redis-server` binary, loopback only, a random password (given on its stdin, never on a command
line other users can read; clients get it in `url`), no persistence, its own port."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time


class RedisUnavailable(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, max_memory_mb: int = 256, log_dir: str | None = None):
        self.port = _free_port()
        self.max_memory_mb = max_memory_mb
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kimik3-redis-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.password = secrets.token_hex(16)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "RedisServer":
        binary = shutil.which("redis-server")
        if not binary:
            raise RedisUnavailable("redis-server not found (Debian: apt-get install redis-server)")
        out = open(os.path.join(self.log_dir, "redis.log"), "a")
        conf = (
            f"bind 127.0.0.1\nport {self.port}\nprotected-mode yes\nrequirepass {self.password}\n"
            f'save ""\nappendonly no\ndir {self.log_dir}\nmaxmemory {self.max_memory_mb}mb\n'
            f"maxmemory-policy allkeys-lru\n"
        )
        self.proc = subprocess.Popen(
            [binary, "-"], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.proc.stdin.write(conf.encode())
        self.proc.stdin.close()
        out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited with {self.proc.returncode}; see {self.log_dir}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                    if b"+PONG" in s.recv(64):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RedisUnavailable(f"redis-server did not answer on port {self.port} within {timeout_s:g} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
