"""The safe image fetcher (`cache.media.fetch`): refusals happen before any connection;
tests only ever connect to servers on 127.0.0.1, which the default policy refuses and a test
policy permits."""

import http.server
import io
import socket
import threading
import time

import numpy as np
import pytest

from cache.media.fetch import FetchError, FetchPolicy, address_allowed, fetch, resolve_checked

LOCAL = FetchPolicy(allow_networks=("127.0.0.1/32",), timeout_s=5.0)


def png_bytes(seed: int = 0, size: int = 20) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


class ImageServer:
    """A threaded HTTP server on 127.0.0.1: `routes[path] = (status, headers, body)` or a callable
    handler(request) for the odd cases; counts the requests it saw and their Host headers."""

    def __init__(self):
        self.routes, self.requests, self.hosts = {}, 0, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests += 1
                outer.hosts.append(self.headers.get("Host"))
                route = outer.routes.get(self.path.split("?")[0])
                if callable(route):
                    return route(self)
                status, headers, body = route or (404, {}, b"")
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = ImageServer()
    yield s
    s.close()


def test_the_default_policy_refuses_loopback_before_connecting(server):
    server.routes["/a.png"] = (200, {"Content-Type": "image/png"}, png_bytes())
    with pytest.raises(FetchError, match="non-public address"):
        fetch(server.url("/a.png"))
    assert server.requests == 0


@pytest.mark.parametrize(
    "ip",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.9",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fc00::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        # IPv6 forms that carry a private IPv4 address, and old site-local
        "64:ff9b::a00:1",
        "64:ff9b::a9fe:a9fe",
        "2002:7f00:1::",
        "::7f00:1",
        "::ffff:0:7f00:1",
        "64:ff9b:1::1",
        "2001::1",
        "fec0::1",
    ],
)
def test_non_public_addresses_are_refused(ip):
    assert not address_allowed(ip)


@pytest.mark.parametrize("ip", ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_are_allowed(ip):
    assert address_allowed(ip)


def test_a_name_is_refused_if_any_address_it_resolves_to_is_private():
    """A name resolving to a public and a private address (a rebinding setup) is refused; no
    connection is attempted (the resolver is the only thing called)."""

    def resolve(host, port, type=None):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("93.184.216.34", "10.0.0.7")]

    with pytest.raises(FetchError, match="10.0.0.7"):
        resolve_checked("https://images.example/x.png", FetchPolicy(), resolve)


@pytest.mark.parametrize(
    "url, match",
    [
        ("file:///etc/passwd", "scheme"),
        ("ftp://example.com/x.png", "scheme"),
        ("gopher://x/", "scheme"),
        ("http://user:pw@example.com/x.png", "user info"),
        ("http:///x.png", "no host"),
        ("http://[::1/x.png", "malformed"),
        ("http://example.com:99999/x.png", "malformed"),
    ],
)
def test_bad_urls_are_refused(url, match):
    with pytest.raises(FetchError, match=match):
        resolve_checked(url, FetchPolicy(), lambda *a, **k: pytest.fail("resolved a refused URL"))


def test_the_host_allow_list(server):
    policy = FetchPolicy(allow_hosts=("images.example", ".cdn.example"))
    never = lambda *a, **k: pytest.fail("resolved a refused host")  # noqa: E731
    with pytest.raises(FetchError, match="allow-list"):
        resolve_checked("https://other.example/x.png", policy, never)
    with pytest.raises(FetchError, match="allow-list"):
        resolve_checked("https://evilcdn.example/x.png", policy, never)
    public = lambda host, port, type=None: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]
    assert resolve_checked("https://a.cdn.example/x.png", policy, public)[1] == "93.184.216.34"


def test_a_permitted_local_server_serves_the_image(server):
    body = png_bytes(1)
    server.routes["/a.png"] = (200, {"Content-Type": "image/png"}, body)
    assert fetch(server.url("/a.png"), LOCAL) == body and server.requests == 1


def test_the_connection_goes_to_the_checked_address_with_the_urls_host(server):
    """The name is resolved once, checked, and the request sent to that address (a second
    resolution could be rebound) with the URL's own Host header."""
    body = png_bytes(2)
    server.routes["/b.png"] = (200, {"Content-Type": "image/png"}, body)
    calls = []

    def resolve(host, port, type=None):
        calls.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    assert fetch(f"http://images.test:{server.port}/b.png", LOCAL, resolve=resolve) == body
    assert calls == ["images.test"] and server.hosts == [f"images.test:{server.port}"]


