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
    └── DeadlineExceeded             504 timeout

Errors are mapped to responses in exactly one place (`router.app`'s middleware); code that
catches a foreign exception converts it here with `raise ... from exc`. The one foreign error
mapped rather than converted is the state store's `StoreError`, which can rise from any store
call: `as_router_error` turns it into a 503 — or a 429 for `StoreBusy`, the router's own
overload — for the middleware and a stream's error frame alike.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from router.redact import scrub
from state.base import StoreBusy, StoreError

__all__ = [
    "RouterError",
    "InvalidRequest",
    "BodyTooLarge",
    "Unauthorized",
    "Forbidden",
    "ModelNotFound",
    "NoCapacity",
    "UpstreamError",
    "UpstreamRejected",
    "Unavailable",
    "DeadlineExceeded",
    "error_body",
    "sse_error_frame",
    "as_router_error",
    "STORE_RETRY_AFTER_S",
]

# A store outage is usually a restart or a failover: seconds.
STORE_RETRY_AFTER_S = 2.0


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> bytes:
    # A message may quote a worker's error or a URL (router/redact.py: credentials masked).
    message = scrub(message)
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def sse_error_frame(message: str, type_: str, code: Any = None) -> bytes:
    """The error frame that ends a stream whose headers already went out (vLLM's shape)."""
    return b"data: " + error_body(message, type_, None, code) + b"\n\ndata: [DONE]\n\n"


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


class DeadlineExceeded(RouterError):
    status = 504
    type = "timeout"


def as_router_error(exc: RouterError | StoreError) -> RouterError:
    """The response for `exc`: itself if a RouterError; for a StoreError a 503 (its detail,
    which names hosts, stays in the log), or a 429 when the router itself is overloaded."""
    if isinstance(exc, RouterError):
        return exc
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
