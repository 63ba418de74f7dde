"""Reading what workers send back: both vLLM error shapes, SSE comment lines, mid-stream errors.

    {"error": {"message", "type", "param", "code"}}              current vLLM / OpenAI
    {"object": "error", "message", "type", "param", "code"}      older vLLM, SGLang OpenAI paths
    {"error": "text"} / {"detail": "text"}                       FastAPI and plain servers
    data: {"error": {...}}  then data: [DONE]                    an error after streaming began
    : keep-alive                                                 an SSE comment: skip it

Pure functions: the lifecycle decides what to do with a `WorkerError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["WorkerError", "parse_error_body", "is_sse_comment", "sse_data", "stream_error"]


@dataclass(frozen=True, slots=True)
class WorkerError:
    status: int | None  # the HTTP status, or the error's own code when it carries one
    message: str
    type: str | None = None
    param: str | None = None
    # The error's own `code`, as the worker sent it; carried along, not part of its identity.
    code: Any = field(default=None, compare=False)

    def __repr__(self) -> str:
        return f"WorkerError({self.status}, {self.type}: {self.message[:60]!r})"


def _int_or_none(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _from_object(obj: Mapping[str, Any], status: int | None) -> WorkerError | None:
    inner = obj.get("error")
    if isinstance(inner, Mapping):
        fields: Mapping[str, Any] = inner
    elif obj.get("object") == "error":
        fields = obj
    elif isinstance(inner, str):
        return WorkerError(status, inner)
    elif isinstance(obj.get("detail"), str):
        return WorkerError(status, obj["detail"])
    else:
        return None
    message = fields.get("message")
    type_ = fields.get("type")
    param = fields.get("param")
    return WorkerError(
        status if status is not None else _int_or_none(fields.get("code")),
        message if isinstance(message, str) else "unknown worker error",
        type_ if isinstance(type_, str) else None,
        param if isinstance(param, str) else None,
        fields.get("code"),
    )


def parse_error_body(raw: bytes, status: int | None = None) -> WorkerError:
    """The error a worker answered with, whatever its shape (plain text kept as the message)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, Mapping):
        found = _from_object(obj, status)
        if found is not None:
            return found
    text = raw.decode("utf-8", errors="replace").strip()
    return WorkerError(status, text[:2000] or f"worker answered {status} with an empty body")


def is_sse_comment(line: bytes) -> bool:
    """An SSE comment line (`: keep-alive`): carries nothing for the client or the parser."""
    return line.startswith(b":")


def sse_data(line: bytes) -> bytes | None:
    """The payload of a `data:` line (one optional space stripped), or None for any other line."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:]
    if payload.startswith(b" "):
        payload = payload[1:]
    return payload.rstrip(b"\r\n")


def stream_error(payload: bytes) -> WorkerError | None:
    """The error a `data:` payload carries mid-stream, or None for a normal chunk or [DONE]."""
    if not payload.startswith(b"{") or b"error" not in payload:
        return None  # cheap check first: this runs once per streamed token
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, Mapping) or "choices" in obj:
        return None
    return _from_object(obj, None)