def test_a_redirect_to_a_private_address_is_refused_before_following_it(server):
    server.routes["/r"] = (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b"")
    with pytest.raises(FetchError, match="non-public address"):
        fetch(server.url("/r"), LOCAL)
    assert server.requests == 1  # the redirect itself; the metadata address is refused by its check, before a connect


def test_redirects_are_followed_and_bounded(server):
    body = png_bytes(3)
    server.routes["/img"] = (200, {"Content-Type": "image/png"}, body)
    server.routes["/hop"] = (301, {"Location": "/img"}, b"")
    server.routes["/loop"] = (302, {"Location": "/loop"}, b"")
    assert fetch(server.url("/hop"), LOCAL) == body
    with pytest.raises(FetchError, match="redirected more than"):
        fetch(server.url("/loop"), LOCAL)


@pytest.mark.parametrize(
    "route, match",
    [
        ((200, {"Content-Type": "text/html"}, b"<html>"), "content type"),
        ((200, {}, b"\x89PNG"), "content type"),
        ((404, {"Content-Type": "image/png"}, b""), "answered 404"),
        ((200, {"Content-Type": "image/png"}, b"x" * 5000), "at most 4096"),
    ],
)
def test_bad_answers_are_refused(server, route, match):
    server.routes["/x"] = route
    with pytest.raises(FetchError, match=match):
        fetch(server.url("/x"), FetchPolicy(allow_networks=("127.0.0.1/32",), max_bytes=4096))


def test_the_byte_cap_holds_without_a_content_length(server):
    def endless(req):  # no Content-Length, keeps sending: the stream is cut at the cap
        req.send_response(200)
        req.send_header("Content-Type", "image/png")
        req.end_headers()
        try:
            for _ in range(1000):
                req.wfile.write(b"x" * 65536)
        except OSError:
            pass

    server.routes["/big"] = endless
    with pytest.raises(FetchError, match="larger than"):
        fetch(server.url("/big"), FetchPolicy(allow_networks=("127.0.0.1/32",), max_bytes=1 << 20))


def test_a_stalling_server_is_cut_at_the_timeout(server):
    def stall(req):
        time.sleep(3)

    server.routes["/slow"] = stall
    t0 = time.monotonic()
    with pytest.raises(FetchError, match="longer than"):
        fetch(server.url("/slow"), FetchPolicy(allow_networks=("127.0.0.1/32",), timeout_s=0.5))
    assert time.monotonic() - t0 < 2.5


def test_a_policy_with_a_malformed_network_is_an_error_at_once():
    with pytest.raises(ValueError):
        FetchPolicy(allow_networks=("127.0.0.1/33",))


def test_headers_dripped_a_byte_at_a_time_are_cut_at_the_deadline(server):
    """The deadline covers the whole fetch, not each read: a server that sends its status line
    and headers one byte every 0.2 s is cut at timeout_s."""

    def drip(req):
        try:
            for b in b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Pad: " + b"a" * 200:
                req.wfile.write(bytes([b]))
                req.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    server.routes["/drip"] = drip
    t0 = time.monotonic()
    with pytest.raises(FetchError, match="longer than"):
        fetch(server.url("/drip"), FetchPolicy(allow_networks=("127.0.0.1/32",), timeout_s=1.0))
    assert time.monotonic() - t0 < 2.0


def test_an_encoded_body_is_refused_not_inflated(server):
    """A gzip bomb (a small body that inflates past the cap) never gets inflated: only unencoded
    bodies are fetched."""
    import gzip

    bomb = gzip.compress(gzip.compress(b"\0" * (64 << 20)))
    server.routes["/bomb.png"] = (200, {"Content-Type": "image/png", "Content-Encoding": "gzip, gzip"}, bomb)
    with pytest.raises(FetchError, match="encoded"):
        fetch(server.url("/bomb.png"), FetchPolicy(allow_networks=("127.0.0.1/32",), max_bytes=1 << 20))


def test_the_l1_cache_never_answers_a_url_the_policy_refuses(server):
    from cache.media import MediaFetcher
    from cache.media.l1 import EmbeddedFetchCache

    server.routes["/a.png"] = (200, {"Content-Type": "image/png"}, png_bytes(7))
    cache = EmbeddedFetchCache()
    loose = MediaFetcher(LOCAL, cache)
    assert loose.get(server.url("/a.png"), "t")
    with pytest.raises(FetchError, match="user info"):  # cached as the plain URL, still refused
        loose.get(server.url("/a.png").replace("http://", "http://u:p@"), "t")
    with pytest.raises(FetchError, match="non-public"):  # a stricter policy sharing the cache fetches itself
        MediaFetcher(FetchPolicy(), cache).get(server.url("/a.png"), "t")
    assert server.requests == 1
