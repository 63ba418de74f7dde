"""What a relay promises its caller, whichever moves the bytes (router/relay/splice.py on the raw
pool, router/relay/aiohttp_relay.py on aiohttp): the decode leg opens the worker's answer and
hands it back bound to its relay (`Relay`), so the choice of relay is made once, by the leg;
the caller relays, reads or closes it without knowing which it is. The relay reports progress
to a `RelayObserver` and ends with a `RelayResult`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["NO_FIRST_EVENT", "Relay", "RelayObserver", "RelayResult"]


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
        """The first event reached the client (the decode worker accepted the KV); once."""

    def tokens(self, total: int) -> int:
        """`total` tokens forwarded so far. Returns the total it next wants to hear of: the
        relay calls again only after a forwarded read takes the count above it (0: after
        every forwarded read), so an observer with nothing to do until a threshold costs one
        comparison per read, not a call."""


class Relay(Protocol):
    """An open upstream answer (status 200, body unread) and the relay that moves it."""

    async def relay(
        self,
        client: Any,
        *,
        chat: bool,
        responses: bool,
        clock: Callable[[], float],
        observer: RelayObserver | None,
        first_event_by: float | None,
    ) -> RelayResult:
        """Forward its SSE body to `client` (the client's stream, or a sink that keeps
        nothing) until it ends, either side fails, or it is cancelled."""

    async def read(self) -> bytes:
        """The whole body (an answer asked for whole)."""

    def close(self) -> None:
        """Drop the connection (unfinished: vLLM's abort signal)."""
