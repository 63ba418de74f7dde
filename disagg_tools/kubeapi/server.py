"""The stand-in API server and its control surface for tests and the simulator.

    async with running_kubeapi() as api:          # an ephemeral loopback port
        api.add_pod("decode-0", labels={"role": "decode"}, ports={"http": 8000})
        api.set_ready("decode-0", False)          # MODIFIED: Ready=False
        api.terminate_pod("decode-0")             # MODIFIED: deletionTimestamp set
        api.delete_pod("decode-0")                # DELETED
        api.drop_watches()                        # every open watch cut mid-stream
        api.compact()                             # the next watch from an old version: 410
        api.fail_next(3, status=429)              # the next 3 requests fail
        api.slow(0.5)                             # every response waits 0.5 s first

Everything runs on the caller's event loop; the control calls are synchronous and take effect
before they return (a watch sees the change at its next wake-up).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .app import ApiState, make_app
from .objects import ENDPOINT_SLICES, PODS, PodSpec, endpoint_slice_object, now_rfc3339, pod_object
from .objects import set_ready as with_ready
from .store import NotFound, Store
from .watch import BookmarkNow, Drop, WatchSettings

__all__ = ["KubeApiServer", "KubeApiSettings", "running_kubeapi"]

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class KubeApiSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port, read back from `url`
    history_size: int = 1000  # changes kept for watches and exact lists (then 410 Gone)
    watch: WatchSettings = field(default_factory=WatchSettings)


class KubeApiServer:
    def __init__(self, settings: KubeApiSettings | None = None) -> None:
        self.settings = settings or KubeApiSettings()
        self.store = Store(self.settings.history_size)
        self.state = ApiState(self.store, self.settings.watch)
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._ips = (f"10.0.{i // 250}.{i % 250 + 1}" for i in itertools.count())

    # ── life ─────────────────────────────────────────────────────────────────────────────────

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self._port}"

    async def start(self) -> None:
        app = make_app(self.state, lambda: f"{self.settings.host}:{self._port}")
        # handler_cancellation: a watch whose client left ends at once (it would otherwise
        # linger until its next write), so `open_watches` counts the live ones.
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        server = site._server  # the bound port, when 0 was asked for
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self._port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def stop(self) -> None:
        self.drop_watches(abrupt=False)  # let every watch end its stream before the cleanup
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ── pods ─────────────────────────────────────────────────────────────────────────────────

    def add_pod(
        self,
        name: str,
        *,
        namespace: str = "default",
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        ports: Mapping[str, int] | None = None,
        phase: str = "Running",
        ready: bool = True,
        pod_ip: str | None = None,
    ) -> Obj:
        """A new pod (ADDED); `pod_ip` defaults to the next free 10.0.x.y."""
        spec = PodSpec(
            name,
            namespace,
            labels or {},
            annotations or {},
            ports or {},
            phase,
            ready,
            pod_ip if pod_ip is not None else next(self._ips),
        )
        return self.store.create(PODS.name, pod_object(spec))

    def pod(self, name: str, namespace: str = "default") -> Obj:
        return self.store.get(PODS.name, namespace, name)

    def update_pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        phase: str | None = None,
        pod_ip: str | None = None,
    ) -> Obj:
        """Replace what is given (MODIFIED): labels and annotations whole, phase, podIP."""
        pod = self.pod(name, namespace)
        if labels is not None:
            pod["metadata"]["labels"] = dict(labels)
        if annotations is not None:
            pod["metadata"]["annotations"] = dict(annotations)
        if phase is not None:
            pod["status"]["phase"] = phase
        if pod_ip is not None:
            pod["status"]["podIP"] = pod_ip
            pod["status"]["podIPs"] = [{"ip": pod_ip}]
        return self.store.replace(PODS.name, pod)

    def set_ready(self, name: str, ready: bool, namespace: str = "default") -> Obj:
        """The Ready condition flips (MODIFIED), as the kubelet's readiness probe does."""
        return self.store.replace(PODS.name, with_ready(self.pod(name, namespace), ready))

    def terminate_pod(self, name: str, namespace: str = "default", grace_s: int = 30) -> Obj:
        """The pod turns Terminating (MODIFIED with deletionTimestamp and
        deletionGracePeriodSeconds), as a graceful delete starts; `delete_pod` finishes it."""
        pod = self.pod(name, namespace)
        pod["metadata"]["deletionTimestamp"] = now_rfc3339()
        pod["metadata"]["deletionGracePeriodSeconds"] = grace_s
        return self.store.replace(PODS.name, pod)

    def delete_pod(self, name: str, namespace: str = "default") -> Obj:
        """The pod is gone (DELETED)."""
        return self.store.delete(PODS.name, namespace, name)

    def replace_pod(self, pod: Obj) -> Obj:
        """Write a whole Pod document over the stored one (MODIFIED)."""
        return self.store.replace(PODS.name, copy.deepcopy(pod))

    # ── endpoint slices ──────────────────────────────────────────────────────────────────────

    def put_endpoint_slice(
        self,
        name: str,
        *,
        service: str,
        endpoints: list[Obj],
        ports: Mapping[str, int],
        namespace: str = "default",
    ) -> Obj:
        """Create or replace an EndpointSlice of `service` (ADDED or MODIFIED)."""
        obj = endpoint_slice_object(
            name, service=service, namespace=namespace, endpoints=endpoints, ports=ports
        )
        try:
            self.store.get(ENDPOINT_SLICES.name, namespace, name)
        except NotFound:
            return self.store.create(ENDPOINT_SLICES.name, obj)
        return self.store.replace(ENDPOINT_SLICES.name, obj)

    def delete_endpoint_slice(self, name: str, namespace: str = "default") -> Obj:
        return self.store.delete(ENDPOINT_SLICES.name, namespace, name)

    # ── faults ───────────────────────────────────────────────────────────────────────────────

    @property
    def open_watches(self) -> int:
        return self.store.subscriber_count

    async def watching(self, count: int = 1, within_s: float = 10.0) -> None:
        """Until at least `count` watches are open (TimeoutError after `within_s`)."""
        await self.store.wait_subscribers(count, within_s)

    def drop_watches(self, abrupt: bool = True) -> int:
        """End every open watch now: `abrupt` closes the connection mid-stream (no last
        chunk), else the stream ends as a server-side timeout ends it. Returns how many."""
        count = self.store.subscriber_count
        self.store.notify_all(Drop(abrupt=abrupt))
        return count

    def compact(self) -> None:
        """Forget the history: a watch or exact list from any earlier version gets 410."""
        self.store.compact()

    def bookmark_now(self) -> None:
        """A BOOKMARK on every watch that allows them, now."""
        self.store.notify_all(BookmarkNow())

    def fail_next(self, count: int, status: int = 500) -> None:
        """The next `count` API requests fail with `status` (500 or 429)."""
        self.state.faults.fail_next, self.state.faults.fail_status = count, status

    def slow(self, delay_s: float) -> None:
        """Every API response waits `delay_s` first (0: none)."""
        self.state.faults.delay_s = delay_s

    @property
    def requests(self) -> list[str]:
        """Every API request so far, "METHOD /path?query", oldest first."""
        return list(self.state.requests)


@asynccontextmanager
async def running_kubeapi(settings: KubeApiSettings | None = None) -> AsyncIterator[KubeApiServer]:
    server = KubeApiServer(settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
