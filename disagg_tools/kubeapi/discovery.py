"""The discovery documents kubectl reads before it lists anything (the legacy, unaggregated
form: `/api` APIVersions, `/api/v1` and `/apis/discovery.k8s.io/v1` APIResourceList, `/apis`
APIGroupList). kubectl asks for the aggregated form first and falls back to these when the answer
is plain `application/json`. `/version` says 1.35, the version the stand-in was checked with.
"""

from __future__ import annotations

from typing import Any

from .objects import RESOURCES, Resource

__all__ = ["api_group_list", "api_resource_list", "api_versions", "version_info"]

Obj = dict[str, Any]
GROUP = "discovery.k8s.io"
VERBS = ["create", "delete", "get", "list", "update", "watch"]


def api_versions(address: str) -> Obj:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    }


def api_group_list() -> Obj:
    version = {"groupVersion": f"{GROUP}/v1", "version": "v1"}
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [{"name": GROUP, "versions": [version], "preferredVersion": version}],
    }


def _entry(r: Resource) -> Obj:
    out: Obj = {
        "name": r.name,
        "singularName": r.singular,
        "namespaced": True,
        "kind": r.kind,
        "verbs": VERBS,
    }
    if r.short_names:
        out["shortNames"] = list(r.short_names)
    if r.name == "pods":
        out["categories"] = ["all"]
    return out


def api_resource_list(group_version: str) -> Obj | None:
    served = [r for r in RESOURCES.values() if r.api_version == group_version]
    if not served:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [_entry(r) for r in served],
    }


def version_info() -> Obj:
    return {
        "major": "1",
        "minor": "35",
        "gitVersion": "v1.35.0-standin",
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "",
        "compiler": "",
        "platform": "linux/amd64",
    }
