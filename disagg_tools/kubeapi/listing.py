"""A list: `{"kind": "PodList", "metadata": {"resourceVersion"}, "items": [...]}`.

The resourceVersion semantics of the API's list (api-concepts, "Semantics for get and list"):
  - unset or "0": the current objects; the list carries the current resourceVersion;
  - N (NotOlderThan, the default): at least as fresh as N: the current objects, after waiting up
    to `too_large_wait_s` for the store to reach N (else 504 "Too large resource version");
  - resourceVersionMatch=Exact, or a limit with N and no match (the legacy exact case): the
    objects as they were at N, or 410 Expired "The resourceVersion for the provided list is
    too old." when the history no longer reaches back to N;
  - limit: a page in key order (namespace, name) and a `continue` token that pins the rest of
    the list to the first page's resourceVersion; a token older than the kept history is 410
    Expired. remainingItemCount only when the list has no selector, as the server does.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson
from aiohttp import web

from .objects import Resource
from .query import ListQuery
from .status import status_response
from .store import Expired, Key, Store

__all__ = ["serve_list"]

Obj = dict[str, Any]

CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can "
    "start a new list without the continue parameter."
)


def _encode_continue(rv: int, last: Key) -> str:
    body = {"v": "meta.k8s.io/v1", "rv": rv, "start": f"{last[0]}/{last[1]}\x00"}
    return base64.urlsafe_b64encode(orjson.dumps(body)).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[int, Key]:
    try:
        body = orjson.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        ns, _, name = str(body["start"]).rstrip("\x00").partition("/")
        if body.get("v") != "meta.k8s.io/v1":
            raise ValueError
        return int(body["rv"]), (ns, name)
    except (ValueError, KeyError, TypeError, binascii.Error, orjson.JSONDecodeError):
        raise ValueError("continue key is not valid") from None


def _too_large(rv: int, current: int) -> web.Response:
    return status_response(
        504,
        f"Too large resource version: {rv}, current: {current}",
        "Timeout",
        headers={"Retry-After": "1"},
        causes=[{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
        retryAfterSeconds=1,
    )


async def serve_list(
    store: Store, resource: Resource, query: ListQuery, too_large_wait_s: float
) -> web.Response:
    after: Key | None = None
    rv = query.rv_number
    exact = query.match == "Exact" or (query.limit > 0 and rv is not None and query.match is None)
    if rv is not None and rv > store.rv and not await store.wait_for(rv, too_large_wait_s):
        return _too_large(rv, store.rv)
    try:
        if query.continue_token is not None:
            try:
                list_rv, after = _decode_continue(query.continue_token)
            except ValueError as e:
                return status_response(400, str(e))
            if store.is_expired(list_rv):
                return status_response(410, CONTINUE_EXPIRED, "Expired")
            objects = store.snapshot_at(resource.name, list_rv)
        elif exact and rv is not None:
            list_rv = rv
            objects = store.snapshot_at(resource.name, rv)
        else:
            list_rv = store.rv
            objects = dict(store.items(resource.name))
    except Expired as e:
        return status_response(410, str(e), "Expired")

    keys = sorted(k for k, obj in objects.items() if query.selects(obj))
    if after is not None:
        keys = [k for k in keys if k > after]
    meta: Obj = {"resourceVersion": str(list_rv)}
    if query.limit and len(keys) > query.limit:
        meta["continue"] = _encode_continue(list_rv, keys[query.limit - 1])
        if not query.labels.requirements and not query.fields.terms:
            meta["remainingItemCount"] = len(keys) - query.limit
        keys = keys[: query.limit]
    # The items of a list carry no kind or apiVersion: the list's own say what they are.
    items = [
        {k: v for k, v in objects[key].items() if k not in ("kind", "apiVersion")} for key in keys
    ]
    body = {
        "kind": resource.list_kind,
        "apiVersion": resource.api_version,
        "metadata": meta,
        "items": items,
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")
