"""A safe fetcher for remote images (`image_url`s with http or https).

A URL names a host the service then connects to on the caller's behalf: without checks, any
client can make the service read its own loopback ports, the cloud metadata endpoint or a
private network (SSRF).  `fetch` therefore:

* accepts only the policy's schemes (http, https) and, if the policy has one, its host
  allow-list; a URL with user info (``user:pass@host``) is refused;
* resolves the host and refuses it unless **every** address it resolves to is globally
  routable (loopback, private, link-local (the 169.254.169.254 metadata service), shared
  100.64/10, multicast, reserved and unspecified addresses are refused; IPv4-mapped IPv6 is
  unwrapped first), except networks the policy explicitly permits (`allow_networks`: tests
  permit 127.0.0.1/32);
* connects to the address it checked, not to a second resolution (a DNS rebinding cannot swap
  it), sending the original Host header and, for https, the original name for SNI and the
  certificate check;
* follows at most `max_redirects` redirects by hand, checking each new URL the same way before
  connecting (a redirect to another scheme, a ``data:`` URL included, or to a malformed URL is
  a refusal like any other);
* asks for and accepts only unencoded bodies (a gzip bomb is refused, not inflated), refuses a
  content type outside the image types and a body over `max_bytes` (read raw as a stream: the
  cap holds whatever Content-Length says);
* holds the whole fetch (resolution, connection, headers, body, redirects) to one wall-clock
  deadline, `timeout_s`: it runs as a coroutine under `asyncio.wait_for`, so a server that
  drips its headers a byte at a time is cut at the deadline.

Every refusal is a `FetchError` whose message names the reason; the router turns it into a
400 before any worker sees the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import ipaddress
import socket
import urllib.parse

import httpx

IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp")

# Refused whatever `is_global` says (its answers changed between Python releases): networks that
# are not the public internet, and IPv6 forms that carry an IPv4 address inside (NAT64, 6to4,
# Teredo, IPv4-compatible and SIIT), which reach an IPv4 host that must be checked as such.
_DENY = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::/128",
        "::1/128",
        "::/96",
        "::ffff:0:0:0/96",
        "64:ff9b:1::/48",
        "100::/64",
        "2001::/32",
        "2001:db8::/32",
        "fc00::/7",
        "fe80::/10",
        "fec0::/10",
        "ff00::/8",
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class FetchError(ValueError):
    """A remote image that was refused or could not be fetched; the message says why."""


@dataclasses.dataclass(frozen=True)
class FetchPolicy:
    schemes: tuple[str, ...] = ("https", "http")
    allow_hosts: tuple[str, ...] | None = None  # exact names or ".suffix" patterns; None: any public host
    allow_networks: tuple[str, ...] = ()  # CIDRs permitted although not global (tests: "127.0.0.1/32")
    max_bytes: int = 16 << 20
    timeout_s: float = 10.0
    max_redirects: int = 3
    content_types: tuple[str, ...] = IMAGE_TYPES

    def __post_init__(self):
        for net in self.allow_networks:
            ipaddress.ip_network(net)  # a typo is an error at start-up, not a silent refusal later

    def fingerprint(self) -> str:
        """What a cached fetch depends on: an entry fetched under one policy is never served
        under another (a stricter router sharing a Redis L1 with a looser one)."""
        return hashlib.sha256(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]


def _host_allowed(host: str, allow_hosts) -> bool:
    if allow_hosts is None:
        return True
    host = host.lower().rstrip(".")
    return any(host == p.lower() or (p.startswith(".") and host.endswith(p.lower())) for p in allow_hosts)


def _embedded_v4(addr: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr in _NAT64:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


def address_allowed(ip: str, allow_networks=()) -> bool:
    """Whether connecting to `ip` is allowed: a globally routable address (an IPv6 address that
    embeds an IPv4 one is judged by that), or one inside a network the policy permits."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if any(addr in ipaddress.ip_network(net) for net in allow_networks):
        return True
    if isinstance(addr, ipaddress.IPv6Address):
        inner = _embedded_v4(addr)
        if inner is not None:
            return address_allowed(str(inner), allow_networks)
    if any(addr.version == net.version and addr in net for net in _DENY):
        return False
    return addr.is_global and not addr.is_multicast


def check_url(url: str, policy: FetchPolicy) -> tuple[urllib.parse.SplitResult, str, int]:
    """(parsed URL, host, port): every check that needs no DNS.  Raises FetchError."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
        host = parts.hostname
    except ValueError as e:
        raise FetchError(f"malformed image URL: {e}") from None
    if parts.scheme.lower() not in policy.schemes:
        raise FetchError(f"image URL scheme {parts.scheme!r} is not allowed (allowed: {', '.join(policy.schemes)})")
    if parts.username is not None or parts.password is not None:
        raise FetchError("image URLs with user info (user:password@host) are refused")
    if not host:
        raise FetchError("image URL has no host")
    try:
        host.encode("idna")
    except UnicodeError as e:
        raise FetchError(f"image host {host!r} is not a valid host name: {e}") from None
    if not _host_allowed(host, policy.allow_hosts):
        raise FetchError(f"image host {host!r} is not on the allow-list")
    return parts, host, port or (443 if parts.scheme.lower() == "https" else 80)


def check_addresses(host: str, infos, policy: FetchPolicy) -> list[str]:
    """The addresses of `getaddrinfo`'s answer in its order, if every one is allowed."""
    ips = list(dict.fromkeys(info[4][0] for info in infos))
    if not ips:
        raise FetchError(f"image host {host!r} does not resolve")
    refused = [ip for ip in ips if not address_allowed(ip, policy.allow_networks)]
    if refused:
        raise FetchError(
            f"image host {host!r} resolves to a non-public address ({refused[0]}): refused before connecting"
        )
    return ips


