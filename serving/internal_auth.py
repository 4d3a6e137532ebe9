"""The deployment's internal bearer token: what a worker's state-changing endpoints (/generate,
/prefill, /adopt, /drain, /resume) and the router's /admin routes require.

`kimik3 launch` makes one token per deployment (`KIMIK3_INTERNAL_TOKEN` in its children's
environment, and in its `--state-file`, mode 0600, for the operator); the router sends it on every
call to a worker.  Without it anyone who can reach a worker's port could post KV for another
request's prefix (`/adopt` commits it under that prefix's block hashes) or drain the fleet.  A
process started without the variable (a worker run by hand for development) serves unauthenticated,
bound to loopback as always, and logs that it does.
"""

from __future__ import annotations

import hmac
import os
import secrets

ENV = "KIMIK3_INTERNAL_TOKEN"


def token() -> str | None:
    """This process's token (None: none configured)."""
    return os.environ.get(ENV) or None


def new_token() -> str:
    return secrets.token_urlsafe(32)


def headers(tok: str | None) -> dict:
    """The request headers that carry `tok` (none for None)."""
    return {"Authorization": f"Bearer {tok}"} if tok else {}


def authorized(authorization: str | None, tok: str | None) -> bool:
    """Whether an Authorization header value carries `tok` (always, when no token is configured).
    Constant-time comparison."""
    if tok is None:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), tok.encode())
