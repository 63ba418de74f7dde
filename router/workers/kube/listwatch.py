"""List + watch of one kind of object (pods or EndpointSlices) by label selector, as the
Kubernetes API documents it (https://kubernetes.io/docs/reference/using-api/api-concepts/):

* **List**, in pages (`limit` + `continue`), then **watch** from the list's `resourceVersion`
  with `allowWatchBookmarks`: each ADDED/MODIFIED/DELETED moves the version forward, and so
  does each BOOKMARK, so a watch resumed after a quiet hour starts from a recent version.
* A watch the server ends (its `timeoutSeconds`) or whose connection is cut mid-chunk
  (`aiohttp.ClientPayloadError`: kubernetes_asyncio does not catch it) is **resumed from the
  last version seen**: nothing is missed, nothing is re-listed.
* **410 Gone** (an `ERROR` event with code 410 in the stream, or a 410 answer: the version is
  older than the server's history, after a compaction) -> a fresh **re-list**; the sink gets
  the whole set again and works out what changed while the watch was away.
* Any other API error (429, 500, a connection refused) -> **back-off with jitter**, doubling
  from `backoff_s` up to `backoff_max_s` (a 429's Retry-After is honoured when longer), reset by
  the next list or watch that works.

The objects are handled as JSON (orjson), not as the client library's model classes: a
thousand pods re-listed are parsed in milliseconds instead of deserialized field by field.
kubernetes_asyncio builds and authenticates each request (`_preload_content=False`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

__all__ = ["Backoff", "Gone", "ListWatch", "Sink", "WatchStats"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
# (label selector, extra keyword arguments) -> the API's aiohttp response, unread
ApiCall = Callable[..., Awaitable[aiohttp.ClientResponse]]

_PAGE = 500  # objects per list page


class Gone(Exception):
    """The watched version is too old for the server (410): list again."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.retry_after_s = retry_after_s


class Sink(Protocol):
    """What the list-watch feeds: the whole set after a list, then each change."""

    def replace(self, objects: list[Obj]) -> None: ...

    def apply(self, kind: str, obj: Obj) -> None: ...


