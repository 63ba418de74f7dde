"""Registering a worker at run time: the one path the admin API (`POST /admin/workers`) and
Kubernetes discovery (router/workers/kube/) take.

The registration is checked before any call to the worker; with `discover` its KV layout is
read from it (under the fields the caller gave), and its data parallelism when the caller gave
none (docs/data-parallel.md), and stored with it, so every replica pairs the
worker alike without asking it again. It is written to the shared store (every replica adopts
it within `registry_refresh_s`, router/workers/registry.py), applied here at once, and probed:
in rotation when it answers.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from router.config import ConfigError
from router.errors import InvalidRequest
from router.workers.dp_loads import reported_dp_size
from router.workers.health_probe import HealthProber
from router.workers.membership import Membership
from router.workers.worker_state import WorkerState
from state.base import StateStore

__all__ = ["register_worker", "with_discovered_layout", "with_reported_ranks"]


async def with_discovered_layout(
    prober: HealthProber,
    session: aiohttp.ClientSession,
    raw: dict[str, Any],
    url: str,
    adapter: str,
) -> dict[str, Any]:
    """The registration with the layout the worker reports, under what the caller configured."""
    try:
        facts = await prober.layout_facts(session, url, adapter)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise InvalidRequest(
            f"could not read the KV layout of the worker at {url} ({exc!r}); register it "
            "when it answers, or give its `layout` without discover_layout",
            param="url",
        ) from exc
    return {**raw, "layout": {**facts, **(raw.get("layout") or {})}}


async def with_reported_ranks(
    prober: HealthProber,
    session: aiohttp.ClientSession,
    raw: dict[str, Any],
    url: str,
    adapter: str,
) -> dict[str, Any]:
    """The registration with the data parallelism the worker reports (router/workers/
    dp_loads.py) when it gives none: stored with it, so every replica expands it alike."""
    if "dp_size" in raw or "data_parallel_size" in raw:
        return raw
    try:
        async with prober.two_probes():
            size = await reported_dp_size(session, url, adapter)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return raw  # it says nothing: one engine behind the URL
    return {**raw, "dp_size": size} if size is not None and size > 1 else raw


async def register_worker(
    store: StateStore,
    members: Membership,
    prober: HealthProber,
    session: aiohttp.ClientSession,
    raw: dict[str, Any],
    discover: bool,
) -> WorkerState:
    """Register the worker `raw` describes (a config `workers:` entry's fields) for every
    replica; InvalidRequest when it is malformed, its layout cannot be read, or its id is a
    worker of the configuration file."""
    try:
        spec = members.parse_registration(raw)  # checked before any call to the worker
        if discover:
            members.announce(spec)  # what waits for such a worker, before the first call
            raw = await with_discovered_layout(prober, session, raw, spec.url, spec.adapter)
            raw = await with_reported_ranks(prober, session, raw, spec.url, spec.adapter)
            spec = members.parse_registration(raw)
    except (ConfigError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"bad worker registration: {exc}") from exc
    current = members.entry(spec.id)
    if current is not None and not current.dynamic:
        raise InvalidRequest(
            f"worker {spec.id} comes from the configuration file; "
            "it cannot be replaced through the API",
            param="id",
        )
    registration = orjson.dumps(raw).decode()
    await store.register_worker(spec.id, registration)
    state = members.add(spec, dynamic=True, registration=registration)
    if spec.is_decode:  # per data-parallel rank: each its own pool (router/workers/dp_ranks.py)
        for w in members.ranks_of(spec.id):
            await store.set_capacity(w.spec.id, w.capacity_blocks)
    # In rotation now if it answers, else when it does (its ranks with it).
    await prober.probe(session, state)
    return state
