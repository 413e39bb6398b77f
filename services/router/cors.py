"""CORS for the HTTP API: browsers on the allowed origins may call it (off by default).

Headers go on in ``on_response_prepare``, so streamed answers and error bodies carry
them too; a preflight (OPTIONS with Access-Control-Request-Method) is answered before
the API key is checked, as browsers send no credentials with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ALLOWED_METHODS = "GET, POST, OPTIONS"
DEFAULT_HEADERS = "Authorization, Content-Type, x-request-id"
MAX_AGE_S = "600"


class Cors:
    def __init__(self, allowed_origins: Sequence[str]) -> None:
        self.any_origin = "*" in allowed_origins
        self.origins = frozenset(allowed_origins)

    def allow(self, request: web.Request) -> str | None:
        """The Access-Control-Allow-Origin value for this request, or None."""
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        return "*" if self.any_origin else origin if origin in self.origins else None

    def install(self, app: web.Application) -> None:
        app.middlewares.insert(0, self._preflight)
        app.on_response_prepare.append(self._add_headers)

    @web.middleware
    async def _preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if self.allow(request) is None:
                return web.Response(status=403, text="origin not allowed")
            wanted = request.headers.get("Access-Control-Request-Headers", DEFAULT_HEADERS)
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": wanted,
                "Access-Control-Max-Age": MAX_AGE_S,
            })  # fmt: skip
        return await handler(request)

    async def _add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = self.allow(request)
        if origin is None:
            return
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "x-request-id, Retry-After"
        if origin != "*":
            response.headers["Vary"] = "Origin"