@dataclass
class WatchStats:
    """Counts a test or an operator reads (logged at INFO on each re-list)."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    bookmarks: int = 0
    gone: int = 0
    cut: int = 0
    errors: int = 0
    resource_version: str = ""
    listed: asyncio.Event = field(default_factory=asyncio.Event)


class Backoff:
    """Waits after failures: `first` doubling up to `most`, each with full jitter in its upper
    half (many replicas failing at once do not retry in step)."""

    def __init__(self, first: float, most: float, rand: Callable[[], float] = random.random):
        self.first, self.most, self._rand = first, most, rand
        self._next = first

    def reset(self) -> None:
        self._next = self.first

    def delay(self, at_least: float | None = None) -> float:
        base = self._next
        self._next = min(self.most, self._next * 2)
        wait = base * (0.5 + 0.5 * self._rand())
        return max(wait, min(at_least or 0.0, self.most))


class ListWatch:
    def __init__(
        self,
        name: str,
        call: ApiCall,
        selector: str,
        sink: Sink,
        backoff: Backoff,
        timeout_s: int,
    ) -> None:
        """`call(label_selector=..., **kw)`: the API's list function for one namespace (pods
        or EndpointSlices), with `_preload_content=False`."""
        self.name = name
        self._call = call
        self._selector = selector
        self._sink = sink
        self._backoff = backoff
        self._timeout_s = timeout_s
        self.stats = WatchStats()

    def __repr__(self) -> str:
        return f"ListWatch({self.name} {self._selector!r} at {self.stats.resource_version!r})"

    async def run(self) -> None:
        """List, then watch for ever, as the module says."""
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._list()
                    self._backoff.reset()
                version = await self._watch(version)
            except Gone:
                self.stats.gone += 1
                log.info("%s: watch expired at %s (410): listing again", self.name, version)
                version = None
            except aiohttp.ClientPayloadError as exc:
                # A cut stream: resume from the last version seen, at once the first time.
                self.stats.cut += 1
                log.info("%s: watch cut (%s): resuming from %s", self.name, exc, version)
                await self._pause_if_repeated()
            except ApiError as exc:
                self.stats.errors += 1
                wait = self._backoff.delay(exc.retry_after_s)
                log.warning("%s: API error %s; again in %.1f s", self.name, exc, wait)
                await asyncio.sleep(wait)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self.stats.errors += 1
                wait = self._backoff.delay()
                log.warning("%s: %r; again in %.1f s", self.name, exc, wait)
                await asyncio.sleep(wait)

    async def _pause_if_repeated(self) -> None:
        """A cut right after a cut (the server keeps dropping us) waits as an error does."""
        if self.stats.cut > 1 and self._cut_streak:
            await asyncio.sleep(self._backoff.delay())
        self._cut_streak = True

    _cut_streak = False

    async def _request(self, **kw: Any) -> aiohttp.ClientResponse:
        resp = await _call_api(self._call, label_selector=self._selector, **kw)
        if resp.status != 200:
            body = await resp.read()
            resp.release()
            message = _status_message(body)
            if resp.status == 410:
                raise Gone(message)
            retry = resp.headers.get("Retry-After", "")
            raise ApiError(resp.status, message, float(retry) if retry.isdigit() else None)
        return resp

    async def _list(self) -> str:
        """Every object (page by page, all pinned to the first page's version); the sink gets
        them as one set. Returns the version to watch from."""
        items: list[Obj] = []
        token: str | None = None
        version = ""
        while True:
            kw: dict[str, Any] = {"limit": _PAGE}
            if token:
                kw["_continue"] = token
            resp = await self._request(**kw)
            async with resp:
                doc = orjson.loads(await resp.read())
            items.extend(doc.get("items") or [])
            meta = doc.get("metadata") or {}
            version = version or str(meta.get("resourceVersion", ""))
            token = meta.get("continue") or None
            if not token:
                break
        self.stats.lists += 1
        self.stats.resource_version = version
        self._sink.replace(items)
        self.stats.listed.set()
        log.info("%s: listed %d at version %s", self.name, len(items), version)
        return version

    async def _watch(self, version: str) -> str:
        """One watch from `version` until the server ends it; the last version seen."""
        resp = await self._request(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._timeout_s,
            # A connection silent for longer than the server's own timeout is dead.
            _request_timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10, sock_read=self._timeout_s + 30
            ),
        )
        self.stats.watches += 1
        async with resp:
            async for line in _lines(resp):
                version = self._event(line, version)
                self._backoff.reset()
                self._cut_streak = False
        return version

    def _event(self, line: bytes, version: str) -> str:
        event = orjson.loads(line)
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise Gone(str(obj.get("message", "")))
            raise ApiError(int(code or 500), str(obj.get("message", "")))
        new = str((obj.get("metadata") or {}).get("resourceVersion") or version)
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
        elif kind in ("ADDED", "MODIFIED", "DELETED"):
            self.stats.events += 1
            self._sink.apply(kind, obj)
        self.stats.resource_version = new
        return new


async def _call_api(call: ApiCall, **kw: Any) -> aiohttp.ClientResponse:
    """The client library raises ApiException for a non-2xx answer even unread: map it to
    ours (410 -> Gone), so the loop has one vocabulary."""
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        return await call(_preload_content=False, **kw)
    except ApiException as exc:
        body = exc.body or b""
        message = _status_message(body.encode() if isinstance(body, str) else body)
        if exc.status == 410:
            raise Gone(message) from exc
        headers: Any = exc.headers or {}
        retry = headers.get("Retry-After", "")
        raise ApiError(
            int(exc.status or 500), message, float(retry) if str(retry).isdigit() else None
        ) from exc


async def _lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The stream's JSON lines, however the chunks fall (a pod may be larger than aiohttp's
    line limit)."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line, buffer = buffer[:end], buffer[end + 1 :]
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


def _status_message(body: bytes) -> str:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode(errors="replace")
    return str(doc.get("message", doc)) if isinstance(doc, dict) else str(doc)
