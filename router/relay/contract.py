"""What a relay promises its caller, whichever moves the bytes (router/relay/splice.py on the raw
pool, router/relay/aiohttp_relay.py on aiohttp): the decode leg opens the worker's answer and
hands it back bound to its relay function (`Relay`), so the choice is made once, by the leg;
the caller relays, reads or closes it without knowing which it is. The relay reports progress
to a `RelayObserver` and ends with a `RelayResult`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "NO_FIRST_EVENT",
    "Relay",
    "RelayObserver",
    "RelayResult",
    "Rewrite",
    "UpstreamResponse",
]


@dataclass(slots=True)
class RelayResult:
    tokens: int = 0
    completed: bool = False  # saw `data: [DONE]`
    client_gone: bool = False
    upstream_error: str | None = None  # the worker cut the stream, read failed or sent an error
    # Which failure, for the metrics: "kv_handoff_timeout", "error_event"; None = a cut stream.
    error_kind: str | None = None
    first_token_at: float | None = None
    chunks: list[bytes] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"RelayResult(tokens={self.tokens}, completed={self.completed}, "
            f"client_gone={self.client_gone}, upstream_error={self.upstream_error!r})"
        )


NO_FIRST_EVENT = "no first token before the KV handoff deadline (the KV is presumed lost)"


class RelayObserver(Protocol):
    """What a relay tells its caller as the stream goes (both called synchronously)."""

    def first_token(self) -> None:
        """The first event reached the client (the decode worker accepted the KV); once, after
        its write: the client does not wait for the observer's work."""

    def tokens(self, total: int) -> int:
        """`total` tokens forwarded so far (counted as they go out: never after a write that
        waits for a slow client, the worker's KV holds them already). Returns the total it next
        wants to hear of: the relay calls again only after a forwarded read takes the count
        above it (0: after every forwarded read), so an observer with nothing to do until a
        threshold costs one comparison per read, not a call."""


class UpstreamResponse(Protocol):
    """What a relay needs of an upstream response besides its body stream (aiohttp's
    ClientResponse, the raw pool's SpliceResponse)."""

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


R = TypeVar("R", bound=UpstreamResponse)

# relay(upstream, client, *, chat, responses, clock, observer, first_event_by, rewrite)
#   -> RelayResult
RelayFunction = Callable[..., Awaitable[RelayResult]]
# What a relay may do to the whole events it forwards (same bytes back: nothing to do).
Rewrite = Callable[[bytes], bytes]


class Relay(Generic[R]):
    """An open upstream answer (status 200, body unread) bound to the relay that moves it: the
    leg picks the relay once (`relay_splice` for the raw pool's response, `relay_sse` for
    aiohttp's); whoever serves the answer relays, reads or closes it without asking which."""

    __slots__ = ("response", "_relay")

    def __init__(self, response: R, relay: RelayFunction) -> None:
        self.response, self._relay = response, relay

    def __repr__(self) -> str:
        return f"Relay({self.response!r})"

    async def relay(
        self,
        client: Any,
        *,
        chat: bool,
        responses: bool,
        clock: Callable[[], float],
        observer: RelayObserver | None,
        first_event_by: float | None,
        rewrite: Rewrite | None = None,
    ) -> RelayResult:
        """Forward its SSE body to `client` (the client's stream, or a sink that keeps
        nothing) until it ends, either side fails, or it is cancelled. `rewrite`: applied to
        each piece forwarded (whole events; a resumed stream's usage: router/request/
        resumed_usage.py), None for none (the common case, which costs nothing)."""
        return await self._relay(
            self.response,
            client,
            chat=chat,
            responses=responses,
            clock=clock,
            observer=observer,
            first_event_by=first_event_by,
            rewrite=rewrite,
        )

    async def read(self) -> bytes:
        """The whole body (an answer asked for whole)."""
        return await self.response.read()

    def close(self) -> None:
        """Drop the connection (unfinished: vLLM's abort signal)."""
        self.response.close()
