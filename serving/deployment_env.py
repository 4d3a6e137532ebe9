"""The environment a deployment's child processes get (`child_env`): the repo on their path,
the deployment's internal token (`serving.internal_auth`) and store secret (`cache.store_auth`),
never the clients' API keys, and loopback-only listeners where the child has an HTTP port of its
own.  `kimik3 launch` starts its workers and router with it; the demo's Mooncake run its child."""

from __future__ import annotations

import logging
import os
import secrets

from cache.loopback import LoopbackUnavailable, loopback_env, required
from serving import internal_auth

log = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo's root
# One internal token per deployment (this process): the router and every worker share it.
TOKEN = internal_auth.token() or internal_auth.new_token()
# One store secret per deployment: every child authenticates what it writes to the shared stores
# (Mooncake, Redis) with it and accepts only entries tagged with it (`cache.store_auth`).
STORE_SECRET_ENV = "KIMIK3_STORE_SECRET"
STORE_SECRET = os.environ.get(STORE_SECRET_ENV) or secrets.token_hex(32)
# the clients' API key and key file: the router's alone (`serving.launch.Deployment._router_env`)
API_KEY_ENV, API_KEY_FILE_ENV = "KIMIK3_API_KEY", "KIMIK3_API_KEY_FILE"


def child_env(public_port: int | None = None) -> dict:
    """A child's environment: the repo on its path, the deployment's internal token and store
    secret (never the clients' API keys: the router's own environment adds those) and, given
    the child's own HTTP port, loopback-only listeners for everything else it binds (the
    Mooncake transfer engine inside a worker or the router's store probe: `cache.loopback`;
    the HTTP port binds where its --host says)."""
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, API_KEY_FILE_ENV)}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[internal_auth.ENV] = TOKEN
    env[STORE_SECRET_ENV] = STORE_SECRET
    if public_port is not None:
        try:
            env = loopback_env(env, allow_any_ports=(public_port,))
        except LoopbackUnavailable as e:
            if required():
                raise
            log.warning("%s: the store clients' transfer engines will listen on every interface", e)
    return env
