"""The HTTP API's errors and plumbing: OpenAI's error body (`ApiError`), the middlewares
that turn every failure into one (and check the API key), and strict body decoding.

An error leaves as OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the status a client can act on; a bug is a 500 naming the request, its traceback in
the router's log only.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

import msgspec
import structlog
from aiohttp import web

from pdserve.common.errors import RequestError
from pdserve.common.runtime.protocol import Failed
from pdserve.services.router import openai_schema as oa
from pdserve.services.router.input_limits import MAX_JSON_DEPTH, too_deep

log = structlog.get_logger("pdserve.router.http")

MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
CLIENT_KEY = web.RequestKey("pdserve_client", str)  # a request's client, when its key says
BODY_TIMEOUT_KEY = web.AppKey("body_read_timeout_seconds", float)
DEFAULT_BODY_TIMEOUT = 30.0
_SANE_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
_FIELD = re.compile(r"at `\$\.?([^`]*)`")
_FAILED_STATUS = {
    "bad_request": 400,
    "overloaded": 429,
    "peer_down": 503,
    "draining": 503,
    "timeout": 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "invalid_request_error", 429: "overloaded_error",
                503: "service_unavailable_error"}  # fmt: skip
# The id to echo in x-request-id: set by a generation handler, read by the middleware (same
# task, so the same context).
ECHO_ID: ContextVar[str | None] = ContextVar("pdserve_http_request_id", default=None)
_BODY_LEFT_UNREAD = {408, 413}  # a stalled or oversized upload: answered, then closed
_RETRY_LATER = {429, 503}  # statuses worth a retry: tell SDKs when (they honour Retry-After)
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed: probes and scrapers

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An error answer: status plus OpenAI's error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.args = (status, message, param, code)  # pickles (the tokenize pool raises it)
        self.status = status
        self.detail = oa.ErrorDetail(
            message=message,
            type=_ERROR_TYPES.get(status, "server_error"),
            param=param,
            code=code,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        status, message, param, code = self.args
        return (_api_error, (status, message, param, code))

    @classmethod
    def from_failed(cls, failed: Failed) -> ApiError:
        return cls.of_reason(failed.reason, f"request {failed.request_id}: {failed.message}")

    @classmethod
    def of_reason(cls, reason: str, message: str) -> ApiError:
        """The answer to a Failed's ``reason`` (or a Refused's)."""
        return cls(_FAILED_STATUS.get(reason, 500), message, code=reason)

    def response(self) -> web.Response:
        headers = {"Retry-After": "1"} if self.status in _RETRY_LATER else None
        return json_response(oa.ErrorBody(error=self.detail), status=self.status, headers=headers)


def _api_error(status: int, message: str, param: str | None, code: str | None) -> ApiError:
    return ApiError(status, message, param=param, code=code)


def json_response(body: msgspec.Struct, status: int = 200,
          headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    body_bytes = msgspec.json.encode(body)
    return web.Response(body=body_bytes, status=status, content_type="application/json",
                        headers=headers)  # fmt: skip


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's error body; a bug is a 500 naming the request, and
    its traceback goes to the log, never to the client."""
    ECHO_ID.set(None)  # keep-alive requests share the connection's task
    try:
        response = await handler(request)
    except ApiError as exc:
        response = exc.response()
    except RequestError as exc:
        response = ApiError(400, str(exc), code="bad_request").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = http_error(request, exc).response()
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
    except Exception:
        failed_id = ECHO_ID.get() or "-"
        log.exception("http_internal_error", request_id=failed_id, path=request.path)
        response = ApiError(
            500, f"internal error in request {failed_id}; the router's log has details",
            code="internal",
        ).response()  # fmt: skip
    echo_id = ECHO_ID.get() or sane_header(request)
    if echo_id is not None and not response.prepared:
        response.headers["x-request-id"] = echo_id
    if response.status in _BODY_LEFT_UNREAD and not response.prepared:
        return await _closing(request, response)
    return response


async def _closing(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Send ``response``, then close the connection: aiohttp would otherwise linger
    reading the rest of the body (10 s) before it let go of a stalled upload."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None:
        request.transport.close()  # after the buffered answer is written
    return response


def key_middleware(
    api_keys: Sequence[str],
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """OpenAI's scheme: ``Authorization: Bearer <key>`` on every route but OPEN_PATHS, any
    of ``api_keys``. With several, the key a request came with names its client for fair
    admission (``CLIENT_KEY``: its index, never the key)."""
    expected = [key.encode() for key in api_keys]

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            token = given.strip().encode()
            # every key compared (no early exit): the time taken says nothing of which
            matches = [hmac.compare_digest(token, key) for key in expected]
            if scheme.lower() != "bearer" or not any(matches):
                what = "no API key" if not given else "an incorrect API key"
                raise ApiError(401, f"{what} was provided; send the server's key as "
                               "'Authorization: Bearer KEY'", code="invalid_api_key")  # fmt: skip
            if len(expected) > 1:
                request[CLIENT_KEY] = f"key:{matches.index(True)}"
        return await handler(request)

    return check_key


def http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"{request.method} is not allowed on {request.path}; use {allowed}"
        return ApiError(405, message, code="method_not_allowed")
    if exc.status == 404:
        message = f"no such route: {request.method} {request.path} (see /openapi.json)"
        return ApiError(404, message, code="not_found")
    if exc.status == 413:
        message = f"the request body is over {request.app[MAX_BODY_KEY]} bytes"
        return ApiError(413, message, code="body_too_large")
    return ApiError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))


def sane_header(request: web.Request) -> str | None:
    value = request.headers.get("x-request-id")
    return value if value is not None and _SANE_ID.fullmatch(value) else None


async def read_body(request: web.Request) -> bytes:
    """The whole body, read within ``body_read_timeout_seconds`` (else 408 and the
    connection closed: a stalled or endless upload holds nothing for long); one that says
    it is over the size limit is refused before a byte of it is read."""
    limit = request.app[MAX_BODY_KEY]
    if (request.content_length or 0) > limit:
        raise ApiError(413, f"the request body is {request.content_length} bytes, over "
                       f"{limit} (max_body_bytes)", code="body_too_large")  # fmt: skip
    seconds = request.app.get(BODY_TIMEOUT_KEY, DEFAULT_BODY_TIMEOUT)
    try:
        async with asyncio.timeout(seconds):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body was not received within {seconds:g} s "
                       "(body_read_timeout_seconds); the connection is closed",
                       code="body_timeout") from None  # fmt: skip


async def decode_body(request: web.Request, kind: type[T]) -> T:
    """The body decoded strictly into ``kind``, and no deeper than MAX_JSON_DEPTH (checked
    before anything recursive runs over it: JSON encoding, pickling, templates, grammars)."""
    body = await read_body(request)
    try:
        decoded = oa.decode_request(body, kind)
    except msgspec.ValidationError as exc:
        field = _FIELD.search(str(exc))
        raise ApiError(400, f"invalid request: {exc}", param=field and field.group(1),
                       code="invalid_value") from None  # fmt: skip
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    path = too_deep(decoded)
    if path is not None:
        shown = path if len(path) <= 100 else f"{path[:60]}...{path[-30:]}"
        raise ApiError(400, f"{shown} is nested more than {MAX_JSON_DEPTH} lists and objects deep "
                       "(the limit of this server, for every schema and free-form field); "
                       "flatten it", param=path.split(".")[0].split("[")[0],
                       code="nested_too_deeply")  # fmt: skip
    return decoded
