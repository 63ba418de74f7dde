"""meta/v1 Status: the body of every error the API returns (and of a watch's ERROR event).

Reasons and codes as apimachinery's `errors` package makes them: NotFound 404, AlreadyExists
409, BadRequest 400, Expired 410 (a resourceVersion or continue token older than the kept
history), TooManyRequests 429, InternalError 500, Timeout 504.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

__all__ = ["status", "status_response"]

_DEFAULT_REASON = {
    400: "BadRequest",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "AlreadyExists",
    410: "Expired",
    429: "TooManyRequests",
    500: "InternalError",
    504: "Timeout",
}


def status(code: int, message: str, reason: str | None = None, **details: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _DEFAULT_REASON.get(code, ""),
        "code": code,
    }
    if details:
        out["details"] = details
    return out


def status_response(
    code: int,
    message: str,
    reason: str | None = None,
    headers: dict[str, str] | None = None,
    **details: Any,
) -> web.Response:
    return web.json_response(status(code, message, reason, **details), status=code, headers=headers)
