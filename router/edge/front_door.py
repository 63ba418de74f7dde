"""The front door: what every request path does before it serves, and the count on its way out.

Both request paths come in here: generation (chat, completions, the Responses API's
prefill/decode path: router/edge/app.py) and the routes served whole by one worker
(router/edge/passthrough.py). In order, `enter` checks

    the replica           503 + Retry-After once it is shutting down (router/edge/shutdown.py)
    the client            401 without a client API key once any is configured; the key names
                          the request's tenant (router/edge/auth.py `client_tenant`,
                          router/tenants.py); none configured: the `default` tenant
    the body's size       413 by its Content-Length before a byte is read, and by aiohttp's
                          `client_max_size` past it (a gzip bomb: the middleware's 413)
    the body's arrival    408 when it is not whole within `timeouts.body_s`, 400 when it cannot
                          be decoded (`read_body`)

and names the request: the client's `X-Request-Id` when it is a sane token, else one of ours.
What the body must say is each route's own (router/openai/api.py, router/openai/responses_pd.py, a
passthrough route's model check).

`RequestCount` counts the request once in `requests_total` by route and the status it ended
with, whatever ended it (499 when the client went away), and in `tenant_requests_total` by its
tenant once the handler names it (`count.tenant`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from types import TracebackType

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError

from router.config import Settings
from router.edge.auth import client_tenant
from router.edge.server import parser_error_text
from router.edge.shutdown import SHUTDOWN
from router.errors import BadRequestBody, BodyTooLarge, RequestTimeout, as_router_error
from router.metrics import RouterMetrics
from router.tenants import KEYRING, TenantSpec

__all__ = ["Entry", "RequestCount", "client_request_id", "enter", "read_body"]

log = logging.getLogger(__name__)

# A client's id goes into upstream headers, the logs and the ledger: a header token of
# visible ASCII, short enough to keep every one of those small.
_MAX_REQUEST_ID = 128


def client_request_id(value: str | None) -> str:
    """The client's X-Request-Id when it is a sane token (visible ASCII, no space, at most 128
    characters), else one of ours."""
    if (
        value
        and len(value) <= _MAX_REQUEST_ID
        and value.isascii()
        and value.isprintable()
        and " " not in value
    ):
        return value
    # 128 random bits, as uuid4's 122, at a quarter of its cost (no UUID object).
    return f"dr-{os.urandom(16).hex()}"


@dataclass(frozen=True, slots=True)
class Entry:
    """A request let in: its body as the client sent it, its id and its tenant."""

    raw: bytes
    request_id: str
    tenant: TenantSpec

    def __repr__(self) -> str:
        return f"Entry({self.request_id}, {len(self.raw)} bytes, tenant={self.tenant.name})"


async def enter(request: web.Request, settings: Settings) -> Entry:
    """Let `request` in, or raise the error that says why not (the module docstring)."""
    request.app[SHUTDOWN].check()
    tenant = client_tenant(request.app[KEYRING], request)
    limit = settings.server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"the request body is larger than {limit} bytes")
    raw = await read_body(request, settings.timeouts.body_s)
    return Entry(raw, client_request_id(request.headers.get("X-Request-Id")), tenant)


async def read_body(request: web.Request, body_s: float) -> bytes:
    """The request body within `body_s` (408), decoded per Content-Encoding (400 if it is not).

    A body over `client_max_size` (a gzip bomb included) still raises aiohttp's
    HTTPRequestEntityTooLarge, which the error middleware answers with 413.
    """
    try:
        if request.content.is_eof():
            # Whole already (a body small enough to arrive with its head, most of them): the
            # read waits for nothing, so no timer is set for it.
            return await request.read()
        async with asyncio.timeout(body_s or None):
            return await request.read()
    except TimeoutError as exc:
        raise RequestTimeout(f"the request body did not arrive within {body_s} s") from exc
    except web.RequestPayloadError as exc:
        if isinstance(exc.__cause__, ContentEncodingError):
            encoding = request.headers.get("Content-Encoding", "")
            raise BadRequestBody(
                f"the request body is not valid {encoding[:40]} (Content-Encoding)",
                code="bad_content_encoding",
            ) from exc
        cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else None
        raise BadRequestBody(
            f"the request body could not be read: {parser_error_text(cause, str(exc))}"
        ) from exc


class RequestCount:
    """`with RequestCount(metrics, route) as count:` counts the request once, on the way out,
    by the status it ended with: `count.status` as the handler set it when it returned, the
    error's status when one ended it, 499 when the client went away (a disconnect cancels
    the handler: router/edge/server.py `handler_cancellation`)."""

    __slots__ = ("_metrics", "_route", "status", "tenant")

    def __init__(self, metrics: RouterMetrics, route: str) -> None:
        self._metrics, self._route = metrics, route
        self.status = 500  # until the handler says otherwise: what a bug answers
        self.tenant: str | None = None  # the request's tenant, once the front door knows it

    def __repr__(self) -> str:
        return f"RequestCount({self._route}, {self.status})"

    def __enter__(self) -> RequestCount:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, asyncio.CancelledError):
            self.status = 499
            self._metrics.client_disconnects.inc()
        elif isinstance(exc, Exception):
            self.status = as_router_error(exc).status  # what the middleware answers
        status = str(self.status)
        self._metrics.requests_by(self._route, status).inc()
        if self.tenant is not None:
            self._metrics.tenant_requests_by(self.tenant, status).inc()
        log.debug("%s answered %d", self._route, self.status)
