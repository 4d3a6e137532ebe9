"""A safe fetcher for remote images (`image_url`s with http or https), issue 19.

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
  connecting;
* refuses a content type outside the image types, a body over `max_bytes` (read as a stream:
  the cap holds whatever Content-Length says) and anything slower than `timeout_s` in all.

Every refusal is a `FetchError` whose message names the reason; the router turns it into a
400 before any worker sees the request.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import time
import urllib.parse

import httpx

IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp")


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


def _host_allowed(host: str, allow_hosts) -> bool:
    if allow_hosts is None:
        return True
    host = host.lower().rstrip(".")
    return any(host == p.lower() or (p.startswith(".") and host.endswith(p.lower())) for p in allow_hosts)


def address_allowed(ip: str, allow_networks=()) -> bool:
    """Whether connecting to `ip` is allowed: a globally routable address, or one inside a
    network the policy permits."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if any(addr in ipaddress.ip_network(net) for net in allow_networks):
        return True
    return addr.is_global and not addr.is_multicast


def resolve_checked(url: str, policy: FetchPolicy, resolve=socket.getaddrinfo) -> tuple[urllib.parse.SplitResult, str]:
    """(the parsed URL, the address to connect to): every check that needs no connection.
    Raises FetchError naming the refusal."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise FetchError(f"malformed image URL: {e}") from None
    if parts.scheme.lower() not in policy.schemes:
        raise FetchError(f"image URL scheme {parts.scheme!r} is not allowed (allowed: {', '.join(policy.schemes)})")
    if parts.username is not None or parts.password is not None:
        raise FetchError("image URLs with user info (user:password@host) are refused")
    host = parts.hostname
    if not host:
        raise FetchError("image URL has no host")
    if not _host_allowed(host, policy.allow_hosts):
        raise FetchError(f"image host {host!r} is not on the allow-list")
    port = port or (443 if parts.scheme.lower() == "https" else 80)
    try:
        infos = resolve(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise FetchError(f"image host {host!r} does not resolve: {e}") from None
    ips = sorted({info[4][0] for info in infos})
    if not ips:
        raise FetchError(f"image host {host!r} does not resolve")
    refused = [ip for ip in ips if not address_allowed(ip, policy.allow_networks)]
    if refused:
        raise FetchError(f"image host {host!r} resolves to a non-public address ({refused[0]}): refused before "
                         f"connecting")
    return parts, ips[0]


def _pinned_request(client: httpx.Client, parts, ip: str):
    """A GET of `parts` sent to `ip` (the checked address), with the URL's own host for the Host
    header and TLS."""
    host = parts.hostname
    literal = f"[{ip}]" if ":" in ip else ip
    netloc = literal + (f":{parts.port}" if parts.port else "")
    target = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    headers = {"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": ", ".join(IMAGE_TYPES)}
    extensions = {"sni_hostname": host} if parts.scheme.lower() == "https" else {}
    return client.build_request("GET", target, headers=headers, extensions=extensions)


def _read_image(r: httpx.Response, policy: FetchPolicy, deadline: float) -> bytes:
    if r.status_code != 200:
        raise FetchError(f"image URL answered {r.status_code}")
    ctype = r.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype not in policy.content_types:
        raise FetchError(f"image URL content type {ctype or 'missing'!r} is not an image type "
                         f"({', '.join(policy.content_types)})")
    length = r.headers.get("content-length")
    if length and length.isdigit() and int(length) > policy.max_bytes:
        raise FetchError(f"image of {int(length)} bytes; at most {policy.max_bytes} are fetched")
    body = bytearray()
    try:
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > policy.max_bytes:
                raise FetchError(f"image larger than {policy.max_bytes} bytes")
            if time.monotonic() > deadline:
                raise FetchError(f"image fetch took longer than {policy.timeout_s:g} s")
    except httpx.TimeoutException:
        raise FetchError(f"image fetch took longer than {policy.timeout_s:g} s") from None
    except httpx.HTTPError as e:
        raise FetchError(f"image fetch failed: {type(e).__name__}: {e}") from None
    return bytes(body)


def fetch(url: str, policy: FetchPolicy = FetchPolicy(), *, resolve=socket.getaddrinfo) -> bytes:
    """The bytes of the image at `url`, or FetchError (see the module comment)."""
    deadline = time.monotonic() + policy.timeout_s
    with httpx.Client(follow_redirects=False, trust_env=False) as client:
        for _ in range(policy.max_redirects + 1):
            parts, ip = resolve_checked(url, policy, resolve)
            left = deadline - time.monotonic()
            if left <= 0:
                raise FetchError(f"image fetch took longer than {policy.timeout_s:g} s")
            request = _pinned_request(client, parts, ip)
            request.extensions["timeout"] = httpx.Timeout(left).as_dict()
            try:
                r = client.send(request, stream=True)
            except httpx.TimeoutException:
                raise FetchError(f"image fetch took longer than {policy.timeout_s:g} s") from None
            except httpx.HTTPError as e:
                raise FetchError(f"image fetch failed: {type(e).__name__}: {e}") from None
            try:
                if r.is_redirect:
                    location = r.headers.get("location")
                    if not location:
                        raise FetchError(f"image URL redirected ({r.status_code}) without a Location")
                    url = urllib.parse.urljoin(url, location)
                    continue
                return _read_image(r, policy, deadline)
            finally:
                r.close()
    raise FetchError(f"image URL redirected more than {policy.max_redirects} times")
