"""Who is calling, and from where.

Tenants are API keys: ``Authorization: Bearer KEY`` (the scheme in any case) names one configured key, and the
tenant id is a hash of that key (never of the header as sent), so each key is exactly one tenant. The admin key
(``--admin-api-key``) is a tenant too, and may also manage shared presets. Without keys the API is open and
everyone is the one tenant "".

Browsers: a page on another site can make the user's browser POST to this server (a local server included), so
state-changing requests that carry a foreign ``Origin`` are refused with 403 unless ``--allowed-origins`` lists
it (CORS, through Starlette's middleware, then lets that page read the answers). The UI's own requests are
same-origin and pass.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import APIError
from app.settings import ServerSettings

_SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # what needs a key when the server has keys


def tenant_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def security_middleware(settings: ServerSettings) -> list[Middleware]:
    """Outermost first: CORS answers preflights and marks allowed answers, then the origin check, then the key."""
    origins = settings.origins
    middleware = []
    if origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["*"],
                allow_headers=["Authorization", "Content-Type", "X-Session-ID"],
                expose_headers=["X-Session-ID", "Retry-After"],
                max_age=600,
            )
        )
    middleware.append(Middleware(OriginGuard, allowed_origins=origins))
    middleware.append(
        Middleware(ApiKeyMiddleware, keys=settings.api_keys, admin_key=settings.admin_api_key)
    )
    return middleware


class ApiKeyMiddleware:
    """Sets ``request.state.tenant`` and ``request.state.admin``; with keys configured, every /v1/ route needs one
    (health, metrics, the OpenAPI document and the UI's static files stay open, as load balancers and browsers
    need them)."""

    def __init__(self, app: ASGIApp, keys: list[str], admin_key: str | None) -> None:
        self.app = app
        self._keys = [(k.encode(), tenant_id(k)) for k in keys]
        self._admin = admin_key.strip().encode() if admin_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key, tenant = self._match(Headers(scope=scope).get("authorization", ""))
        if self._keys and tenant is None and scope["path"].startswith(KEYED_PATHS):
            error = APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["tenant"] = tenant or ""
        # no keys: one user, all rights
        state["admin"] = not self._keys or (key is not None and key == self._admin)
        await self.app(scope, receive, send)

    def _match(self, header: str) -> tuple[bytes | None, str | None]:
        """The configured key the header carries, and its tenant; every key is compared (in constant time)."""
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None, None
        given, found = token.strip().encode(), (None, None)
        for key, tenant in self._keys:
            if hmac.compare_digest(given, key):
                found = (key, tenant)
        return found


class OriginGuard:
    """403 for a state-changing request whose ``Origin`` is neither this server nor an allowed origin.

    Same origin: the browser says so (``Sec-Fetch-Site: same-origin``, which a page cannot forge), or, for
    browsers without fetch metadata, the Origin's host and port are the ``Host`` the request was sent to. Requests
    without an ``Origin`` (curl, SDKs, servers) are not from a browser page on another site and pass."""

    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self._allowed = set(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in _SAFE_METHODS:
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if origin is not None and not self._same_or_allowed(origin, headers):
                error = APIError(
                    403,
                    f"Origin: cross-origin requests from {origin!r} are refused (a browser page on "
                    "another site); start the server with --allowed-origins to allow it",
                    param="Origin",
                    code="cross_origin_refused",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _same_or_allowed(self, origin: str, headers: Headers) -> bool:
        if "*" in self._allowed or origin.rstrip("/") in self._allowed:
            return True
        if headers.get("sec-fetch-site") == "same-origin":
            return True
        return (
            origin != "null" and urlsplit(origin).netloc.lower() == headers.get("host", "").lower()
        )
