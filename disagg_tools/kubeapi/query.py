"""A list or watch request's query parameters, read and checked as the API server checks them
(apimachinery ListOptions and its validation): a bad one is a 400 before anything is served.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .selectors import (
    FieldSelector,
    LabelSelector,
    SelectorError,
    parse_field_selector,
    parse_label_selector,
)

__all__ = ["BadQuery", "ListQuery", "parse_list_query"]

Obj = dict[str, Any]


class BadQuery(ValueError):
    """A query the API server refuses with 400 BadRequest."""


@dataclass(frozen=True, slots=True)
class ListQuery:
    namespace: str | None  # None: every namespace
    labels: LabelSelector
    fields: FieldSelector
    resource_version: str | None  # as sent: None (unset), "0", or a number
    match: str | None  # resourceVersionMatch: None, "Exact", "NotOlderThan"
    limit: int
    continue_token: str | None
    watch: bool
    allow_bookmarks: bool
    timeout_s: float | None
    send_initial_events: bool | None

    def selects(self, obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    @property
    def rv_number(self) -> int | None:
        """The resourceVersion as a number; None when unset or "0" (any version)."""
        if self.resource_version in (None, "", "0"):
            return None
        return int(self.resource_version)


def _bool(params: Mapping[str, str], name: str) -> bool | None:
    raw = params.get(name)
    if raw is None:
        return None
    if raw.lower() in ("1", "true"):
        return True
    if raw.lower() in ("0", "false", ""):
        return False
    raise BadQuery(f"{name}: invalid value {raw!r}")


def parse_list_query(
    params: Mapping[str, str],
    namespace: str | None,
    fields: Mapping[str, Callable[[Obj], str]],
) -> ListQuery:
    try:
        labels = parse_label_selector(params.get("labelSelector"))
        field_sel = parse_field_selector(params.get("fieldSelector"), fields)
    except SelectorError as e:
        raise BadQuery(str(e)) from None
    rv = params.get("resourceVersion")
    if rv not in (None, "", "0"):
        try:
            if int(rv) < 0:
                raise ValueError
        except ValueError:
            raise BadQuery(f"invalid resource version: {rv!r}") from None
    match = params.get("resourceVersionMatch") or None
    if match not in (None, "Exact", "NotOlderThan"):
        raise BadQuery(f"resourceVersionMatch: Unsupported value: {match!r}")
    watch = bool(_bool(params, "watch"))
    if match is not None and rv in (None, "") and not watch:
        raise BadQuery("resourceVersionMatch is forbidden unless resourceVersion is provided")
    if match == "Exact" and rv == "0":
        raise BadQuery('resourceVersionMatch "exact" is forbidden for resourceVersion "0"')
    try:
        limit = int(params.get("limit") or 0)
        timeout = params.get("timeoutSeconds")
        timeout_s = float(int(timeout)) if timeout not in (None, "") else None
    except ValueError:
        raise BadQuery("limit and timeoutSeconds must be integers") from None
    token = params.get("continue") or None
    if token is not None and rv not in (None, ""):
        raise BadQuery("specifying resource version is not allowed when using continue")
    send_initial = _bool(params, "sendInitialEvents")
    allow_bookmarks = bool(_bool(params, "allowWatchBookmarks"))
    # ValidateListOptions: a watch takes resourceVersionMatch only with sendInitialEvents, and
    # then only NotOlderThan; the initial events' end is a bookmark, so bookmarks must be on.
    if send_initial is not None and not watch:
        raise BadQuery("sendInitialEvents is forbidden for list")
    if watch and send_initial is None and match is not None:
        raise BadQuery(
            "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided"
        )
    if send_initial is not None and match != "NotOlderThan":
        raise BadQuery("sendInitialEvents requires setting resourceVersionMatch to NotOlderThan")
    if send_initial and not allow_bookmarks:
        raise BadQuery("sendInitialEvents requires setting allowWatchBookmarks to true")
    return ListQuery(
        namespace=namespace,
        labels=labels,
        fields=field_sel,
        resource_version=rv,
        match=match,
        limit=max(limit, 0),
        continue_token=token,
        watch=watch,
        allow_bookmarks=allow_bookmarks,
        timeout_s=timeout_s,
        send_initial_events=send_initial,
    )
