"""Every error the router answers with, and its OpenAI-style body.

    RouterError                      500 internal_error
    ├── InvalidRequest               400 invalid_request_error   (bad JSON, wrong types, bad values)
    │   └── BodyTooLarge             413 invalid_request_error
    ├── Unauthorized                 401 authentication_error    (no credential, or a wrong one)
    ├── Forbidden                    403 permission_error        (a valid one, not enough for this)
    ├── ModelNotFound                404 model_not_found
    ├── NoCapacity                   429 rate_limit_exceeded (+ Retry-After)
    ├── UpstreamError                502 upstream_error          (a worker failed or spoke nonsense)
    │   └── UpstreamRejected         the worker's own 4xx status, passed through
    ├── Unavailable                  503 service_unavailable (+ Retry-After)
    │   └── NotInRotation            503 no_worker_in_rotation   (no worker can serve it now)
    ├── DeadlineExceeded             504 timeout
    └── HTTPRefusal                  the HTTP server's own status (no such route or method, a
                                     request aiohttp's parser cannot read)

Every error answer is built here, from a `RouterError`, in one of two shapes:

    err.body(), error_response(err)   {"error": {"message", "type", "param", "code"}}: the
                                      app's middleware (router/edge/app.py) and the HTTP server's
                                      own answers (router/edge/server.py `handle_error`)
    stream_error_frame(err, ...)      the frame that ends a stream whose headers already went
                                      out: vLLM's `data: {"error": ...}` and `[DONE]`, or the
                                      Responses API's `event: error`

Code that catches a foreign exception converts it here with `raise ... from exc`. The foreign
errors mapped rather than converted are the state store's `StoreError`, which can rise from
any store call (`as_router_error`: a 503, or a 429 for `StoreBusy`, the router's own
overload), and whatever else reaches the middleware (`as_router_error` again: aiohttp's own
HTTP errors keep their status, anything unexpected is a 500 that tells the client nothing).
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web

from router.redact import scrub
from state.base import StoreBusy, StoreError

__all__ = [
    "RouterError",
    "InvalidRequest",
    "BodyTooLarge",
    "ClosesConnection",
    "RequestTimeout",
    "BadRequestBody",
    "Unauthorized",
    "Forbidden",
    "ModelNotFound",
    "NoCapacity",
    "QuotaExceeded",
    "UpstreamError",
    "UpstreamRejected",
    "Unavailable",
    "DeadlineExceeded",
    "HTTPRefusal",
    "NotInRotation",
    "INTERNAL_ERROR_MESSAGE",
    "error_body",
    "error_response",
    "stream_error_frame",
    "as_router_error",
    "STORE_RETRY_AFTER_S",
]

# A store outage is usually a restart or a failover: seconds.
STORE_RETRY_AFTER_S = 2.0

# What a client is told of a bug: nothing (the traceback is in the log).
INTERNAL_ERROR_MESSAGE = "internal router error"


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> bytes:
    """The OpenAI error object, the one shape of every error the router answers with."""
    # A message may quote a worker's error or a URL (router/redact.py: credentials masked).
    message = scrub(message)
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


class RouterError(Exception):
    status = 500
    type = "internal_error"
    code: Any = None

    def __init__(self, message: str, *, param: str | None = None, code: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class ClosesConnection(InvalidRequest):
    """The rest of the request's body will not be read: the connection ends with the answer,
    and says so, so that a keep-alive client does not send its next request on it."""

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class RequestTimeout(ClosesConnection):
    """The request (head or body) did not arrive in time."""

    status = 408
    code = "request_timeout"


class BadRequestBody(ClosesConnection):
    """The body could not be read: not valid per its Content-Encoding, or bad framing."""

    code = "bad_request_body"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        # RFC 9110: a 401 names the scheme that would be accepted.
        return {"WWW-Authenticate": 'Bearer realm="disagg-router"'}


class Forbidden(RouterError):
    """The caller is known (a valid token) but that token does not allow this; or nothing
    could (the feature's token is not configured)."""

    status = 403
    type = "permission_error"


class ModelNotFound(RouterError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class _RetryAfter(RouterError):
    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = max(0.0, retry_after_s)

    def headers(self) -> dict[str, str]:
        # Retry-After takes whole seconds; round up so a client never retries too early.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class NoCapacity(_RetryAfter):
    status = 429
    type = "rate_limit_exceeded"
    code = "no_decode_capacity"


class QuotaExceeded(_RetryAfter):
    """A tenant over one of its limits (state/quotas.py): `code` names the limit, the message
    says it and its value, Retry-After is when the same request would be let through."""

    status = 429
    type = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        limit: str,
        retry_after_s: float,
        rate_headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s, code=limit)
        self.rate_headers = rate_headers or {}

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **self.rate_headers}


