"""Loopback-only listeners for processes that embed Mooncake's transfer engine.

The transfer engine binds its RPC listener and its TCP transport to every interface, with no
option to choose the address (upstream; ``MC_TCP_BIND_ADDRESS`` only sets the address it
advertises).  `loopback_env` returns a child process environment that preloads
``cache/loopback_bind.c`` (compiled once with the system C compiler, cached by its source's hash)
so that wildcard binds become loopback binds, and advertises 127.0.0.1, so peers on this host
still reach it.  Ports the operator wants public keep the wildcard (`allow_any_ports`).

Used for the memory server (`cache.mooncake_tier.MooncakeServices`) and for every worker and
the router that `kimik3 launch` starts.  A process already running cannot be changed: a tier
made in this process (a notebook, a test) keeps Mooncake's listeners.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loopback_bind.c")
ALLOW_ENV = "KIMIK3_BIND_ANY_PORTS"


class LoopbackUnavailable(RuntimeError):
    """The shim could not be built here (no C compiler, or it failed)."""


def _cache_dir() -> str:
    return os.environ.get("KIMIK3_SHIM_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kimik3", "shim")


def _trusted(path: str) -> bool:
    """Ours to preload: owned by this user and writable by nobody else (a library planted in a
    shared directory would otherwise run inside every child)."""
    st = os.stat(path)
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _loads(path: str) -> bool:
    try:
        ctypes.CDLL(path)  # the right architecture and a well-formed library: ld.so would load it too
        return True
    except OSError:
        return False


def shim_path() -> str:
    """The compiled shim (built on first use; a later source change, another machine type or
    another compiler builds a new one).  Raises LoopbackUnavailable naming the problem."""
    with open(_SOURCE, "rb") as f:
        source = f.read()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    digest = hashlib.sha256(source + platform.machine().encode() + (cc or "").encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    path = os.path.join(out_dir, f"loopback_bind-{platform.machine()}-{digest}.so")
    try:
        if os.path.exists(path):
            if _trusted(path) and _trusted(out_dir) and _loads(path):
                return path
            raise LoopbackUnavailable(
                f"{path} is not this user's own, is writable by others, or does not load: "
                f"remove it (or set KIMIK3_SHIM_DIR to a private directory)"
            )
        if not cc:
            raise LoopbackUnavailable(
                "no C compiler (cc, gcc or clang; or $CC) to build cache/loopback_bind.c: "
                "install one (Debian: build-essential) or Mooncake listens on every interface"
            )
        os.makedirs(out_dir, mode=0o700, exist_ok=True)
        if not _trusted(out_dir):
            raise LoopbackUnavailable(
                f"{out_dir} is writable by other users: set KIMIK3_SHIM_DIR to a private directory"
            )
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            proc = subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", "-o", tmp, _SOURCE, "-ldl"], capture_output=True, text=True, timeout=120
            )
            if proc.returncode:
                raise LoopbackUnavailable(f"{cc} failed on cache/loopback_bind.c: {proc.stderr.strip()[:500]}")
            os.chmod(tmp, 0o755)
            if not _loads(tmp):
                raise LoopbackUnavailable(f"{cc} built a library that does not load here")
            os.replace(tmp, path)  # atomic: concurrent builders each write their own file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:
        raise LoopbackUnavailable(f"could not build or check the loopback shim: {type(e).__name__}: {e}") from None
    log.info("built %s", path)
    return path


def required() -> bool:
    """$KIMIK3_REQUIRE_LOOPBACK set: a missing shim is an error, not a warning (CI sets it)."""
    return bool(os.environ.get("KIMIK3_REQUIRE_LOOPBACK"))


def loopback_env(env: dict | None = None, allow_any_ports=()) -> dict:
    """`env` (default: this process's) for a child whose wildcard binds must land on loopback,
    except on `allow_any_ports`.  Raises LoopbackUnavailable where the shim cannot be built."""
    env = dict(os.environ if env is None else env)
    lib = shim_path()
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "loopback_bind-" not in p]
    env["LD_PRELOAD"] = ":".join([lib] + preload)
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # what the transfer engine advertises to its peers
    if allow_any_ports:
        env[ALLOW_ENV] = ",".join(str(int(p)) for p in allow_any_ports)
    else:
        env.pop(ALLOW_ENV, None)
    return env


def main(argv=None) -> int:
    """`python -m cache.loopback [--allow-port N ...] -- CMD ...`: run CMD under the shim."""
    ap = argparse.ArgumentParser(prog="python -m cache.loopback", description=main.__doc__)
    ap.add_argument(
        "--allow-port",
        type=int,
        action="append",
        default=[],
        help="a port whose wildcard bind stays public (e.g. a worker's --port with --host 0.0.0.0)",
    )
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given")
    os.execvpe(cmd[0], cmd, loopback_env(allow_any_ports=args.allow_port))
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
