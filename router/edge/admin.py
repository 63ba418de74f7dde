"""The admin API: what this replica sees, and (token-protected) worker registration.

    GET    /admin/state            pools, load, reservations, admission (read-only)
    GET    /admin/workers          every worker with health, breaker, layout and pairing
    GET    /admin/scaling          per model and pool: demand and the recommended replica count
    POST   /admin/workers          register a worker (the same fields as a config `workers:` entry,
                                   plus `discover_layout: true` to read its KV layout from it)
    DELETE /admin/workers/{id}     remove a worker registered through this API
    POST   /admin/workers/{id}/drain    no new placements on it; its running streams finish
    POST   /admin/workers/{id}/undrain  back in use
    GET    /admin/roles            `both` workers' roles, the last role decision and its reasons
    POST   /admin/workers/{id}/role     {"role": "prefill"|"decode"}: switch a `both` worker
                                   (it drains first; docs/elastic-roles.md)
    GET    /admin/tenants          tenants (weight, class, limits) and their keys' ids and
                                   fingerprints: never a key
    POST   /admin/tenants/{name}/keys                 a new key: the answer shows it, once
    POST   /admin/tenants/{name}/keys/{key_id}/rotate a new key under that id; the old one is
                                                      refused from now on
    DELETE /admin/tenants/{name}/keys/{key_id}        revoke: refused from now on

Registrations live in the shared store, so every replica adopts them within
`registry_refresh_s`; the replica that takes the call applies it at once. So do tenants' keys
made, rotated or revoked here: written to the store first (its digest only; a store that is
down: 503, nothing changed), then applied here; the other replicas refuse a revoked key within
one `registry_refresh_s` (router/tenants.py).

Who may call what: router/edge/auth.py (the GETs need a token once client keys are configured).

Guard rails: a drain, a role switch or a removal that would leave a pool (one side of one
model, router/workers/rotation.py) with no worker in rotation is refused with 409, naming the pool,
the worker and what the pool's other workers are doing, unless the body says `{"force": true}`.
Only workers in rotation count: not one on its way there (draining for a role switch), nor one
whose engine's role switch failed (broken until it proves it serves its role again).
The check reads the shared registry first (the other replicas' drains and roles as they are
now), but it is not atomic across replicas: two operators taking out a pool's last two workers
through two replicas in the same instant can both pass it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from policies.base import OutputLengthEstimator, PlacementPolicy
from router.admission import Admission
from router.config import Settings
from router.control.role_manager import ROLES, RoleChangeRefused
from router.control.scaling import DemandMeter, scaling_report
from router.edge.auth import check_admin_read, check_admin_write
from router.errors import InvalidRequest, RouterError, Unavailable
from router.leases import LeaseKeeper
from router.openai.prompt_tokens import prompt_token_modes
from router.redact import mask_url
from router.tenants import KEYRING, Keyring, KeySpec, UnknownKey, UnknownTenant
from router.workers.drain import set_drained
from router.workers.health_probe import HealthProber
from router.workers.membership import Membership
from router.workers.placement_view import PlacementView
from router.workers.registration import register_worker as register_worker_for_all
from router.workers.registry import RegistrySync
from router.workers.rotation import emptied_without, why_empty
from router.workers.worker_state import WorkerState
from state.base import StateStore

__all__ = ["ADMIN", "AdminView", "add_admin_routes"]

log = logging.getLogger(__name__)


class Conflict(RouterError):
    status = 409
    type = "conflict_error"


class NotFound(RouterError):
    """No worker of that id (answered by the middleware, as every error: router/errors.py)."""

    status = 404
    type = "not_found_error"


@dataclass(frozen=True, slots=True)
class AdminView:
    """What the admin routes read and change of this replica, handed to them by the app."""

    settings: Settings
    store: StateStore  # registrations, drains and tenants' keys, shared by every replica
    session: aiohttp.ClientSession  # a registered worker's probe and layout read
    members: Membership
    placement: PlacementView  # each worker's prefix cache, as placement sees it
    registry: RegistrySync  # the other replicas' changes, read fresh before a guard decides
    prober: HealthProber
    policy: PlacementPolicy
    estimator: OutputLengthEstimator
    leases: LeaseKeeper  # this replica's live reservations
    admission: Admission
    demand: DemandMeter  # the autoscaling signals (router/control/scaling.py)

    def __repr__(self) -> str:
        return f"AdminView(workers={len(self.members.workers)})"


ADMIN = web.AppKey("admin", AdminView)


def _view(request: web.Request) -> AdminView:
    return request.app[ADMIN]


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _require_token(view: AdminView, request: web.Request) -> None:
    check_admin_write(view.settings, request)


def _readable(request: web.Request) -> AdminView:
    view = _view(request)
    check_admin_read(view.settings, request)
    return view


async def _options(request: web.Request) -> dict[str, Any]:
    """An admin action's optional JSON object body ({} when there is none), `force` checked."""
    data = await request.read()
    if not data.strip():
        return {}
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidRequest("the body must be a JSON object")
    if not isinstance(raw.get("force", False), bool):
        raise InvalidRequest("force must be true or false", param="force")
    return raw