def resolve_checked(url: str, policy: FetchPolicy, resolve=socket.getaddrinfo) -> tuple[urllib.parse.SplitResult, str]:
    """(the parsed URL, the first address to connect to), synchronously.  Raises FetchError."""
    parts, host, port = check_url(url, policy)
    try:
        infos = resolve(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise FetchError(f"image host {host!r} does not resolve: {e}") from None
    return parts, check_addresses(host, infos, policy)[0]


def _pinned_request(client: httpx.AsyncClient, parts, ip: str):
    """A GET of `parts` sent to `ip` (a checked address), with the URL's own host for the Host
    header and TLS, asking for an unencoded body."""
    literal = f"[{ip}]" if ":" in ip else ip
    netloc = literal + (f":{parts.port}" if parts.port else "")
    target = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host = parts.hostname.encode("idna").decode()
    headers = {
        "Host": host + (f":{parts.port}" if parts.port else ""),
        "Accept": ", ".join(IMAGE_TYPES),
        "Accept-Encoding": "identity",
    }
    extensions = {"sni_hostname": host} if parts.scheme.lower() == "https" else {}
    return client.build_request("GET", target, headers=headers, extensions=extensions)


async def _read_image(r: httpx.Response, policy: FetchPolicy) -> bytes:
    if r.status_code != 200:
        raise FetchError(f"image URL answered {r.status_code}")
    encoding = r.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise FetchError(f"image URL sent a {encoding!r}-encoded body; only unencoded images are fetched")
    ctype = r.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype not in policy.content_types:
        raise FetchError(
            f"image URL content type {ctype or 'missing'!r} is not an image type ({', '.join(policy.content_types)})"
        )
    length = r.headers.get("content-length")
    if length and length.isdigit() and int(length) > policy.max_bytes:
        raise FetchError(f"image of {int(length)} bytes; at most {policy.max_bytes} are fetched")
    body = bytearray()
    async for chunk in r.aiter_raw():  # raw: nothing is inflated before the cap sees it
        body += chunk
        if len(body) > policy.max_bytes:
            raise FetchError(f"image larger than {policy.max_bytes} bytes")
    return bytes(body)


async def _fetch(url: str, policy: FetchPolicy, resolve) -> bytes:
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        for _ in range(policy.max_redirects + 1):
            parts, host, port = check_url(url, policy)
            try:
                infos = await loop.run_in_executor(
                    None, functools.partial(resolve, host, port, type=socket.SOCK_STREAM)
                )
            except (socket.gaierror, UnicodeError) as e:
                raise FetchError(f"image host {host!r} does not resolve: {e}") from None
            ips = check_addresses(host, infos, policy)
            r, last = None, None
            for ip in ips:  # in the resolver's order; the next one if a connection fails
                try:
                    r = await client.send(_pinned_request(client, parts, ip), stream=True)
                    break
                except httpx.ConnectError as e:
                    last = e
                except httpx.HTTPError as e:
                    raise FetchError(f"image fetch failed: {type(e).__name__}: {e}") from None
                except httpx.InvalidURL as e:  # a redirect httpx cannot even parse (a data: URL, ...)
                    raise FetchError(f"image URL redirected to a URL that is refused: {e}") from None
            if r is None:
                raise FetchError(f"image fetch failed: could not connect to {host!r}: {last}")
            try:
                if r.is_redirect:
                    try:
                        url = urllib.parse.urljoin(url, r.headers["location"])
                    except ValueError as e:
                        raise FetchError(f"image URL redirected to a malformed URL: {e}") from None
                    continue
                try:
                    return await _read_image(r, policy)
                except httpx.HTTPError as e:
                    raise FetchError(f"image fetch failed: {type(e).__name__}: {e}") from None
            finally:
                await r.aclose()
    raise FetchError(f"image URL redirected more than {policy.max_redirects} times")


async def _within(coro, timeout_s: float):
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        raise FetchError(f"image fetch took longer than {timeout_s:g} s") from None


def fetch(url: str, policy: FetchPolicy = FetchPolicy(), *, resolve=socket.getaddrinfo) -> bytes:
    """The bytes of the image at `url`, or FetchError (see the module comment).  Blocking; on a
    thread that runs an event loop it runs on a thread of its own."""
    run = lambda: asyncio.run(_within(_fetch(url, policy, resolve), policy.timeout_s))  # noqa: E731
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(run).result()
