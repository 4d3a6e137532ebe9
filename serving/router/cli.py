"""`kimik3 router` and ``python -m serving.router``: the router's command line (flags:
`serving.router.config.add_arguments`) and its server (uvicorn over `Router.create_app`)."""

from __future__ import annotations

import logging

import uvicorn

import serving.router
from serving.cli import standalone_main
from serving.router.config import add_arguments, config_from_args
from serving.router.core import Router


def run(args) -> int:
    """Serve a router built from the parsed flags `args` until it is stopped."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    router = Router(config_from_args(args))
    uvicorn.run(
        router.create_app(), host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0


def main(argv=None) -> int:
    return standalone_main("kimik3 router", serving.router.__doc__, add_arguments, run, argv)
