"""Mooncake Store as the shared host-memory KV tier, and the services it needs.

`MooncakeServices` starts, on 127.0.0.1, a real `mooncake_master`, Mooncake's
HTTP metadata server (`mooncake_http_metadata_server`) and a `mooncake_client`
memory server that contributes the store's DRAM, so entries outlive the engine
processes that wrote them.
`MooncakeHostKVTier` is one engine's client: batched puts and gets go through
a registered staging buffer (`batch_put_from` / `batch_get_into`, no extra
copies inside Mooncake); entries are framed and authenticated like every tier's
(cache/host_tier.py, cache/store_auth.py): any local process can write the store,
so an entry that is not this deployment's (forged under a live key, copied from
another key, truncated, damaged) is a counted miss (`stats.auth_failures`), as are
a missing entry and a dead master.  A key whose entry failed authentication is
reported absent by `exists` and written with an upsert by the next put of it (a
plain put leaves an existing object in place), so the publisher's next write
replaces the forgery.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from cache.host_tier import UNREADABLE, HostKVTier, TierError, encode_entry_into, entry_size
from cache import loopback
from cache.loopback import LoopbackUnavailable, loopback_env
from cache.store_auth import StoreAuth

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    here = os.path.join(os.path.dirname(sys.executable), name)
    path = here if os.path.exists(here) else shutil.which(name)
    if not path:
        raise TierError(f"{name} not found: pip install mooncake-transfer-engine-non-cuda (needs libibverbs1)")
    return path


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TierError(f"process exited with code {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TierError(f"nothing listened on 127.0.0.1:{port} within {timeout_s} s")


def _listening_ports(pid: int) -> set[int] | None:
    """The TCP ports process `pid` listens on (Linux's /proc), or None where /proc cannot tell."""
    try:
        fd_dir = f"/proc/{pid}/fd"
        sockets = set()
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
        ports = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in sockets:  # 0A: LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return ports
    except (OSError, IndexError, ValueError):
        return None


def _wait_own_port(port: int, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    """Wait until `proc` itself listens on 127.0.0.1:`port`.  For Mooncake's metadata server, which
    stays up after its server thread failed (a bind to a taken port: it logs ``Server error`` and
    keeps running), so neither its exit nor a connect (which would reach whoever holds the port)
    tells whether it serves."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TierError(f"process exited with code {proc.returncode} before listening on {port}")
        ports = _listening_ports(proc.pid)
        if ports is None:  # no /proc: whoever answers on the port
            _wait_port(port, proc, max(0.0, deadline - time.monotonic()))
            return
        if port in ports:
            return
        with open(log_path, errors="replace") as f:
            failed = [line.strip() for line in f if "Server error" in line]
        if failed:
            raise TierError(f"not listening on 127.0.0.1:{port}: {failed[-1]}")
        time.sleep(0.05)
    raise TierError(f"pid {proc.pid} did not listen on 127.0.0.1:{port} within {timeout_s} s")


class MooncakeServices:
    """A master, Mooncake's HTTP metadata server and a memory server, each its own process on
    loopback.  Context manager.

    The metadata server is the wheel's ``mooncake_http_metadata_server --host 127.0.0.1``: the
    master's built-in one (``--enable_http_metadata_server``) binds 0.0.0.0 whatever
    ``--http_metadata_server_host`` says, so it stays off."""

    def __init__(self, segment_bytes: int = 512 << 20, log_dir: str | None = None):
        self.segment_bytes = segment_bytes
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="mooncake-")
        self.rpc_port, self.http_port, self.metrics_port, self.client_port = (_free_port() for _ in range(4))
        self.metadata: subprocess.Popen | None = None
        self.master: subprocess.Popen | None = None
        self.memory_server: subprocess.Popen | None = None
        self.loopback_only = False  # the memory server's listeners on loopback (`cache.loopback`)

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def master_http_url(self) -> str:
        """The master's HTTP server (metrics, and `/get_all_keys`: every stored key, one a line)."""
        return f"http://127.0.0.1:{self.metrics_port}"

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        out = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        return subprocess.Popen(
            [_binary(name)] + args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def _start_metadata(self) -> None:
        """Mooncake's HTTP metadata server on 127.0.0.1:`http_port`; TierError if it does not
        listen there (it is stopped then)."""
        name = "mooncake_http_metadata_server"
        self.metadata = self._spawn(
            name, ["--host=127.0.0.1", f"--port={self.http_port}", "--log-level=WARNING"]
        )  # WARNING: at INFO, aiohttp logs a line per request
        try:
            _wait_own_port(self.http_port, self.metadata, 20, os.path.join(self.log_dir, f"{name}.log"))
        except TierError:
            self._stop(self.metadata)
            raise

    def start_master(self) -> None:
        """The master (and the metadata server if it is not running), on this object's ports."""
        if self.metadata is None or self.metadata.poll() is not None:
            self._start_metadata()
        self.master = self._spawn(
            "mooncake_master",
            [
                "--enable_http_metadata_server=false",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                "--default_kv_lease_ttl=10000",
            ],
        )  # a read holds its objects this long (ms)
        _wait_port(self.rpc_port, self.master, 20)

    def _start_memory_server(self) -> None:
        # Its transfer engine binds every interface unless the loopback shim is preloaded.
        try:
            env, self.loopback_only = loopback_env(), True
        except LoopbackUnavailable as e:
            if loopback.required():
                raise
            env, self.loopback_only = None, False
            log.warning("%s: the memory server's transfer engine listens on every interface", e)
        self.memory_server = self._spawn(
            "mooncake_client",
            [
                "--host=127.0.0.1",
                f"--port={self.client_port}",
                f"--master_server_address={self.master_addr}",
                f"--metadata_server={self.metadata_url}",
                "--protocol=tcp",
                f"--global_segment_size={self.segment_bytes}",
                "--local_buffer_size=16MB",
            ],
            env=env,
        )
        _wait_port(self.client_port, self.memory_server, 30)
        time.sleep(0.5)  # let the segment mount register with the master

    def start(self) -> "MooncakeServices":
        """Start all three; if one fails, stop those already running before raising (a caller
        that skips or falls back must not leave a metadata server behind)."""
        try:
            self.start_master()
            self._start_memory_server()
        except BaseException:
            self.stop()
            raise
        return self

    def supervise(self) -> list[str]:
        """Restart whichever service exited (reaping it), on its own port; returns their names.
        A restarted master starts empty (the store's entries were its metadata): clients see
        misses, then new entries, with no restart of their own.  The memory server restarts
        with the master or the metadata server: its segment is mounted afresh at once (on its
        own it re-registers with a new master only after a while, and its old contents are
        unreachable either way)."""
        dead = lambda p: p is not None and p.poll() is not None
        exited = [
            n
            for n, p in (
                ("metadata_server", self.metadata),
                ("mooncake_master", self.master),
                ("memory_server", self.memory_server),
            )
            if dead(p)
        ]
        restarted = []
        if "metadata_server" in exited:
            self._start_metadata()
            restarted.append("metadata_server")
        if "mooncake_master" in exited:
            self.start_master()
            restarted.append("mooncake_master")
        if restarted or "memory_server" in exited:
            self._stop(self.memory_server)
            self._start_memory_server()
            restarted.append("memory_server")
        if restarted:
            log.warning("mooncake: %s exited; restarted %s", ", ".join(exited), ", ".join(restarted))
        return restarted

    def kill_master(self) -> None:
        """Fault injection: the master dies (SIGKILL)."""
        self._stop(self.master, signal.SIGKILL)

    @staticmethod
    def _stop(proc, sig=signal.SIGTERM) -> None:
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        self._stop(self.memory_server)
        self._stop(self.master)
        self._stop(self.metadata)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# Mooncake's error codes (mooncake-store types.h): a key that is not there, and a master that
# does not answer.  Other negative codes are faults too.
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
INVALID_PARAMS = -600  # what a get into a buffer smaller than the stored object answers


class MooncakeHostKVTier(HostKVTier):
    """One engine's client of a shared Mooncake Store.  `secret`: see `HostKVTier`; the processes
    that share a store share one (`KIMIK3_STORE_SECRET`) or read none of each other's entries."""

    def __init__(
        self,
        master_addr: str,
        metadata_url: str,
        *,
        staging_bytes: int = 64 << 20,
        local_hostname: str = "127.0.0.1",
        secret: bytes | str | StoreAuth | None = None,
    ):
        super().__init__(secret)
        from mooncake.store import MooncakeDistributedStore  # optional dependency, imported on use

        self.master_addr, self.metadata_url = master_addr, metadata_url
        self._store = MooncakeDistributedStore()
        # This client contributes no memory of its own: the memory server holds the data,
        # so entries outlive this process.
        rc = self._store.setup(local_hostname, metadata_url, 0, 16 << 20, "tcp", "", master_addr)
        if rc != 0:
            raise TierError(f"Mooncake setup against {master_addr} failed (rc={rc})")
        self._staging = np.zeros(staging_bytes, np.uint8)
        if self._store.register_buffer(self._staging.ctypes.data, self._staging.nbytes) != 0:
            raise TierError("Mooncake could not register the staging buffer")
        self._io_lock = threading.Lock()

    def close(self) -> None:
        try:
            self._store.unregister_buffer(self._staging.ctypes.data)
            self._store.close()
        except Exception as e:  # noqa: BLE001
            log.debug("mooncake close: %r", e)

    # Batched fast paths through the registered staging buffer.
    def batch_put(self, keys, arrays):
        """Frame and tag each array straight into the staging buffer (one copy of the payload),
        then put the batch; keys whose stored entry failed authentication are upserted (a put
        would leave the forgery in place)."""
        if len(keys) != len(arrays):
            raise ValueError(f"{len(keys)} keys for {len(arrays)} arrays")
        arrays = [np.asarray(a) for a in arrays]
        out = []
        for lo, hi, sizes in self._batches([entry_size(a.shape, a.dtype) for a in arrays], sized=True):
            with self._io_lock:
                ptrs, off = [], 0
                for key, arr, size in zip(keys[lo:hi], arrays[lo:hi], sizes):
                    encode_entry_into(self._staging[off : off + size], arr, key, self.auth)
                    ptrs.append(self._staging.ctypes.data + off)
                    off += size
                batch = list(keys[lo:hi])
                forged = [self._is_forged(k) for k in batch]
                rcs = [-1] * len(batch)
                for idx, put in (
                    ([i for i, f in enumerate(forged) if not f], self._store.batch_put_from),
                    ([i for i, f in enumerate(forged) if f], self._store.batch_upsert_from),
                ):
                    if not idx:
                        continue
                    try:
                        got = put([batch[i] for i in idx], [ptrs[i] for i in idx], [sizes[i] for i in idx])
                    except Exception as e:  # noqa: BLE001 - a dead store is a failed put, not a crash
                        log.warning("mooncake batch_put failed: %r", e)
                        got = [-1] * len(idx)
                    for i, rc in zip(idx, got):
                        rcs[i] = rc
            for key, rc, size in zip(batch, rcs, sizes):
                ok = rc == 0
                self.stats.puts += ok
                self.stats.put_bytes += size if ok else 0
                self.stats.errors += not ok
                if ok:
                    self._healed(key)
                out.append(ok)
        return out

    def batch_get_into(self, keys, outs):
        """Get each entry into the staging buffer, verify it there (`HostKVTier._accept`), copy a
        verified one into its out buffer.  An entry of another size than `outs` asks for is a
        failed authentication (a genuine entry under the key has exactly that size), not a fault."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys for {len(outs)} buffers")
        sizes = [entry_size(o.shape, o.dtype) for o in outs]
        found = []
        for lo, hi, _ in self._batches(sizes, sized=True):
            with self._io_lock:
                ptrs, off = [], 0
                for s in sizes[lo:hi]:
                    ptrs.append(self._staging.ctypes.data + off)
                    off += s
                try:
                    rcs = self._store.batch_get_into(list(keys[lo:hi]), ptrs, sizes[lo:hi])
                except Exception as e:  # noqa: BLE001
                    log.warning("mooncake batch_get failed: %r", e)
                    rcs = [RPC_FAIL] * (hi - lo)
                rcs = [self._oversized(k, rc) for k, rc in zip(keys[lo:hi], rcs)]
                self.stats.errors += sum(rc < 0 and rc != OBJECT_NOT_FOUND for rc in rcs)  # not a miss: a fault
                off = 0
                for key, out, rc, s in zip(keys[lo:hi], outs[lo:hi], rcs, sizes[lo:hi]):
                    if rc == s:
                        blob = memoryview(self._staging)[off : off + s]
                    else:
                        blob = UNREADABLE if rc > 0 else None
                    off += s
                    found.append(self._accept(key, blob, out))
        return found

    def _oversized(self, key: str, rc: int) -> int:
        """A get's return code, with INVALID_PARAMS from an object larger than the buffer turned
        into that object's size (a stored entry, not a fault)."""
        if rc != INVALID_PARAMS:
            return rc
        try:
            size = self._store.get_size(key)
        except Exception:  # noqa: BLE001
            return rc
        return size if size > 0 else rc

    def _batches(self, items, sized: bool = False):
        """Split into runs that fit the staging buffer: yields (lo, hi, items[lo:hi])."""
        lo, used = 0, 0
        for i, item in enumerate(items):
            n = item if sized else len(item)
            if n > self._staging.nbytes:
                raise ValueError(f"entry of {n} bytes exceeds the {self._staging.nbytes}-byte staging buffer")
            if used + n > self._staging.nbytes:
                yield lo, i, items[lo:i]
                lo, used = i, 0
            used += n
        if lo < len(items):
            yield lo, len(items), items[lo:]

    # The generic single-entry hooks (used by the base class helpers).
    def _put_blob(self, key, blob):
        return (self._store.upsert if self._is_forged(key) else self._store.put)(key, blob) == 0

    def _get_blob(self, key):
        blob = self._store.get(key)
        return blob or None

    def exists(self, keys):
        try:
            rcs = self._store.batch_is_exist(list(keys))
        except Exception as e:  # noqa: BLE001
            log.warning("mooncake exists failed: %r", e)
            self.stats.errors += 1
            return [False] * len(keys)
        self.stats.errors += any(rc < 0 for rc in rcs)  # 1 present, 0 absent, < 0 the store failed
        return self._present(keys, [rc == 1 for rc in rcs])

    def remove(self, keys):
        for k in keys:
            try:
                self._store.remove(k)
            except Exception as e:  # noqa: BLE001
                log.warning("mooncake remove %s failed: %r", k, e)
