"""Log records: the request id on every line of a request, secrets scrubbed, JSON or text.

`configure_logging` is called by the process entry only (router/edge/serve_cli.py); every other
module
just logs. The request id travels in a context variable, set once where a request's flow is
made (router/edge/app.py) and inherited by whatever that request's task logs or starts, so no
call site passes it along.

Secrets never reach the output (router/redact.py): the configured ones (client API keys, the
admin tokens, workers' API keys, the passwords of the Redis and worker URLs) are masked wherever
a line shows them, and so is anything after `Bearer ` or `Basic ` and the credentials of any URL
(userinfo, `?password=`...), however it got into the message or its traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from contextvars import ContextVar
from typing import IO

from router.redact import Redactor, secrets_of

__all__ = ["REQUEST_ID", "bind_request_id", "configure_logging", "secrets_of"]

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


def bind_request_id(request_id: str) -> None:
    """Every line logged from here on in this task (and the tasks it starts) carries it."""
    REQUEST_ID.set(request_id)


class _RequestContext(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get() or "-"
        return True


class _Redact(logging.Filter):
    """Formats the message once and scrubs it: arguments are where secrets hide."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.scrub = Redactor(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: keep what we can
            message = str(record.msg)
        record.msg, record.args = self.scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.scrub(record.exc_text)
        # The JSON formatter formats exc_info again (unscrubbed) when it is there; without it,
        # both formatters show the scrubbed exc_text.
        record.exc_info = None
        if record.stack_info:
            record.stack_info = self.scrub(record.stack_info)
        for key, value in record.__dict__.items():
            # `extra=` fields: the JSON formatter prints each of them.
            if key not in _RECORD_FIELDS and isinstance(value, str):
                record.__dict__[key] = self.scrub(value)
        return True


# A LogRecord's own attributes (names, paths, levels): the rest came in through `extra=`.
_RECORD_FIELDS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "request_id"}


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )


def configure_logging(
    level: str = "INFO",
    fmt: str = "text",
    *,
    secrets: Iterable[str] = (),
    stream: IO[str] | None = None,
) -> logging.Handler:
    """One handler on the root logger, replacing any: JSON (one object a line) or text."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_RequestContext())
    handler.addFilter(_Redact(secrets))
    handler.setFormatter(_json_formatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
