"""Log records: the request id on every line of a request, secrets scrubbed, JSON or text.

`configure_logging` is called by the process entry only (router/cli.py); every other module
just logs. The request id travels in a context variable, set once where a request's flow is
made (router/app.py) and inherited by whatever that request's task logs or starts, so no
call site passes it along.

Secrets never reach the output: the configured ones (client API keys, the admin token,
workers' API keys, passwords in Redis URLs) are replaced by their values wherever a line
shows them, and so is anything after `Bearer ` and the password of any `scheme://user:pw@`
URL, however it got into the message.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable
from contextvars import ContextVar
from typing import IO
from urllib.parse import urlsplit

__all__ = ["REQUEST_ID", "bind_request_id", "configure_logging", "secrets_of"]

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)

_MASK = "***"
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s'\",;]+")
_URL_PASSWORD = re.compile(r"(://[^/\s:@]*:)[^@\s/]+@")
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
        # Longest first, so that a secret containing another is masked whole.
        self.secrets = sorted({str(s) for s in secrets if s and len(str(s)) >= 4}, key=len)[::-1]

    def scrub(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, _MASK)
        text = _BEARER.sub(rf"\g<1>{_MASK}", text)
        return _URL_PASSWORD.sub(rf"\g<1>{_MASK}@", text)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: keep what we can
            message = str(record.msg)
        record.msg, record.args = self.scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self.scrub(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = self.scrub(record.exc_text)
        return True


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )


def secrets_of(settings: object) -> list[str]:
    """Every secret value a Settings object holds (duck-typed: logs imports no config)."""
    found: list[str] = [str(k) for k in getattr(settings, "api_keys", ())]
    found.append(str(getattr(settings, "admin_token", "")))
    found += [str(w.api_key) for w in getattr(settings, "workers", ())]
    url = getattr(settings, "redis_url", None)
    if url:
        found.append(urlsplit(url).password or "")
    return [s for s in found if s]


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
