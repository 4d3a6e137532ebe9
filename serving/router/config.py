"""The router's options: `RouterConfig`, its command-line flags and its JSON config file.

Precedence, highest first: a command-line flag, the `--config-file` JSON, the environment
(``$KIMIK3_L1_REDIS``, ``$KIMIK3_API_KEY``, ``$KIMIK3_API_KEY_FILE``: values kept off the process
list), the dataclass default.  Flags default to None so that "not given" is told apart from a
value equal to the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from serving import router_auth


@dataclasses.dataclass
class RouterConfig:
    """Everything a router is built from: its workers (URLs by role), the model it serves, and the
    bounds of admission, retries, breakers, bodies, media and the shared store."""

    prefill: list[str] = dataclasses.field(default_factory=list)
    decode: list[str] = dataclasses.field(default_factory=list)
    config: str = "tiny"
    checkpoint: str | None = None  # the workers' checkpoint: its config.json names the model
    # `kimik3.text.load_tokenizer`'s spec: "byte", a tokenizer.json / tiktoken file or a directory
    # (None: the checkpoint's, if it holds one, else "byte"); the workers must use the same one
    tokenizer: str | None = None
    model_name: str | None = None
    max_inflight: int = 16
    max_queue: int = 32
    queue_timeout_s: float = 10.0
    retries: int = 3
    backoff_base_s: float = 0.05
    backoff_max_s: float = 1.0
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 5.0
    request_timeout_s: float = 300.0
    health_interval_s: float = 0.5
    health_timeout_s: float = 2.0
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 30.0
    max_images: int = 16
    max_body_bytes: int = 32 << 20  # larger bodies are a 413 before they are read whole
    body_timeout_s: float = 30.0  # a body not received whole by then is a 408
    no_worker_wait_s: float = 20.0  # with no worker of a role available, wait this long (a restart) before a 503
    image_decoders: int = 4  # requests decoding (and fetching) images at once (off the event loop)
    large_body_parsers: int = 1  # bodies over LARGE_BODY_BYTES whose JSON is parsed at once (off the event loop)
    # Remote image URLs (`cache.media`): fetched under an SSRF-safe policy (public addresses only,
    # checked on the resolved address and on every redirect), through the L1 fetch cache.
    fetch_images: bool = True
    fetch_allow_hosts: tuple[str, ...] | None = None  # None: any public host
    fetch_allow_networks: tuple[str, ...] = ()  # non-public CIDRs let through (tests: 127.0.0.1/32)
    fetch_timeout_s: float = 10.0
    fetch_max_bytes: int = 16 << 20
    l1_bytes: int = 256 << 20  # the embedded L1's budget (0: no L1)
    l1_redis: str | None = None  # redis://127.0.0.1:PORT/0: an L1 shared by every router
    l2_bytes: int = 256 << 20  # decoded pixels by (tenant, content); 0: none
    default_max_tokens: int = 256
    affinity_slack: float = 2.0
    affinity_entries: int = 100_000
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    handoff: str = "auto"  # store | direct | auto (store when the prefill workers have one)
    prefill_timeout_s: float = 30.0  # a direct-handoff prefill answers in one piece: no keepalives
    # clients of the OpenAI routes (/v1/*) send `Authorization: Bearer <key>`, a key of `api_key` or of the
    # key file `api_key_file` (`serving.router_auth`); neither: open, as on loopback
    api_key: str | None = dataclasses.field(default=None, repr=False)
    api_key_file: str | None = None


API_KEY_ENV = router_auth.API_KEY_ENV
API_KEY_FILE_ENV = router_auth.API_KEY_FILE_ENV
LARGE_BODY_BYTES = 1 << 20  # bodies past this parse under `large_body_parsers`
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there

# A worker restart takes 10-20 s (a fresh process compiles its steps): clients retry after that.
RETRY_AFTER = {"Retry-After": "15"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's flags on `parser` (`kimik3 router`, `python -m serving.router`); every option of
    `RouterConfig` defaults to None here (`config_from_args` fills in the rest)."""
    d = RouterConfig()
    _add_deployment_arguments(parser, d)
    _add_tuning_arguments(parser, d)
    _add_media_arguments(parser, d)
    _add_access_arguments(parser)


def _add_deployment_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Where to listen, the workers by role, and the model they serve."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8000, help="the port to serve on")
    parser.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill worker URLs")
    parser.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode (or both) worker URLs")
    parser.add_argument(
        "--config-file",
        default=None,
        help="JSON file with any of these options (prefill, decode, max_inflight, ...); command-line values win",
    )
    parser.add_argument("--config", default=None, help=f"model config (default {d.config})")
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="the workers' checkpoint: the model's config is read from it (overrides --config)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'byte', a tokenizer.json, a tiktoken file or a directory holding one (default: the "
        "checkpoint's tokenizer if it has one, else 'byte'); the workers' must match",
    )
    parser.add_argument(
        "--model-name",
        "--served-model-name",
        dest="model_name",
        default=None,
        help="the model id clients send and metrics carry (default kimik3-<config>)",
    )


