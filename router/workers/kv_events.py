"""The engines' KV events, subscribed per worker: each worker's `KvIndex` kept equal to its cache.

    worker's PUB ──(topic, seq, EventBatch)──> KvEventSubscriber ──> KvIndex (router/workers/
    worker's ROUTER <──replay from seq── (on a gap)                   kv_index.py)
                                                    KvEventHub: one subscriber per worker with a
                                                    `kv_events` entry, following the membership

The wire format is router/workers/kv_wire.py's (vLLM 0.32). Sequence numbers decide:

- the next expected one: apply the batch;
- a higher one (batches lost: the PUB drops past its high-water mark, a slow joiner): ask the
  replay socket for the missing ones; when it answers with all of them, apply them, then this
  one. When it cannot (no replay endpoint, a timeout, its buffer no longer reaches back), the
  index is dropped and rebuilt from what comes next (`kv_events_index_drops{reason="gap"}`):
  a subset of the cache, never blocks the worker no longer holds;
- a lower one: the publisher restarted (its counter began again at 0, and a new engine process
  has an empty cache): the index is cleared, and batches of the new process that came before
  this one are asked of the replay socket.

On each connection (a socket monitor tells) the subscriber asks the replay socket again: at the
first, for everything from 0 (a router started after its engines learns what they already hold,
up to the publisher's buffer); on a reconnection, from the last batch it applied: the same batch
back (compared by digest) is the same publisher, and what followed is applied; anything else is a
new publisher process (restarted between two batches, its counter possibly already past ours),
and its batches are taken from 0. The SUB's copies of replayed batches are skipped.

A hostile or broken engine (issue 31): what its socket says is bounded in memory and in loop
time (router/workers/kv_limits.py): the index by what the worker can hold, a batch by what an
engine step can store, what ZeroMQ queues for us; a batch is applied in steps that give the
loop a turn every 2 ms (router/workers/kv_batches.py). A refused batch drops the index.

Replicas: every router replica subscribes on its own; the index is not shared through the store.
An index per replica costs memory (docs/kv-events.md: bytes per block), not store round trips on
the request path; the events are per worker, small and published to any number of subscribers
by ZeroMQ itself, and a replica's index is fresh the moment the event arrives, where a shared one
would be a store write per event and a read per placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Literal

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.loop_timing import beat
from router.metrics import RouterMetrics
from router.worker_spec import KvEventsSpec
from router.workers.kv_batches import BatchApplier
from router.workers.kv_index import KvIndex
from router.workers.kv_limits import (
    MAX_BATCH_BLOCKS,
    MAX_BATCH_BYTES,
    MAX_INDEX_BLOCKS,
    REPLAY_MAX_BYTES,
    SUB_QUEUE,
    WIRE_MAX_FACTOR,
    Refusals,
    capacity_bound,
)
from router.workers.kv_wire import END_SEQ, WireError, decode_seq, encode_seq
from router.workers.membership import Membership

__all__ = ["KvEventHub", "KvEventSubscriber"]

log = logging.getLogger(__name__)

State = Literal["connecting", "synced", "rebuilding"]


class KvEventSubscriber:
    """One worker's events into its index. `state`: "connecting" (nothing known yet),
    "synced" (every batch since the publisher's first applied), "rebuilding" (batches were
    lost for good: the index holds what came since)."""

    def __init__(
        self,
        worker_id: str,
        spec: KvEventsSpec,
        ctx: zmq.asyncio.Context,
        metrics: RouterMetrics,
        *,
        replay_timeout_s: float = 2.0,
        max_blocks: int = MAX_INDEX_BLOCKS,
        bound: Callable[[int | None], int] | None = None,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        max_batch_blocks: int = MAX_BATCH_BLOCKS,
        rank: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.spec = spec
        self.index = KvIndex(max_blocks)
        # The index's bound for an engine block size (None: not known yet); read per event,
        # since the worker's reported capacity and block size may come later.
        self._bound = bound or (lambda _bs: max_blocks)
        self._max_batch_bytes = max_batch_bytes
        self._refusals = Refusals(worker_id, metrics)
        self._batches = BatchApplier(
            worker_id,
            self.index,
            metrics,
            self._refusals,
            self._bound,
            max_batch_bytes=max_batch_bytes,
            max_batch_blocks=max_batch_blocks,
            rank=rank,
        )
        self.state: State = "connecting"
        self._ctx = ctx
        self._metrics = metrics
        self._replay_timeout_s = replay_timeout_s
        self._next: int | None = None  # the next sequence number to apply
        self._dup_until = -1  # SUB copies up to here were applied from a replay
        self._last_digest = 0

    def __repr__(self) -> str:
        return f"KvEventSubscriber({self.worker_id}, {self.state}, next={self._next}, {self.index})"

    def describe(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "blocks": len(self.index),
            "next_seq": self._next,
            "unchained_blocks": self.index.unchained,
            "block_size": self.index.block_size,
            "max_blocks": self._bound(self.index.block_size),
            "foreign_rank": self._batches.foreign_rank,
        }

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        self._limit_socket(sub)
        # Each (re)connection is a moment batches may have been missed, or the publisher may be
        # a new process: the monitor says when, and `_resync` asks the replay socket.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
            sub.connect(self.spec.endpoint)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_CONNECTED:
                        await self._resync()
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        self._reconnect(sub)
                if sub in ready:
                    await self.on_message(await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _resync(self) -> None:
        """On a (re)connection. After batches were applied, a replay from the last one tells a
        publisher that went on (that batch comes back first, the same bytes: apply what followed
        it) from a new process (it does not: clear the index). Then, for a new process or at
        the first connection, the publisher's buffer from 0."""
        if self._next:
            got = await self._replay_from(self._next - 1)
            if got is None:
                return  # no replay socket: a counter that goes back tells a restart
            if got and got[0][0] == self._next - 1 and hash(got[0][1]) == self._last_digest:
                await self._apply_run(got[1:], "reconnect")
                return
            log.info(
                "worker %s: a new KV-event publisher (its replay does not hold seq %d)",
                self.worker_id,
                self._next - 1,
            )
            self._restarted()
        got = await self._replay_from(0)
        if got is None:
            return  # no replay socket: the first batch decides
        if got and got[0][0] != 0:
            self._drop("start")  # the buffer no longer reaches back to the first batch
            self._next = got[0][0]
        await self._apply_run(got, "start")
        if self.state == "connecting":
            self.state = "synced"
            if self._next is None:
                self._next = 0

    async def _apply_run(self, got: list[tuple[int, bytes]], why: str) -> None:
        """Replayed batches from the next expected on; the SUB's copies of them are skipped."""
        for seq, payload in got:
            if self._next is not None and seq < self._next:
                continue  # applied already (from the SUB, while the replay was on its way)
            if self._next is not None and seq > self._next:
                self._drop(why)  # a hole in the replay itself
            await self._apply(seq, payload)
        if got:
            self._dup_until = max(self._dup_until, got[-1][0])

    def _restarted(self) -> None:
        """A new publisher process: a new, empty cache, its counter from 0."""
        self.index.clear()
        self._metrics.kv_events_index_drops.labels(worker=self.worker_id, reason="restart").inc()
        self._next = 0
        self._dup_until = -1
        self.state = "synced"

    async def on_message(self, frames: list[bytes]) -> None:
        m = self._metrics
        if len(frames) != 3:
            m.kv_events_malformed.labels(worker=self.worker_id).inc()
            return
        try:
            seq = decode_seq(frames[1])
        except WireError:
            m.kv_events_malformed.labels(worker=self.worker_id).inc()
            return
        if self._dup_until >= 0:
            if seq <= self._dup_until and (self._next is None or seq < self._next):
                return  # applied already, from a replay
            self._dup_until = -1
        if self._next is not None and seq < self._next:
            # The counter went back: a new publisher process, with a new, empty cache.
            log.info(
                "worker %s: KV-event publisher restarted (seq %d < %d)",
                self.worker_id,
                seq,
                self._next,
            )
            self._restarted()
        expected = 0 if self._next is None else self._next
        if seq > expected:
            m.kv_events_gaps.labels(worker=self.worker_id).inc()
            await self._recover(expected, seq)
        elif self.state == "connecting":
            self.state = "synced"
        await self._apply(seq, frames[2])

    async def _recover(self, start: int, upto: int) -> None:
        """Batches start..upto-1 from the replay socket, or the index dropped."""
        got = await self._replay_from(start)
        wanted = [(s, p) for s, p in got or () if s < upto]
        if got is not None and [s for s, _ in wanted] == list(range(start, upto)):
            self._metrics.kv_events_replays.labels(worker=self.worker_id, outcome="ok").inc()
            for seq, payload in wanted:
                await self._apply(seq, payload)
            if self.state == "connecting":
                self.state = "synced"
            return
        self._metrics.kv_events_replays.labels(worker=self.worker_id, outcome="failed").inc()
        log.warning(
            "worker %s: KV-event batches %d..%d lost; its index is rebuilt from now",
            self.worker_id,
            start,
            upto - 1,
        )
        self._drop("gap")

    def _drop(self, reason: str) -> None:
        self.index.clear()
        self.state = "rebuilding"
        self._metrics.kv_events_index_drops.labels(worker=self.worker_id, reason=reason).inc()

    async def _replay_from(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every batch the publisher still buffers from `start` on, in order; None when there
        is no replay socket or it did not answer in time."""
        if self.spec.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        self._limit_socket(dealer)
        out: list[tuple[int, bytes]] = []
        budget = REPLAY_MAX_BYTES
        try:
            dealer.connect(self.spec.replay_endpoint)
            await dealer.send_multipart([b"", encode_seq(start)])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self._replay_timeout_s)
                # vLLM 0.32 (`_service_replay`): behind the envelope's empty delimiter, each
                # batch as its PUB sent it (topic, seq, payload), then (b"", END_SEQ, b"").
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 3:
                    return None
                seq = decode_seq(frames[1])
                if seq == END_SEQ:
                    return out
                budget -= len(frames[2])
                if budget < 0:  # more than a publisher's buffer of honest batches holds
                    self._refusals.refuse("replay_bytes", f"a replay over {REPLAY_MAX_BYTES} bytes")
                    return None
                out.append((seq, frames[2]))
        except (TimeoutError, WireError, zmq.ZMQError) as exc:
            log.info("worker %s: replay from %d failed: %r", self.worker_id, start, exc)
            return None
        finally:
            dealer.close(linger=0)

    def _reconnect(self, sub: zmq.asyncio.Socket) -> None:
        """ZeroMQ reconnects by itself after a connection error, but never after a protocol
        error, which a message over MAXMSGSIZE is: connect again (the connection's monitor
        then resyncs; what was lost meanwhile is a gap)."""
        with contextlib.suppress(zmq.ZMQError):  # already gone with its session
            sub.disconnect(self.spec.endpoint)
        sub.connect(self.spec.endpoint)

    def _limit_socket(self, socket: zmq.asyncio.Socket) -> None:
        """What ZeroMQ itself holds for us before a batch is read: at most `SUB_QUEUE`
        messages, none over `WIRE_MAX_FACTOR` x the batch limit (ZeroMQ drops the connection on
        a larger one: it would sit whole in our memory before we could refuse it)."""
        socket.setsockopt(zmq.RCVHWM, SUB_QUEUE)
        socket.setsockopt(zmq.MAXMSGSIZE, WIRE_MAX_FACTOR * self._max_batch_bytes)

    async def _apply(self, seq: int, payload: bytes) -> None:
        self._next = seq + 1
        # To know this publisher again after a reconnection (the replay sends the same bytes);
        # an oversized payload by its length and ends, not 10 ms of hashing for a refusal.
        self._last_digest = (
            hash(payload)
            if len(payload) <= self._max_batch_bytes
            else hash((len(payload), payload[:4096], payload[-4096:]))
        )
        dropped = await self._batches.apply(payload)
        if dropped is not None:
            self._drop(dropped)
        await self._batches.release()

    @property
    def batches(self) -> int:
        """Batches applied."""
        return self._batches.applied


class KvEventHub:
    """A subscriber for every worker whose entry has `kv_events`, following the membership
    (workers registered or removed at run time included); `index_of` is placement's lookup."""

    def __init__(
        self,
        members: Membership,
        metrics: RouterMetrics,
        *,
        reconcile_s: float = 1.0,
        max_blocks: int = MAX_INDEX_BLOCKS,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        max_batch_blocks: int = MAX_BATCH_BLOCKS,
    ) -> None:
        self._members = members
        self._metrics = metrics
        self._reconcile_s = reconcile_s
        self._max_blocks = max_blocks
        self._max_batch_bytes = max_batch_bytes
        self._max_batch_blocks = max_batch_blocks
        self._ctx = zmq.asyncio.Context()
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __repr__(self) -> str:
        return f"KvEventHub({sorted(self.subscribers)})"

    def _bound_of(self, wid: str) -> Callable[[int | None], int]:
        def bound(engine_block_size: int | None) -> int:
            worker = self._members.workers.get(wid)
            return capacity_bound(worker, engine_block_size, self._max_blocks)

        return bound

    def index_of(self, worker_id: str) -> KvIndex | None:
        """The worker's index when its events are being applied; None: no events (estimated)."""
        sub = self.subscribers.get(worker_id)
        if sub is None or sub.state == "connecting":
            return None
        return sub.index

    def describe(self, worker_id: str) -> dict[str, Any]:
        """The admin view of a worker's prefix-cache knowledge."""
        sub = self.subscribers.get(worker_id)
        if sub is None or sub.state == "connecting":
            return {"source": "estimated", "kv_events": None if sub is None else sub.describe()}
        return {"source": "events", "kv_events": sub.describe()}

    def reconcile(self) -> None:
        """Start a subscriber for each worker with events, stop those of workers gone; restart
        one whose task ended (its failure was logged)."""
        # A data-parallel worker's ranks: each its own publisher (ports + rank), its own index.
        wanted = {
            wid: w.spec.kv_events
            for wid, w in self._members.workers.items()
            if w.spec.kv_events is not None
        }
        ranks = {wid: self._members.workers[wid].spec.dp_rank for wid in wanted}
        for wid in list(self.subscribers):
            task = self._tasks.get(wid)
            if wanted.get(wid) != self.subscribers[wid].spec or task is None or task.done():
                self._stop(wid)
        for wid, spec in wanted.items():
            if wid not in self.subscribers:
                sub = KvEventSubscriber(
                    wid,
                    spec,
                    self._ctx,
                    self._metrics,
                    max_blocks=self._max_blocks,
                    bound=self._bound_of(wid),
                    max_batch_bytes=self._max_batch_bytes,
                    max_batch_blocks=self._max_batch_blocks,
                    rank=ranks[wid],
                )
                self.subscribers[wid] = sub
                self._tasks[wid] = asyncio.get_running_loop().create_task(
                    self._guarded(sub), name=f"kv-events-{wid}"
                )

    async def _guarded(self, sub: KvEventSubscriber) -> None:
        try:
            await sub.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker %s: the KV-event subscriber failed; it restarts", sub.worker_id)

    def _stop(self, wid: str) -> None:
        self.subscribers.pop(wid, None)
        task = self._tasks.pop(wid, None)
        if task is not None:
            task.cancel()
        self._metrics.kv_events_index_blocks.labels(worker=wid).set(0)

    async def run(self) -> None:
        joined = asyncio.Event()
        self._members.on_join(lambda spec: joined.set() if spec.kv_events is not None else None)
        while True:
            self.reconcile()
            if not self.subscribers:
                # No worker with KV events: nothing to reconcile, and no timer at all until
                # one joins, however it joins (an idle replica's wake-ups).
                joined.clear()
                await joined.wait()
                continue
            # On the pools' beat (router/loop_timing.py): an idle replica's wake-up is shared
            # with its other loops', not one more of its own every second.
            await beat(self._reconcile_s)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for wid in list(self.subscribers):
            self._stop(wid)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ctx.term()