async def _fresh_registry(view: AdminView) -> None:
    """The registry as the store has it now (the other replicas' drains, roles, removals), not
    as the last refresh saw it: a guard decided on a stale view would let two operators on two
    replicas empty a pool a refresh apart."""
    await view.registry.sync(view.session)


def _refuse_if_emptied(
    view: AdminView, wid: str, action: str, force: bool, arriving: str | None = None
) -> None:
    """409 if taking `wid` out of rotation leaves a pool with none (unless forced); `action`
    names it ("draining d0"); `arriving`: the side a role switch sends it to."""
    members = view.members
    emptied = emptied_without(members, wid, arriving)
    if not emptied:
        return
    pools = ", ".join(f"the {side} pool of {model}" for side, model in emptied)
    if force:
        log.warning("%s (forced): %s now has no worker in rotation", action, pools)
        return
    others = "; ".join(
        f"{side}: {why_empty(members, side, model, without=wid) or f'{wid} is its only worker'}"
        for side, model in emptied
    )
    raise Conflict(
        f"{action} would leave {pools} with no worker in rotation ({others}); "
        'send {"force": true} to do it anyway',
        param="force",
        code="last_worker_in_rotation",
    )


def describe(
    view: AdminView, w: WorkerState, unpaired: set[str] | None = None
) -> dict[str, object]:
    """One worker as the admin API shows it; `unpaired`: the membership's, when the caller
    describes every worker (computed once, not once per worker: a thousand discovered pods
    made /admin/workers take 2 s)."""
    if unpaired is None:
        unpaired = set(view.members.unpaired())
    load = w.load
    return {
        "id": w.spec.id,
        "url": mask_url(w.spec.url),  # a URL's credentials are no one's to read here
        "role": w.spec.role,
        "adapter": w.spec.adapter,
        "group": w.spec.group,
        "healthy": w.healthy,
        "breaker": w.breaker.state,
        "layout": w.spec.layout.key if w.layout_known else None,  # None: not read yet
        "paired": w.spec.id not in unpaired,
        "dynamic": w.dynamic,
        "pod": w.spec.pod or None,  # Kubernetes discovery: the pod it was found as
        "revision": w.spec.revision or None,
        # A data-parallel rank target (docs/data-parallel.md): its entry and rank; else None.
        "dp_parent": w.spec.dp_parent or None,
        "dp_rank": w.spec.dp_rank,
        # Its pod Ready and not Terminating, as this replica's watch saw it (None: no pod).
        "pod_ready": w.pod_ready if w.spec.pod else None,
        "drained": w.drained,
        "current_role": w.current_role,
        "queued_prompt_tokens": w.queued_prompt_tokens,
        "resident_seqs": w.resident_seqs,
        "capacity_blocks": w.capacity_blocks,
        "reserved_blocks": w.reserved_blocks,
        "stranded_bytes": w.stranded_bytes,
        # "events": cached prefixes known from its KV events, else "estimated" (kv_events.py).
        "prefix_cache": view.placement.prefix_cache(w.spec.id),
        "reported_load": None
        if load is None
        else {"running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage},
    }


async def admin_state(request: web.Request) -> web.Response:
    view = _readable(request)
    return _json(
        {
            "policy": view.policy.name,
            "estimator": view.estimator.name,
            "live_reservations": len(view.leases.live),
            "inflight": view.admission.inflight,
            "waiting": view.admission.waiting,
            "fairness": view.admission.policy.name,
            "unpaired": view.members.unpaired(),
            "workers": _describe_all(view),
            # Per model: exact prompt counts (its tokenizer) or estimates (router/tokens/).
            "prompt_tokens": prompt_token_modes(view.settings),
        }
    )


async def list_workers(request: web.Request) -> web.Response:
    view = _readable(request)
    return _json({"workers": _describe_all(view)})


def _describe_all(view: AdminView) -> list[dict[str, object]]:
    unpaired = set(view.members.unpaired())
    return [describe(view, w, unpaired) for w in view.members.workers.values()]


async def scaling(request: web.Request) -> web.Response:
    view = _readable(request)
    report = scaling_report(view.settings, view.demand, view.members.workers.values())
    return _json({"slo": _slo(view), "models": report})


def _slo(view: AdminView) -> dict[str, object]:
    slo = view.settings.scaling
    return {
        "ttft_slo_s": slo.ttft_slo_s,
        "itl_slo_s": slo.itl_slo_s,
        "utilization": slo.utilization,
        "window_s": slo.window_s,
    }


async def register_worker(request: web.Request) -> web.Response:
    view = _view(request)
    _require_token(view, request)
    try:
        raw = orjson.loads(await request.read())
        if not isinstance(raw, dict):
            raise TypeError("a registration is a JSON object")
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the registration is not valid JSON: {exc}") from exc
    except TypeError as exc:
        raise InvalidRequest(f"bad worker registration: {exc}") from exc
    discover = raw.pop("discover_layout", False)
    if not isinstance(discover, bool):
        raise InvalidRequest("discover_layout must be true or false", param="discover_layout")
    # The path Kubernetes discovery takes too (router/workers/registration.py).
    state = await register_worker_for_all(
        view.store, view.members, view.prober, view.session, raw, discover
    )
    return _json(describe(view, state), status=201)


async def remove_worker(request: web.Request) -> web.Response:
    view = _view(request)
    _require_token(view, request)
    wid = request.match_info["worker_id"]
    force = (await _options(request)).get("force", False)
    current = view.members.entry(wid)  # a data-parallel entry: its rank 0 stands for it
    if current is not None and not current.dynamic:
        raise InvalidRequest(f"worker {wid} comes from the configuration file", param="id")
    if current is not None and current.spec.dp_parent and wid != current.spec.dp_parent:
        raise InvalidRequest(
            f"{wid} is a data-parallel rank of {current.spec.dp_parent}: remove the worker "
            f"{current.spec.dp_parent} (or drain the rank)",
            param="id",
        )
    if current is not None:
        await _fresh_registry(view)
        _refuse_if_emptied_all(view, wid, f"removing {wid}", force)
    removed = await view.store.unregister_worker(wid)
    view.members.remove(wid)
    if not removed and current is None:
        raise NotFound(f"no registered worker {wid}", param="id")
    return _json({"removed": wid})


def _not_found(wid: str) -> NotFound:
    return NotFound(f"no worker {wid}", param="id")


async def _drain(request: web.Request, drained: bool) -> web.Response:
    view = _view(request)
    _require_token(view, request)
    wid = request.match_info["worker_id"]
    force = drained and (await _options(request)).get("force", False)  # undrain: no body
    if view.members.entry(wid) is None:
        raise _not_found(wid)
    if drained:
        await _fresh_registry(view)
        _refuse_if_emptied_all(view, wid, f"draining {wid}", force)
    state = view.members.entry(wid)
    if state is None:  # removed through another replica meanwhile
        raise _not_found(wid)
    # A data-parallel entry's id drains (or undrains) each of its ranks.
    changed = False
    for rank in view.members.ranks_of(wid):
        workers = view.members.workers.values()
        changed = await set_drained(view.store, workers, rank.spec.id, drained) or changed
    return _json({**describe(view, state), "changed": changed})


def _refuse_if_emptied_all(view: AdminView, wid: str, action: str, force: bool) -> None:
    """`_refuse_if_emptied` for an entry's id: a data-parallel entry's ranks taken out
    together (the others counted out while the last is judged; nothing awaits meanwhile)."""
    ranks = view.members.ranks_of(wid)
    if len(ranks) <= 1:
        _refuse_if_emptied(view, wid, action, force)
        return
    others = [w for w in ranks[:-1] if not w.drained]
    for w in others:
        w.drained = True
    try:
        _refuse_if_emptied(view, ranks[-1].spec.id, action, force)
    finally:
        for w in others:
            w.drained = False


async def drain_worker(request: web.Request) -> web.Response:
    return await _drain(request, True)


async def undrain_worker(request: web.Request) -> web.Response:
    return await _drain(request, False)


async def roles(request: web.Request) -> web.Response:
    _readable(request)
    manager = request.app.get(ROLES)
    if manager is None:
        raise Unavailable("the role manager is not running yet", retry_after_s=1.0)
    return _json(manager.report())


async def set_role(request: web.Request) -> web.Response:
    view = _view(request)
    _require_token(view, request)
    wid = request.match_info["worker_id"]
    try:
        raw = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    role = raw.get("role") if isinstance(raw, dict) else None
    if role not in ("prefill", "decode"):
        raise InvalidRequest(
            'the body must be {"role": "prefill"} or {"role": "decode"}', param="role"
        )
    force = raw.get("force", False)
    if not isinstance(force, bool):
        raise InvalidRequest("force must be true or false", param="force")
    manager = request.app.get(ROLES)
    if manager is None:
        raise Unavailable("the role manager is not running yet", retry_after_s=1.0)
    w = view.members.workers.get(wid)
    if w is not None and w.spec.role == "both":  # else the manager refuses it (409) itself
        await _fresh_registry(view)
        # A switch drains it first: in neither pool until it is done. One already serving
        # (or heading to) that role changes nothing.
        if w.role_state is None or w.role_state.target != role:
            _refuse_if_emptied(view, wid, f"switching {wid} to {role}", force, arriving=role)
    try:
        record = await manager.force(wid, role)
    except KeyError:
        raise _not_found(wid) from None
    except RoleChangeRefused as exc:
        raise Conflict(str(exc), param="id") from exc
    state = view.members.workers[wid]
    return _json({**describe(view, state), "role_version": record.version})


async def list_tenants(request: web.Request) -> web.Response:
    view = _readable(request)
    keyring = request.app[KEYRING]
    return _json(
        {
            "fairness": view.admission.policy.name,
            "mode": "keys" if keyring.closed else "open",
            "tenants": keyring.describe(),
        }
    )


def _tenant_call(request: web.Request) -> tuple[str, str]:
    _require_token(_view(request), request)
    return request.match_info["tenant"], request.match_info.get("key_id", "")


def _lookup_error(exc: KeyError) -> NotFound:
    if isinstance(exc, UnknownTenant):
        return NotFound(f"no tenant {exc.args[0]}", param="tenant")
    return NotFound("no key of that id in this tenant", param="key_id")


async def _fresh_keys(view: AdminView, keyring: Keyring) -> None:
    """The shared key table as the store has it now, so a key made on another replica a moment
    ago can be rotated or revoked here before this replica's next refresh."""
    keyring.adopt(await view.store.tenant_keys())


async def _put_key(
    view: AdminView,
    keyring: Keyring,
    key: KeySpec,
    plain: str,
    *,
    replaces: KeySpec | None = None,
    status: int,
) -> web.Response:
    """A minted key in force: the store first (a store that is down answers 503,
    router/errors.py, and nothing changed), then this replica; the answer shows it once."""
    old = "" if replaces is None else replaces.digest.hex()
    tenant, digest = key.tenant, key.digest.hex()
    if not await view.store.put_tenant_key(key.key_id, tenant, digest, key.source, old):
        # Only if the fresh random key's digest were already revoked: not expected, but the
        # store's refusal is answered rather than assumed away.
        raise Conflict("that key was revoked; try again")
    keyring.put(key, replaces=replaces)
    done = "created" if replaces is None else "rotated"
    log.info("tenant %s: key %s %s (%s)", tenant, key.key_id, done, key.fingerprint)
    body = {"tenant": tenant, **key.describe(), "key": plain}
    resp = _json(body, status=status)
    resp.headers["Cache-Control"] = "no-store"  # nothing on the way may keep a copy
    return resp


async def create_key(request: web.Request) -> web.Response:
    tenant, _ = _tenant_call(request)
    view, keyring = _view(request), request.app[KEYRING]
    try:
        key, plain = keyring.mint(tenant)
    except UnknownTenant as exc:
        raise _lookup_error(exc) from None
    return await _put_key(view, keyring, key, plain, status=201)


async def rotate_key(request: web.Request) -> web.Response:
    tenant, key_id = _tenant_call(request)
    view, keyring = _view(request), request.app[KEYRING]
    await _fresh_keys(view, keyring)
    try:
        old = keyring.key(tenant, key_id)
        key, plain = keyring.mint(tenant, key_id)
    except (UnknownTenant, UnknownKey) as exc:
        raise _lookup_error(exc) from None
    return await _put_key(view, keyring, key, plain, replaces=old, status=200)


async def revoke_key(request: web.Request) -> web.Response:
    tenant, key_id = _tenant_call(request)
    view, keyring = _view(request), request.app[KEYRING]
    await _fresh_keys(view, keyring)
    try:
        key = keyring.key(tenant, key_id)
    except (UnknownTenant, UnknownKey) as exc:
        raise _lookup_error(exc) from None
    await view.store.revoke_tenant_key(key_id, key.digest.hex())
    keyring.drop(key)
    log.info("tenant %s: key %s revoked (%s)", tenant, key.key_id, key.fingerprint)
    return _json({"tenant": tenant, "revoked": key.key_id, "fingerprint": key.fingerprint})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/state", admin_state)
    app.router.add_get("/admin/workers", list_workers)
    app.router.add_get("/admin/scaling", scaling)
    app.router.add_post("/admin/workers", register_worker)
    app.router.add_delete("/admin/workers/{worker_id}", remove_worker)
    app.router.add_post("/admin/workers/{worker_id}/drain", drain_worker)
    app.router.add_post("/admin/workers/{worker_id}/undrain", undrain_worker)
    app.router.add_get("/admin/roles", roles)
    app.router.add_post("/admin/workers/{worker_id}/role", set_role)
    app.router.add_get("/admin/tenants", list_tenants)
    app.router.add_post("/admin/tenants/{tenant}/keys", create_key)
    app.router.add_post("/admin/tenants/{tenant}/keys/{key_id}/rotate", rotate_key)
    app.router.add_delete("/admin/tenants/{tenant}/keys/{key_id}", revoke_key)