def _add_tuning_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Admission, retries, breakers, timeouts and the handoff mode: numbers with defaults."""
    for name in (
        "max_inflight",
        "max_queue",
        "retries",
        "breaker_threshold",
        "max_images",
        "default_max_tokens",
        "max_body_bytes",
        "image_decoders",
        "large_body_parsers",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {getattr(d, name)}")
    for name in (
        "queue_timeout_s",
        "backoff_base_s",
        "backoff_max_s",
        "connect_timeout_s",
        "read_timeout_s",
        "request_timeout_s",
        "health_interval_s",
        "health_timeout_s",
        "breaker_cooldown_s",
        "breaker_max_cooldown_s",
        "affinity_slack",
        "prefill_timeout_s",
        "body_timeout_s",
        "no_worker_wait_s",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=f"default {getattr(d, name)}")
    parser.add_argument(
        "--handoff",
        choices=("auto", "store", "direct"),
        default=None,
        help="how KV moves from prefill to decode workers: through the shared store, or "
        "directly (the router carries it); auto: store when the workers have one",
    )


def _add_media_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Remote images (the SSRF-safe fetcher and its caches) and the shared store's probe."""
    parser.add_argument(
        "--no-fetch-images",
        dest="fetch_images",
        action="store_false",
        default=None,
        help="refuse http(s) image URLs (only data: URLs)",
    )
    parser.add_argument(
        "--fetch-allow-hosts",
        nargs="*",
        default=None,
        metavar="HOST",
        help="fetch images only from these hosts (NAME or .SUFFIX); default any public host",
    )
    parser.add_argument(
        "--fetch-allow-networks",
        nargs="*",
        default=None,
        metavar="CIDR",
        help="non-public networks image fetches may reach (default none)",
    )
    parser.add_argument("--fetch-timeout-s", type=float, default=None, help=f"default {d.fetch_timeout_s}")
    parser.add_argument("--fetch-max-bytes", type=int, default=None, help=f"default {d.fetch_max_bytes}")
    parser.add_argument("--l1-bytes", type=int, default=None, help=f"embedded L1 fetch cache (default {d.l1_bytes})")
    parser.add_argument(
        "--l1-redis",
        default=None,
        help="redis://:PASSWORD@127.0.0.1:PORT/0: a shared L1 fetch cache (or $KIMIK3_L1_REDIS)",
    )
    parser.add_argument("--l2-bytes", type=int, default=None, help=f"decoded-pixel cache (default {d.l2_bytes})")
    parser.add_argument("--mooncake-master", default=None, help="shared store, for the prefix-affinity check")
    parser.add_argument("--mooncake-metadata", default=None, help="the store's HTTP metadata URL")


def _add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """API keys (their tenants salt the caches) and the log level."""
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"clients of /v1/* must send 'Authorization: Bearer KEY' (or set ${API_KEY_ENV}, "
        f"which keeps the key out of the process list); default: no key (loopback)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"API keys, one 'KEY [TENANT]' a line ('#' comments; a key alone is a tenant of its own); "
        f"each key's tenant salts its caches (or set ${API_KEY_FILE_ENV})",
    )
    parser.add_argument("--log-level", default="warning", help="debug | info | warning | error")


def config_from_args(args) -> RouterConfig:
    """The `RouterConfig` of parsed flags over `--config-file` over the environment (module
    docstring); ValueError names a config-file key that is no option."""
    values = {}
    if args.config_file:
        with open(args.config_file) as f:
            values = json.load(f)
        unknown = set(values) - {f.name for f in dataclasses.fields(RouterConfig)}
        if unknown:
            raise ValueError(f"unknown router options in {args.config_file}: {sorted(unknown)}")
    for f in dataclasses.fields(RouterConfig):
        v = getattr(args, f.name, None)
        if v is not None and v != []:
            values[f.name] = v
    if "l1_redis" not in values and os.environ.get("KIMIK3_L1_REDIS"):  # how `kimik3 launch` passes its password
        values["l1_redis"] = os.environ["KIMIK3_L1_REDIS"]
    if "api_key" not in values and os.environ.get(API_KEY_ENV):  # a key kept off the command line (ps)
        values["api_key"] = os.environ[API_KEY_ENV]
    if "api_key_file" not in values and os.environ.get(API_KEY_FILE_ENV):
        values["api_key_file"] = os.environ[API_KEY_FILE_ENV]
    return RouterConfig(**values)
