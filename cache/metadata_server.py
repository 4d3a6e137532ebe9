"""Mooncake's HTTP metadata protocol, served on 127.0.0.1 only.

The transfer engines of the master, the memory server and every worker publish and look up
their segments' metadata through it: ``GET / PUT / DELETE /metadata?key=<key>`` (a value is an
opaque body; a second PUT of an ``rpc_meta`` key is refused, as Mooncake's reference server
does).  `mooncake_master --enable_http_metadata_server` binds its server to 0.0.0.0 whatever
``--http_metadata_server_host`` says, so `MooncakeServices` runs this one instead.
"""

from __future__ import annotations

import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_VALUE_BYTES = 16 << 20


class MetadataServer:
    """``MetadataServer().start()``; `url` is what the transfer engines take as their metadata server."""

    def __init__(self, port: int = 0):
        store: dict[str, bytes] = {}
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _key(self) -> str | None:
                url = urllib.parse.urlsplit(self.path)
                if url.path != "/metadata":
                    self._reply(404, b"no such path")
                    return None
                return urllib.parse.parse_qs(url.query).get("key", [""])[0]

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's naming
                key = self._key()
                if key is None:
                    return
                with lock:
                    value = store.get(key)
                self._reply(200, value) if value is not None else self._reply(404, b"metadata not found")

            def do_PUT(self):  # noqa: N802
                key = self._key()
                if key is None:
                    return
                n = int(self.headers.get("Content-Length") or 0)
                if n > MAX_VALUE_BYTES:
                    self._reply(413, b"metadata value too large")
                    return
                value = self.rfile.read(n)
                with lock:
                    if "rpc_meta" in key and key in store:
                        self._reply(400, b"duplicate rpc_meta key")
                        return
                    store[key] = value
                self._reply(200, b"metadata updated")

            def do_DELETE(self):  # noqa: N802
                key = self._key()
                if key is None:
                    return
                with lock:
                    found = store.pop(key, None) is not None
                self._reply(200, b"metadata deleted") if found else self._reply(404, b"metadata not found")

            def log_message(self, *args):  # one line per lookup would drown the logs
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metadata"

    def start(self) -> "MetadataServer":
        self._thread = threading.Thread(target=self._server.serve_forever, name="mooncake-metadata", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()


def main(argv=None) -> None:
    """``python -m cache.metadata_server --port N``: serve until SIGTERM.  A process of its own:
    a Mooncake client in the same process would block the server's thread (the client's setup
    holds the GIL while it waits for the server)."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    server = MetadataServer(args.port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server._server.shutdown).start())
    server._server.serve_forever()
    server._server.server_close()


if __name__ == "__main__":
    main()
