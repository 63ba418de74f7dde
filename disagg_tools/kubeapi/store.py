"""The stand-in's storage: objects, one resourceVersion counter, a bounded history of changes.

Like etcd under a real API server, one counter orders every change of every resource: each write
takes the next resourceVersion, stamps it on the object, and appends a `Change` to the history.
The history keeps `history_size` changes (a setting) or fewer after `compact()`; a watch or an
exact list from a resourceVersion older than what it keeps is answered 410 Gone (reason
Expired), as the watch cache answers: expired when `rv < oldest kept - 1`.

Everything here is synchronous and runs on the server's event loop, so a watch that subscribes
and reads the history in one step misses nothing and sees nothing twice.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .objects import now_rfc3339

__all__ = ["AlreadyExists", "Change", "Expired", "NotFound", "Store"]

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name)


class Expired(Exception):
    """The resourceVersion asked for is older than the kept history (410 Gone, Expired)."""


class NotFound(KeyError):
    pass


class AlreadyExists(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Change:
    """One write: the object after it (None: deleted) and before it (None: created)."""

    rv: int
    resource: str
    key: Key
    obj: Obj | None
    prev: Obj | None


def key_of(obj: Obj) -> Key:
    meta = obj["metadata"]
    return (str(meta.get("namespace", "default")), str(meta["name"]))


class Store:
    FIRST_RV = 100  # not 0 or 1: "0" means "any version" to the API, and small numbers hide bugs

    def __init__(self, history_size: int = 1000) -> None:
        if history_size < 1:
            raise ValueError("history_size must be at least 1")
        self.rv = self.FIRST_RV
        self._objects: dict[str, dict[Key, Obj]] = {}
        self._history: deque[Change] = deque(maxlen=history_size)
        self._subscribers: set[asyncio.Queue[object]] = set()
        self._advanced = asyncio.Event()
        self._subscribed = asyncio.Event()

    # ── reads ────────────────────────────────────────────────────────────────────────────────

    def get(self, resource: str, namespace: str, name: str) -> Obj:
        try:
            return copy.deepcopy(self._objects.get(resource, {})[(namespace, name)])
        except KeyError:
            raise NotFound(name) from None

    def items(self, resource: str) -> dict[Key, Obj]:
        """The current objects of `resource` (the store's own dicts: do not change them)."""
        return self._objects.get(resource, {})

    @property
    def oldest_kept(self) -> int:
        """The resourceVersion of the oldest change still in the history (the next one when the
        history is empty)."""
        return self._history[0].rv if self._history else self.rv + 1

    def is_expired(self, rv: int) -> bool:
        return rv < self.oldest_kept - 1

    def changes_since(self, rv: int) -> list[Change]:
        """Every change after `rv`, oldest first; `Expired` when some of them are forgotten."""
        if self.is_expired(rv):
            raise Expired(f"too old resource version: {rv} ({self.oldest_kept - 1})")
        return [c for c in self._history if c.rv > rv]

    def snapshot_at(self, resource: str, rv: int) -> dict[Key, Obj]:
        """The objects of `resource` as they were at `rv` (the current ones undone change by
        change); `Expired` when the history no longer reaches back to `rv`."""
        if self.is_expired(rv):
            raise Expired("The resourceVersion for the provided list is too old.")
        state = dict(self.items(resource))
        for change in reversed(self._history):
            if change.rv <= rv:
                break
            if change.resource != resource:
                continue
            if change.prev is None:
                state.pop(change.key, None)
            else:
                state[change.key] = change.prev
        return state

    async def wait_for(self, rv: int, within_s: float) -> bool:
        """Whether the store reaches `rv` within `within_s` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while self.rv < rv:
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._advanced.clear()
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except TimeoutError:
                return self.rv >= rv
        return True

    # ── subscriptions ────────────────────────────────────────────────────────────────────────

    def subscribe(self) -> asyncio.Queue[object]:
        """A queue that receives every later `Change` (and whatever `notify_all` sends)."""
        q: asyncio.Queue[object] = asyncio.Queue()
        self._subscribers.add(q)
        self._subscribed.set()
        return q

    async def wait_subscribers(self, count: int, within_s: float) -> None:
        """Until at least `count` queues are subscribed (TimeoutError after `within_s`)."""
        async with asyncio.timeout(within_s):
            while len(self._subscribers) < count:
                self._subscribed.clear()
                await self._subscribed.wait()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def unsubscribe(self, q: asyncio.Queue[object]) -> None:
        self._subscribers.discard(q)

    def notify_all(self, message: object) -> None:
        for q in self._subscribers:
            q.put_nowait(message)

    # ── writes ───────────────────────────────────────────────────────────────────────────────

    def _commit(self, resource: str, key: Key, obj: Obj | None, prev: Obj | None) -> Change:
        self.rv += 1
        objects = self._objects.setdefault(resource, {})
        if obj is None:
            objects.pop(key, None)
        else:
            obj["metadata"]["resourceVersion"] = str(self.rv)
            objects[key] = obj
        change = Change(self.rv, resource, key, obj, prev)
        self._history.append(change)
        self.notify_all(change)
        self._advanced.set()
        return change

    def create(self, resource: str, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        key = key_of(obj)
        if key in self.items(resource):
            raise AlreadyExists(f'{resource} "{key[1]}" already exists')
        meta = obj["metadata"]
        meta.setdefault("namespace", key[0])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta.setdefault("generation", 1)
        return copy.deepcopy(self._commit(resource, key, obj, None).obj)  # type: ignore[arg-type]

    def replace(self, resource: str, obj: Obj) -> Obj:
        """Write `obj` over the stored object of the same name (uid and creation time kept)."""
        obj = copy.deepcopy(obj)
        key = key_of(obj)
        prev = self.items(resource).get(key)
        if prev is None:
            raise NotFound(key[1])
        for kept in ("uid", "creationTimestamp", "generation"):
            if kept in prev["metadata"]:
                obj["metadata"][kept] = prev["metadata"][kept]
        obj["metadata"].setdefault("namespace", key[0])
        return copy.deepcopy(self._commit(resource, key, obj, prev).obj)  # type: ignore[arg-type]

    def delete(self, resource: str, namespace: str, name: str) -> Obj:
        prev = self.items(resource).get((namespace, name))
        if prev is None:
            raise NotFound(name)
        change = self._commit(resource, (namespace, name), None, prev)
        gone = copy.deepcopy(prev)
        gone["metadata"]["resourceVersion"] = str(change.rv)
        return gone

    def compact(self) -> None:
        """Forget every change so far (etcd's compaction): a watch or an exact list from any
        earlier resourceVersion now gets 410 Gone."""
        self._history.clear()

    def load(self, resource: str, objects: Iterable[Obj]) -> None:
        for obj in objects:
            self.create(resource, obj)
