"""The stand-in's fault knobs on its API requests: the next N fail (500 InternalError or 429
TooManyRequests with Retry-After, as an overloaded API server's priority-and-fairness answers),
and every response waits `delay_s` first. Dropping watches and compacting the history are
the store's (`Drop`, `Store.compact`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .status import status_response

__all__ = ["Faults", "faults_middleware"]


@dataclass(slots=True)
class Faults:
    fail_next: int = 0
    fail_status: int = 500
    delay_s: float = 0.0

    def failure(self) -> web.Response | None:
        """The failure this request gets, counting it, or None."""
        if self.fail_next <= 0:
            return None
        self.fail_next -= 1
        if self.fail_status == 429:
            return status_response(
                429,
                "Too many requests, please try again later.",
                headers={"Retry-After": "1"},
                retryAfterSeconds=1,
            )
        return status_response(
            self.fail_status, "Internal error occurred: stand-in fault", "InternalError"
        )


def faults_middleware(faults: Faults, log: Callable[[web.Request], None]) -> Middleware:
    """Applies `faults` to every request but the control surface's, logging each with `log`."""

    @web.middleware
    async def apply(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/standin/"):
            return await handler(request)  # the control surface is never faulted
        log(request)
        if faults.delay_s > 0:
            await asyncio.sleep(faults.delay_s)
        failure = faults.failure()
        return failure if failure is not None else await handler(request)

    return apply
