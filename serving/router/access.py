"""Who may call which of the router's routes (the API keys: `serving.router_auth`; the
deployment's internal token: `serving.internal_auth`).

* /v1/*: an API key when the deployment has any (its tenant salts the request's caches); open
  otherwise (loopback development: every client the anonymous tenant).
* The operator's routes (/admin/workers, /docs, /openapi.json, the worker details in /health):
  an API key or the internal token when either is configured.
* /admin/drain and /admin/resume: the internal token (an API key where the deployment has no
  internal token; anyone where it has neither).
* /health's status and /metrics: open, as vLLM's are.

Every refusal is a 401 in OpenAI's error shape with ``WWW-Authenticate: Bearer``, counted as
kimik3_router_rejected{reason="unauthorized"}.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from serving import internal_auth
from serving.openai_api import APIError
from serving.router_auth import KeyRing


class Access:
    """The checks above for one router: `keys` its API keys, `metrics` its `RouterMetrics`.
    The internal token is read from the environment on each check (`internal_auth.token`)."""

    def __init__(self, keys: KeyRing, metrics):
        self.keys, self.metrics = keys, metrics

    def refusal(self, message: str, *, type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
        self.metrics.rejected.labels("unauthorized").inc()
        return JSONResponse(
            APIError(401, message, type=type, code=code).body(),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    def client_tenant(self, request: Request) -> str | JSONResponse:
        """The caller's tenant (`router_auth.KeyRing.tenant`), or a 401 in OpenAI's shape."""
        given = request.headers.get("authorization")
        tenant = self.keys.tenant(given)
        if tenant is not None:
            return tenant
        what = "Incorrect API key provided" if given else "You didn't provide an API key (Authorization: Bearer KEY)"
        return self.refusal(what, code="invalid_api_key")

    def is_operator(self, request: Request) -> bool:
        """Whether the caller may see the deployment's internals: it carries an API key or the
        internal token, or the deployment has neither (loopback development)."""
        token, given = internal_auth.token(), request.headers.get("authorization")
        if token is None and not self.keys:
            return True
        if token is not None and internal_auth.authorized(given, token):
            return True
        return bool(self.keys) and self.keys.tenant(given) is not None

    def operator_only(self, request: Request) -> JSONResponse | None:
        """None when the caller is an operator (`is_operator`), else the 401."""
        if self.is_operator(request):
            return None
        return self.refusal(
            "this route needs an API key or the deployment's internal token (Authorization: Bearer ...)",
            type="authentication_error",
        )

    def admin_only(self, request: Request) -> JSONResponse | None:
        """None when the caller may change the deployment: it carries the internal token (an API
        key where the deployment has no internal token; anyone where it has neither)."""
        token, given = internal_auth.token(), request.headers.get("authorization")
        if token is not None:
            allowed = internal_auth.authorized(given, token)
        else:
            allowed = self.keys.tenant(given) is not None
        if allowed:
            return None
        return self.refusal(
            "the admin routes need the deployment's internal token (`kimik3 launch --state-file`)",
            type="authentication_error",
        )
