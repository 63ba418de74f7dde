"""aiohttp's private state, read in one place.

The router needs two things aiohttp does not offer publicly: the protocol arguments of the
`web.Server` an `AppRunner` made (router/edge/server.py `_adopt` rebuilds it with our protocol),
and the payload writer of a prepared `StreamResponse`, whose transport the splice relay
(router/relay/splice.py) writes its chunks onto. Both go through `aiohttp_private`, which checks
what it reads and raises `AiohttpChanged` saying what moved when an aiohttp upgrade renames or
retypes it, instead of the router failing somewhere later
(tests/router/relay/test_aiohttp_private.py and
tests/router/edge/test_client_bounds.py run it against the installed aiohttp).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, cast

import aiohttp
from aiohttp.abc import AbstractStreamWriter

__all__ = ["AiohttpChanged", "aiohttp_private", "prepared_writer"]

_MISSING = object()


class AiohttpChanged(RuntimeError):
    """The installed aiohttp no longer has the private state this module relies on."""


def aiohttp_private(
    obj: object, name: str, kind: type | tuple[type, ...], *, optional: bool = False
) -> Any:
    """`obj.<name>`, one of aiohttp's private attributes, checked to be a `kind` (or None, if
    `optional`: it exists but is unset).

    The one function in router/ that reads aiohttp's private state."""
    value = getattr(obj, name, _MISSING)
    if value is None and optional:
        return None
    if value is _MISSING or not isinstance(value, kind):
        raise AiohttpChanged(
            f"aiohttp {aiohttp.__version__}: {type(obj).__qualname__}.{name} is "
            f"{'missing' if value is _MISSING else type(value).__qualname__}, not {kind!r}; "
            "router/relay/aiohttp_private.py and its caller must be updated for this aiohttp "
            "version"
        )
    return value


class Drains(Protocol):
    """What the splice relay waits on while the client's buffer is full."""

    async def drain(self) -> None: ...


def prepared_writer(client: Any) -> tuple[Drains, asyncio.Transport]:
    """The payload writer and transport of `client`, a prepared (headers sent) response, for
    writing body bytes without aiohttp's per-write overhead (router/relay/splice.py). Raises
    `ConnectionResetError` if the client has gone already. The lean front door's stream
    (router/edge/lean_door.py `LeanStream`) is its own writer: its `splice_target`."""
    target = getattr(client, "splice_target", None)
    if target is not None:
        drains, transport = target()
        if transport.is_closing():
            raise ConnectionResetError("the client's connection is closed")
        return drains, transport
    # None once the body is ended (write_eof) or before prepare: nothing may be written then.
    writer = aiohttp_private(client, "_payload_writer", AbstractStreamWriter, optional=True)
    transport = getattr(writer, "transport", None)
    if writer is None or transport is None or transport.is_closing():
        raise ConnectionResetError("the client's connection is closed")
    if not callable(getattr(transport, "get_write_buffer_size", None)):
        raise AiohttpChanged(
            f"aiohttp {aiohttp.__version__}: the payload writer's transport is "
            f"{type(transport).__qualname__}, not a transport: prepared_writer must be "
            "updated for this aiohttp version"
        )
    return writer, cast(asyncio.Transport, transport)  # uvloop's are not subclasses
