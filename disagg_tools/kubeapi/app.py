"""The HTTP routes of the stand-in API server (aiohttp).

    GET    /api, /api/v1, /apis, /apis/discovery.k8s.io/v1, /version, /healthz, /readyz
    GET    /api/v1/pods                                   every namespace (list or ?watch=1)
    GET    /api/v1/namespaces/{ns}/pods                   one namespace (list or ?watch=1)
    POST   /api/v1/namespaces/{ns}/pods                   create
    GET    /api/v1/namespaces/{ns}/pods/{name}            one pod
    PUT    /api/v1/namespaces/{ns}/pods/{name}            replace (409 Conflict on a stale
                                                          metadata.resourceVersion)
    DELETE /api/v1/namespaces/{ns}/pods/{name}            delete (at once: no grace period)
    ... and the same under /apis/discovery.k8s.io/v1 for endpointslices.
    POST   /standin/faults                                the fault knobs for another process

Errors are meta/v1 Status documents with the API's reasons and codes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from .discovery import api_group_list, api_resource_list, api_versions, version_info
from .faults import Faults, faults_middleware
from .listing import serve_list
from .objects import PODS, RESOURCES, Resource
from .query import BadQuery, parse_list_query
from .selectors import COMMON_FIELDS, POD_FIELDS
from .status import status_response
from .store import AlreadyExists, NotFound, Store
from .watch import BookmarkNow, Drop, WatchSettings, serve_watch

__all__ = ["ApiState", "make_app"]

Obj = dict[str, Any]
PREFIXES = {"v1": "/api/v1", "discovery.k8s.io/v1": "/apis/discovery.k8s.io/v1"}


@dataclass(slots=True)
class ApiState:
    store: Store
    watch: WatchSettings = field(default_factory=WatchSettings)
    faults: Faults = field(default_factory=Faults)
    requests: deque[str] = field(default_factory=lambda: deque(maxlen=10_000))

    def log(self, request: web.Request) -> None:
        self.requests.append(f"{request.method} {request.path_qs}")


STATE = web.AppKey("kubeapi_state", ApiState)


def _json(body: Obj, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _resource(request: web.Request, group_version: str) -> Resource | None:
    r = RESOURCES.get(request.match_info["resource"])
    return r if r is not None and r.api_version == group_version else None


def _not_found(what: str, name: str = "") -> web.Response:
    if name:
        return status_response(404, f'{what} "{name}" not found', name=name, kind=what)
    return status_response(404, "the server could not find the requested resource")


def _fields(r: Resource) -> dict[str, Callable[[Obj], str]]:
    return POD_FIELDS if r is PODS else COMMON_FIELDS


def _collection(group_version: str) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        r = _resource(request, group_version)
        if r is None:
            return _not_found("")
        try:
            query = parse_list_query(request.query, request.match_info.get("namespace"), _fields(r))
        except BadQuery as e:
            return status_response(400, str(e))
        if query.watch:
            return await serve_watch(request, state.store, r, query, state.watch)
        return await serve_list(state.store, r, query, state.watch.too_large_wait_s)

    return handle


async def _body(request: web.Request, r: Resource) -> Obj | web.Response:
    try:
        obj = orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        return status_response(400, f"invalid JSON: {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        return status_response(400, "the body must be an object with metadata")
    if obj.get("kind", r.kind) != r.kind:
        return status_response(400, f"the body's kind must be {r.kind}")
    obj["kind"], obj["apiVersion"] = r.kind, r.api_version
    obj["metadata"]["namespace"] = request.match_info["namespace"]
    return obj


def _create(group_version: str) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.StreamResponse:
        r = _resource(request, group_version)
        if r is None:
            return _not_found("")
        obj = await _body(request, r)
        if isinstance(obj, web.Response):
            return obj
        if not obj["metadata"].get("name"):
            return status_response(400, "metadata.name: Required value")
        try:
            return _json(request.app[STATE].store.create(r.name, obj), 201)
        except AlreadyExists as e:
            return status_response(409, str(e))

    return handle


def _item(group_version: str) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.StreamResponse:
        store = request.app[STATE].store
        r = _resource(request, group_version)
        if r is None:
            return _not_found("")
        ns, name = request.match_info["namespace"], request.match_info["name"]
        try:
            if request.method == "GET":
                return _json(store.get(r.name, ns, name))
            if request.method == "DELETE":
                return _json(store.delete(r.name, ns, name))
            obj = await _body(request, r)
            if isinstance(obj, web.Response):
                return obj
            if obj["metadata"].get("name") != name:
                return status_response(400, "metadata.name must match the URL")
            sent = obj["metadata"].get("resourceVersion")
            if sent and sent != store.get(r.name, ns, name)["metadata"]["resourceVersion"]:
                # Optimistic concurrency: a replace of a version that is no longer current.
                return status_response(
                    409,
                    f'Operation cannot be fulfilled on {r.name} "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                    "Conflict",
                    name=name,
                    kind=r.name,
                )
            return _json(store.replace(r.name, obj))
        except NotFound:
            return _not_found(r.name, name)

    return handle


async def _faults(request: web.Request) -> web.Response:
    """{"drop_watches": "abrupt"|"clean", "compact": true, "bookmark_now": true,
    "fail_next": N, "fail_status": 500|429, "delay_s": s} — each key optional."""
    state = request.app[STATE]
    try:
        body = orjson.loads(await request.read() or b"{}")
        if not isinstance(body, dict):
            raise ValueError("the body must be an object")
        if "fail_next" in body:
            state.faults.fail_next = int(body["fail_next"])
            state.faults.fail_status = int(body.get("fail_status", 500))
        if "delay_s" in body:
            state.faults.delay_s = float(body["delay_s"])
    except (ValueError, TypeError, orjson.JSONDecodeError) as e:
        return status_response(400, str(e))
    if body.get("compact"):
        state.store.compact()
    if body.get("bookmark_now"):
        state.store.notify_all(BookmarkNow())
    if "drop_watches" in body:
        state.store.notify_all(Drop(abrupt=body["drop_watches"] != "clean"))
    return _json({"resourceVersion": str(state.store.rv), "oldestKept": state.store.oldest_kept})


def make_app(state: ApiState, address: Callable[[], str]) -> web.Application:
    """The application; `address` gives host:port once the server is bound (for /api)."""
    app = web.Application(middlewares=[faults_middleware(state.faults, state.log)])
    app[STATE] = state

    async def api(_: web.Request) -> web.Response:
        return _json(api_versions(address()))

    async def apis(_: web.Request) -> web.Response:
        return _json(api_group_list())

    def group(gv: str) -> Callable[[web.Request], Any]:
        async def handle(_: web.Request) -> web.Response:
            doc = api_resource_list(gv)
            return _json(doc) if doc is not None else _not_found("")

        return handle

    async def version(_: web.Request) -> web.Response:
        return _json(version_info())

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/api", api)
    app.router.add_get("/apis", apis)
    app.router.add_get("/version", version)
    app.router.add_get("/healthz", ok)
    app.router.add_get("/readyz", ok)
    app.router.add_post("/standin/faults", _faults)
    for gv, prefix in PREFIXES.items():
        app.router.add_get(prefix, group(gv))
        app.router.add_get(prefix + "/{resource}", _collection(gv))
        app.router.add_get(prefix + "/namespaces/{namespace}/{resource}", _collection(gv))
        app.router.add_post(prefix + "/namespaces/{namespace}/{resource}", _create(gv))
        for method in ("GET", "PUT", "DELETE"):
            app.router.add_route(
                method, prefix + "/namespaces/{namespace}/{resource}/{name}", _item(gv)
            )

    async def unknown(_: web.Request) -> web.Response:
        return _not_found("")

    app.router.add_route("*", "/{tail:.*}", unknown)  # a Status, not aiohttp's text page
    return app
