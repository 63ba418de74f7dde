"""Kubernetes discovery: the pods of each role's label selector become workers, through the
registry path an admin-registered worker takes (router/workers/registration.py).

    pod Ready (and not Terminating)     adopted: its layout read and checked, registered in the
                                        shared store, probed; in rotation when it answers
    pod NotReady or Terminating         drained: out of rotation on this replica at once (its
                                        `pod_ready`), the shared drain mark written; the streams
                                        on it finish
    pod Ready again                     undrained
    pod deleted (or no longer selected) unregistered; requests on it finish (router/workers/
                                        membership.py keeps it for them)
    pod's address, ports or labels      registered again (a changed registration replaces the
    changed                             worker on every replica, as an admin re-registration)

**Who writes the registry: every replica, idempotently** — not one replica holding a lease.
Every replica watches anyway: "no request to a pod after it turned NotReady plus one watch
delivery" needs each replica to act on its own watch, not on a leader's write read back a
registry refresh later, and with a lease a leader that dies leaves the registry stale for its
lease's life. The writes commute: a registration is a function of the pod (and of what its
engine reports of its layout, the same to every replica), a drain mark a function of its
readiness, a removal of its absence; each replica's watch delivers the same changes in the
same resourceVersion order, so the store ends where the last writer's view ends, which is the
API server's. A replica that lags writes an older state for the moment it lags (a pod another
replica just removed, registered again): the other replicas keep such a worker out of rotation
by their own watch (`Membership.pod_readiness`), and the lagging replica removes it when its
watch catches up. The cost: every replica opens one watch per role (the API server's watch
cache serves them; vllm-router's and SGLang's routers do the same per replica).

One discovery configuration per store key prefix: a replica removes registered workers of its
namespace whose pods it does not see (the ones left by a router that stopped while they went).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from router.config import Settings
from router.errors import InvalidRequest
from router.settings_groups import DiscoverySettings
from router.worker_spec import WorkerSpec
from router.workers.dp_ranks import parent_id
from router.workers.drain import set_drained
from router.workers.health_probe import HealthProber
from router.workers.kube.client import ApiCalls, open_api
from router.workers.kube.listwatch import Backoff, ListWatch
from router.workers.kube.pods import in_rotation, pod_key, registration
from router.workers.membership import Membership
from router.workers.registration import register_worker
from router.workers.worker_state import WorkerState
from state.base import StateStore, StoreError

__all__ = ["KubeDiscovery"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_ROLES = ("prefill", "decode", "both")
_RESYNC_S = 2.0  # a reconcile at least this often (another replica's lagging write undone)
_ADOPT_RETRY_S = 2.0  # an engine that did not tell its layout is asked again after this
_ADOPTING_AT_ONCE = 32


class _RoleSink:
    """One role's pods, as its list-watch delivers them."""

    def __init__(self, owner: KubeDiscovery, role: str) -> None:
        self._owner, self.role = owner, role
        self.pods: dict[str, Obj] = {}

    def replace(self, objects: list[Obj]) -> None:
        old, self.pods = self.pods, {pod_key(p): p for p in objects}
        self._owner.changed(set(old) | set(self.pods))

    def apply(self, kind: str, obj: Obj) -> None:
        name = pod_key(obj)
        if kind == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = obj
        self._owner.changed({name})