class UpstreamError(RouterError):
    status = 502
    type = "upstream_error"


class UpstreamRejected(UpstreamError):
    """A worker's own 4xx: the client's request was bad, so the status passes through."""

    def __init__(
        self, status: int, message: str, *, type_: str, param: str | None = None, code: Any = None
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type = type_


class Unavailable(_RetryAfter):
    status = 503
    type = "service_unavailable"


class NotInRotation(Unavailable):
    """No worker in rotation can serve the request: `what` names the pool ("decode worker for
    m"), `why` what its workers do instead (router/workers/rotation.py `why_empty`)."""

    code = "no_worker_in_rotation"

    def __init__(self, what: str, why: str, *, retry_after_s: float) -> None:
        why = why or "none is configured or registered"
        super().__init__(f"no {what} is in rotation: {why}", retry_after_s=retry_after_s)


class DeadlineExceeded(RouterError):
    status = 504
    type = "timeout"


class HTTPRefusal(RouterError):
    """An answer the HTTP server gives of its own (aiohttp's: a route or method that does not
    exist, a request its parser cannot read), with aiohttp's status."""

    def __init__(
        self, status: int, message: str, *, type_: str = "invalid_request_error", code: Any = None
    ) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.type = type_


def as_router_error(exc: BaseException, *, body_limit: int = 0) -> RouterError:
    """The answer for `exc`: itself if a RouterError; for a StoreError a 503 (its detail,
    which names hosts, stays in the log), or a 429 when the router itself is overloaded; for
    aiohttp's own HTTP errors their status (413 says `body_limit`); else a 500 that tells
    the client nothing."""
    if isinstance(exc, RouterError):
        return exc
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return BodyTooLarge(f"the request body is larger than {body_limit} bytes")
    if isinstance(exc, web.HTTPException):
        return HTTPRefusal(exc.status, exc.reason)
    if not isinstance(exc, StoreError):
        return RouterError(INTERNAL_ERROR_MESSAGE)
    if isinstance(exc, StoreBusy):
        return NoCapacity(
            "the router is overloaded (no state-store connection came free in time); retry",
            retry_after_s=1.0,
            code="router_overloaded",
        )
    return Unavailable(
        "the router's shared state store is unavailable; retry shortly",
        retry_after_s=STORE_RETRY_AFTER_S,
        code="store_unavailable",
    )


# -- the answers built from a RouterError (besides `err.body()`) -------------------------------


def stream_error_frame(err: RouterError, *, responses_api: bool = False) -> bytes:
    """What ends a stream whose headers already went out, never a silent cut: the Responses
    API's own error event (OpenAI's `ResponseErrorEvent` fields) when `responses_api`, else
    vLLM's error frame (its `param` null) and [DONE]."""
    if responses_api:
        event = {
            "type": "error",
            "code": err.type,
            "message": scrub(err.message),
            "param": err.param,
        }
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"data: " + error_body(err.message, err.type, None, err.code) + b"\n\ndata: [DONE]\n\n"


def error_response(err: RouterError) -> web.Response:
    """`err` as a whole HTTP answer: its status, its headers, its OpenAI body."""
    return web.Response(
        body=err.body(), status=err.status, headers=err.headers(), content_type="application/json"
    )
