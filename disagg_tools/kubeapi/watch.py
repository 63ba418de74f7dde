"""One watch: a chunked HTTP response of JSON lines, `{"type": ..., "object": ...}`.

As the API server's watch cache serves it:
  - resourceVersion unset or "0": synthetic ADDED events for the objects that exist now, then
    every change after; a number N: every change after N, or one ERROR event carrying a Status
    (410, reason Expired, "too old resource version: N (oldest-1)") and the end of the stream
    when the history no longer reaches back to N (HTTP 200: the error is in the stream);
  - a change is filtered through the selectors before and after it: an object that starts
    matching arrives as ADDED, one that stops matching as DELETED (its last matching state,
    stamped with the change's resourceVersion), a deleted object as DELETED the same way;
  - allowWatchBookmarks: every `bookmark_interval_s` a BOOKMARK whose object carries only
    kind, apiVersion and metadata.resourceVersion (everything up to it has been sent);
    sendInitialEvents=true ends the initial ADDED events with a bookmark annotated
    `k8s.io/initial-events-end: "true"`;
  - timeoutSeconds (else `default_timeout_s`) ends the stream cleanly, as the server's own
    watch timeout does; the client re-watches from the last resourceVersion it saw.
A `Drop` sent through the store ends every watch at once: cleanly (the last chunk written) or
abruptly (the connection closed mid-stream, as a load balancer or a dying server does).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .objects import Resource
from .query import ListQuery
from .status import status
from .store import Change, Expired, Store

__all__ = ["BookmarkNow", "Drop", "WatchSettings", "serve_watch", "watch_event"]

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Drop:
    """End every open watch now; `abrupt`: close the connection without the last chunk."""

    abrupt: bool = True


@dataclass(frozen=True, slots=True)
class BookmarkNow:
    """Send a bookmark on every watch that allows them, without waiting for the interval."""


@dataclass(frozen=True, slots=True)
class WatchSettings:
    bookmark_interval_s: float = 60.0  # the API server sends one about every minute
    default_timeout_s: float = 1800.0  # its --min-request-timeout
    too_large_wait_s: float = 3.0  # how long a watch from a future resourceVersion waits


def watch_event(change: Change, query: ListQuery) -> tuple[str, Obj] | None:
    """What a watcher with `query`'s selectors sees of `change`, or None."""
    now = change.obj is not None and query.selects(change.obj)
    before = change.prev is not None and query.selects(change.prev)
    if now and not before:
        return "ADDED", change.obj  # type: ignore[return-value]
    if now:
        return "MODIFIED", change.obj  # type: ignore[return-value]
    if before:
        gone = copy.deepcopy(change.prev)
        assert gone is not None
        gone["metadata"]["resourceVersion"] = str(change.rv)
        return "DELETED", gone
    return None


def _line(kind: str, obj: Obj) -> bytes:
    return orjson.dumps({"type": kind, "object": obj}) + b"\n"


def _bookmark(resource: Resource, rv: int, initial_end: bool = False) -> Obj:
    meta: Obj = {"resourceVersion": str(rv)}
    if initial_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"kind": resource.kind, "apiVersion": resource.api_version, "metadata": meta}


async def serve_watch(
    request: web.Request,
    store: Store,
    resource: Resource,
    query: ListQuery,
    settings: WatchSettings,
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    queue = store.subscribe()
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    try:
        start = query.rv_number
        if start is not None and start > store.rv:
            if not await store.wait_for(start, settings.too_large_wait_s):
                return await _error_stream(
                    request,
                    status(
                        504,
                        f"Too large resource version: {start}, current: {store.rv}",
                        "Timeout",
                        causes=[{"reason": "ResourceVersionTooLarge", "message": "Too large"}],
                        retryAfterSeconds=1,
                    ),
                )
        initial: list[tuple[str, Obj]]
        if start is None or query.send_initial_events:
            if query.send_initial_events is False:
                initial = []
            else:
                objects = sorted(store.items(resource.name).items())
                initial = [("ADDED", obj) for _, obj in objects if query.selects(obj)]
        else:
            try:
                changes = store.changes_since(start)
            except Expired as e:
                return await _error_stream(request, status(410, str(e), "Expired"))
            initial = [
                ev
                for c in changes
                if c.resource == resource.name and (ev := watch_event(c, query)) is not None
            ]
        last_rv = store.rv  # every change up to here is in `initial`; later ones are queued

        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for kind, obj in initial:
            await resp.write(_line(kind, obj))
        if query.send_initial_events and query.allow_bookmarks:
            await resp.write(_line("BOOKMARK", _bookmark(resource, last_rv, initial_end=True)))

        timeout = query.timeout_s if query.timeout_s else settings.default_timeout_s
        deadline = loop.time() + timeout
        next_bookmark = loop.time() + settings.bookmark_interval_s
        while True:
            now = loop.time()
            if now >= deadline:
                break
            wake = min(deadline, now + 1.0)
            if query.allow_bookmarks:
                wake = min(wake, next_bookmark)
            try:
                message: object = await asyncio.wait_for(queue.get(), max(wake - now, 0.0))
            except TimeoutError:
                message = None
            if request.transport is None or request.transport.is_closing():
                return resp  # the client left
            if isinstance(message, Drop):
                if message.abrupt:
                    request.transport.abort()  # no last chunk: the client sees a cut stream
                    return resp
                break
            if isinstance(message, Change):
                if message.rv <= last_rv:
                    continue
                last_rv = message.rv
                if message.resource == resource.name:
                    event = watch_event(message, query)
                    if event is not None:
                        await resp.write(_line(*event))
                continue
            due = query.allow_bookmarks and loop.time() >= next_bookmark
            if due or (isinstance(message, BookmarkNow) and query.allow_bookmarks):
                # last_rv: every change up to it has been looked at and sent when it matched.
                await resp.write(_line("BOOKMARK", _bookmark(resource, last_rv)))
                next_bookmark = loop.time() + settings.bookmark_interval_s
        await resp.write_eof()
        return resp
    except ConnectionError:  # the client went away mid-write
        return resp
    finally:
        store.unsubscribe(queue)


async def _error_stream(request: web.Request, body: Obj) -> web.StreamResponse:
    """A watch that fails after it was accepted: HTTP 200, one ERROR event, the end."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    await resp.write(_line("ERROR", body))
    await resp.write_eof()
    return resp