class _SliceSink:
    """The namespace's EndpointSlices (source `endpointslices`): which pods they call ready."""

    def __init__(self, owner: KubeDiscovery) -> None:
        self._owner = owner
        self.slices: dict[str, Obj] = {}
        self.ready: set[str] = set()

    def replace(self, objects: list[Obj]) -> None:
        self.slices = {pod_key(s): s for s in objects}
        self._recount()

    def apply(self, kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            self.slices.pop(pod_key(obj), None)
        else:
            self.slices[pod_key(obj)] = obj
        self._recount()

    def _recount(self) -> None:
        old, ready = self.ready, set()
        for s in self.slices.values():
            for ep in s.get("endpoints") or []:
                ref, cond = ep.get("targetRef") or {}, ep.get("conditions") or {}
                if ref.get("kind") == "Pod" and cond.get("ready") is True:
                    if cond.get("terminating") is not True:
                        ready.add(str(ref.get("name")))
        self.ready = ready
        self._owner.changed(old ^ ready)


class KubeDiscovery:
    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        members: Membership,
        prober: HealthProber,
        api: Callable[[DiscoverySettings], Awaitable[ApiCalls]] = open_api,
    ) -> None:
        self._settings = settings
        self._d = settings.discovery
        self._store = store
        self._members = members
        self._prober = prober
        self._open_api = api
        self._roles = {role: _RoleSink(self, role) for role in self._d.selectors()}
        self._slices = _SliceSink(self) if self._d.source == "endpointslices" else None
        self.watches: list[ListWatch] = []
        self.namespace = ""
        self._dirty = asyncio.Event()
        self._known: dict[str, bytes] = {}  # id -> the registration last seen to match its pod
        # id -> (the pod's resourceVersion, its role, the worker's state object) last found to
        # match: an unchanged pod is not turned into a registration again at every resync
        # (with 1,000 pods that was most of an idle replica's discovery cost).
        self._fresh: dict[str, tuple[str, str, int]] = {}
        self._adopting: dict[str, asyncio.Task[None]] = {}
        self._retry_at: dict[str, float] = {}
        self._gate = asyncio.Semaphore(_ADOPTING_AT_ONCE)
        self._complained: set[str] = set()
        self.reconciles = 0
        members.pod_readiness = self._spec_ready

    def __repr__(self) -> str:
        return f"KubeDiscovery({self.namespace or self._d.namespace!r}, {self.watches!r})"

    # -- what the watches say -----------------------------------------------------------------
    def changed(self, names: set[str]) -> None:
        """Pods changed: their workers' place in rotation here follows at once; the shared
        registry on the next reconcile."""
        for name in names:
            for w in self._members.ranks_of(name):  # a data-parallel pod: each of its ranks
                if not w.spec.pod:
                    continue
                now = self._spec_ready(w.spec)
                if w.pod_ready != now:
                    log.info("pod %s %s", name, "ready" if now else "out of rotation")
                    w.pod_ready = now
        self._dirty.set()

    def _desired(self) -> dict[str, tuple[str, Obj]]:
        """Each selected pod by name with its role (the first role whose selector takes it)."""
        out: dict[str, tuple[str, Obj]] = {}
        for role in _ROLES:
            sink = self._roles.get(role)
            for name, pod in sink.pods.items() if sink else ():
                if name in out:
                    self._complain(name, f"pod {name} is selected as {out[name][0]} and {role}: "
                                         f"kept as {out[name][0]}")  # fmt: skip
                    continue
                out[name] = (role, pod)
        return out

    def _pod_in_rotation(self, name: str) -> bool:
        for sink in self._roles.values():
            pod = sink.pods.get(name)
            if pod is not None:
                ok = in_rotation(pod)
                return ok and (self._slices is None or name in self._slices.ready)
        return False

    def _spec_ready(self, spec: WorkerSpec) -> bool:
        """Membership's question as a discovered worker joins: is its pod in rotation? Until
        this replica's watches have listed (the API server slow or down at start-up), the
        shared registry and its drain marks are the best knowledge: trusted, not refused."""
        if not self.listed:
            return True
        name = parent_id(spec)  # a data-parallel pod's ranks are its pod's
        return spec.pod == f"{self.namespace}/{name}" and self._pod_in_rotation(name)

    def _complain(self, key: str, message: str) -> None:
        if key not in self._complained:
            self._complained.add(key)
            log.warning("kubernetes discovery: %s", message)

    # -- running ------------------------------------------------------------------------------
    async def run(self, session: aiohttp.ClientSession) -> None:
        api = await self._connect()
        self.namespace = api.namespace
        d = self._d
        try:
            for role, sink in self._roles.items():
                self.watches.append(self._list_watch(f"{role} pods", api.pods, sink, role))
            if self._slices is not None:
                self.watches.append(
                    self._list_watch("endpointslices", api.endpoint_slices, self._slices, "")
                )
            async with asyncio.TaskGroup() as group:
                for lw in self.watches:
                    group.create_task(lw.run(), name=f"kube-watch {lw.name}")
                group.create_task(self._reconcile_loop(session), name="kube-reconcile")
        finally:
            for task in self._adopting.values():
                task.cancel()
            await api.close()
            log.info("kubernetes discovery stopped (%s)", d.kind)

    def _list_watch(self, name: str, call: Any, sink: Any, role: str) -> ListWatch:
        d = self._d
        selector = getattr(d, f"{role}_selector").strip() if role else ""
        backoff = Backoff(d.backoff_s, d.backoff_max_s)
        return ListWatch(name, call, selector, sink, backoff, d.watch_timeout_s)

    async def _connect(self) -> ApiCalls:
        backoff = Backoff(self._d.backoff_s, self._d.backoff_max_s)
        while True:
            try:
                return await self._open_api(self._d)
            except Exception as exc:  # no configuration yet, a kubeconfig unreadable
                wait = backoff.delay()
                log.error("kubernetes discovery: no API client (%r); again in %.1f s", exc, wait)
                await asyncio.sleep(wait)

    @property
    def listed(self) -> bool:
        """Every watch has listed once: the pods not seen are gone, not unknown."""
        return bool(self.watches) and all(lw.stats.listed.is_set() for lw in self.watches)

    async def _reconcile_loop(self, session: aiohttp.ClientSession) -> None:
        backoff = Backoff(self._d.backoff_s, self._d.backoff_max_s)
        while True:
            try:
                async with asyncio.timeout(_RESYNC_S):
                    await self._dirty.wait()
            except TimeoutError:
                pass
            self._dirty.clear()
            try:
                await self.reconcile(session)
                backoff.reset()
            except StoreError as exc:  # the refresher reports the outage
                log.debug("kubernetes discovery: store call failed: %s", exc)
                await asyncio.sleep(backoff.delay())
                self._dirty.set()

    # -- the registry follows the pods ----------------------------------------------------------
    async def reconcile(self, session: aiohttp.ClientSession) -> None:
        """Make the shared registry (and this replica's pools) match the pods seen."""
        if not self.listed:
            return
        self.reconciles += 1
        desired = self._desired()
        members, prefix = self._members, f"{self.namespace}/"
        for gone in list(members.workers.values()):
            wid = parent_id(gone.spec)  # a data-parallel pod is one registration, its ranks
            if gone.dynamic and gone.spec.pod.startswith(prefix) and wid not in desired:
                if wid not in self._adopting and members.entry(wid) is not None:
                    await self._remove(wid)
        for wid in self._fresh.keys() - desired.keys():
            del self._fresh[wid]
        now = time.monotonic()
        for wid, (role, pod) in desired.items():
            w = members.entry(wid)
            if w is not None and not w.dynamic:
                self._complain(wid, f"pod {wid} has the id of a worker of the file: ignored")
                continue
            if w is None and (
                wid in self._adopting
                or self._retry_at.get(wid, 0.0) > now
                or not self._pod_in_rotation(wid)
            ):
                continue  # being adopted, or adopted once Ready (or once its engine answers)
            seen = (str(pod.get("metadata", {}).get("resourceVersion", "")), role, id(w))
            if w is not None and self._fresh.get(wid) == seen:
                await self._follow_readiness(w)
                continue
            try:
                raw = registration(pod, role, self._d)
            except ValueError as exc:
                self._complain(f"{wid}:{pod.get('metadata', {}).get('resourceVersion')}",
                               f"pod {wid}: {exc}")  # fmt: skip
                continue
            if raw is None:
                continue  # no address yet
            blob = orjson.dumps(raw)
            if w is not None and self._matches(w, raw, blob):
                self._fresh[wid] = seen
                await self._follow_readiness(w)
            elif self._pod_in_rotation(wid):
                if wid not in self._adopting and self._retry_at.get(wid, 0.0) <= now:
                    self._adopting[wid] = asyncio.create_task(self._adopt(session, raw, blob))
            elif w is not None:
                await self._follow_readiness(w)  # changed while out of rotation: kept drained

    def _matches(self, w: WorkerState, raw: dict[str, Any], blob: bytes) -> bool:
        """The worker registered under this id is this pod as it is now (registered by this
        replica or read back from another's registration)."""
        wid = parent_id(w.spec)
        if self._known.get(wid) == blob:
            return True
        try:
            want = self._members.parse_registration(raw)
        except ValueError:
            return False
        have = w.spec
        same = _identity(have) == _identity(want) and all(
            getattr(have.layout, k, object()) == v for k, v in (raw.get("layout") or {}).items()
        )
        if same:
            self._known[wid] = blob
        return same

    async def _adopt(
        self, session: aiohttp.ClientSession, raw: dict[str, Any], blob: bytes
    ) -> None:
        wid = raw["id"]
        try:
            async with self._gate:
                state = await register_worker(
                    self._store, self._members, self._prober, session, dict(raw),
                    self._d.discover_layout,
                )  # fmt: skip
            self._known[wid] = blob
            self._retry_at.pop(wid, None)
            log.info("pod %s adopted as %s worker %s (revision %s, layout %s)", raw["pod"],
                     raw["role"], wid, raw.get("revision", "-"), state.spec.layout.key)  # fmt: skip
        except InvalidRequest as exc:
            self._retry_at[wid] = time.monotonic() + _ADOPT_RETRY_S
            log.info("pod %s not adopted yet: %s", raw["pod"], exc)
        except StoreError as exc:
            self._retry_at[wid] = time.monotonic() + _ADOPT_RETRY_S
            log.debug("pod %s: store call failed: %s", raw["pod"], exc)
        finally:
            self._adopting.pop(wid, None)
            self._dirty.set()  # deleted meanwhile? not ready any more? the next pass sees it

    async def _follow_readiness(self, w: WorkerState) -> None:
        """The shared drain mark follows the pod: drained while NotReady or Terminating (a
        data-parallel pod: each of its ranks)."""
        wid = parent_id(w.spec)
        ready = self._pod_in_rotation(wid)
        for rank in self._members.ranks_of(wid):
            rank.pod_ready = ready
            if rank.drained == (not ready):
                continue
            workers = self._members.workers.values()
            await set_drained(self._store, workers, rank.spec.id, not ready)
            log.info("worker %s %s (its pod)", rank.spec.id, "undrained" if ready else "drained")

    async def _remove(self, wid: str) -> None:
        await self._store.unregister_worker(wid)
        self._members.remove(wid)
        self._known.pop(wid, None)
        self._fresh.pop(wid, None)
        self._retry_at.pop(wid, None)
        log.info("worker %s removed: its pod is gone", wid)


def _identity(spec: WorkerSpec) -> tuple[Any, ...]:
    """What a pod decides of its worker (its layout's engine-reported fields apart)."""
    bootstrap = spec.bootstrap_port if spec.bootstrap_configured else None
    return (spec.url, spec.role, spec.adapter, spec.pod, spec.revision, bootstrap,
            spec.kv_events, spec.kv_blocks)  # fmt: skip
