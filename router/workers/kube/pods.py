"""What a pod says about the worker in it (pure): its readiness, and its registration — the
fields of a config `workers:` entry, as the admin API takes them (router/workers/registration.py).

    id          the pod's name (one namespace is watched: names are unique in it)
    url         <scheme>://<podIP>:<port>; the port: the container port named `port_name`, else
                the `port_annotation` annotation, else `role_ports[role]`, else `port`
    bootstrap   an SGLang/Mooncake prefill: the `bootstrap_port_annotation` annotation, else the
                container port `bootstrap_port_name`; neither: read from its /server_info
    kv_events   the container ports `kv_events_port_name` (PUB) and `kv_events_replay_port_name`
    layout      the model from `model_label`, fields from the `layout_annotation` JSON
    revision    `revision_label`, else `pod-template-hash`
    pod         "<namespace>/<name>"

A pod with no IP yet, or no port, gives no registration (None): it is not a worker yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from router.settings_groups import DiscoverySettings

__all__ = ["in_rotation", "pod_key", "registration", "ready", "terminating"]

Obj = Mapping[str, Any]


def _meta(pod: Obj) -> Obj:
    meta = pod.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def pod_key(pod: Obj) -> str:
    return str(_meta(pod).get("name", ""))


def terminating(pod: Obj) -> bool:
    """A graceful delete has started (the kubelet is stopping it): `deletionTimestamp` set."""
    return bool(_meta(pod).get("deletionTimestamp"))


def ready(pod: Obj) -> bool:
    """The pod is Running and its Ready condition is True (its readiness probe passes)."""
    status = pod.get("status")
    if not isinstance(status, Mapping) or status.get("phase") != "Running":
        return False
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


def in_rotation(pod: Obj) -> bool:
    """Ready and not Terminating: the only pods placement may choose."""
    return ready(pod) and not terminating(pod)


def _named_ports(pod: Obj) -> dict[str, int]:
    out: dict[str, int] = {}
    spec = pod.get("spec")
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    for c in containers if isinstance(containers, list) else []:
        for p in (c.get("ports") or []) if isinstance(c, Mapping) else []:
            if isinstance(p, Mapping) and p.get("name") and isinstance(p.get("containerPort"), int):
                out.setdefault(str(p["name"]), int(p["containerPort"]))
    return out


def _port_number(text: object) -> int | None:
    value = str(text).strip() if text is not None else ""
    return int(value) if value.isdigit() and 0 < int(value) < 65536 else None


def _pod_ip(pod: Obj) -> str | None:
    status = pod.get("status")
    ip = status.get("podIP") if isinstance(status, Mapping) else None
    if not isinstance(ip, str) or not ip:
        return None
    return f"[{ip}]" if ":" in ip else ip  # an IPv6 address in a URL


def _layout(pod: Obj, settings: DiscoverySettings) -> dict[str, Any]:
    meta = _meta(pod)
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    out: dict[str, Any] = {}
    text = notes.get(settings.layout_annotation) if settings.layout_annotation else None
    if text:
        try:
            fields = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"annotation {settings.layout_annotation}: not JSON ({exc})") from exc
        if not isinstance(fields, dict):
            raise ValueError(f"annotation {settings.layout_annotation}: expected a JSON object")
        out.update(fields)
    if settings.model_label and labels.get(settings.model_label):
        out["model"] = labels[settings.model_label]
    return out


def registration(pod: Obj, role: str, settings: DiscoverySettings) -> dict[str, Any] | None:
    """The registration of the worker in `pod` for `role`; None while it has no address.
    ValueError when an annotation it carries is malformed."""
    meta = _meta(pod)
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    ip = _pod_ip(pod)
    if ip is None:
        return None
    named = _named_ports(pod)
    port = (
        (named.get(settings.port_name) if settings.port_name else None)
        or (_port_number(notes.get(settings.port_annotation)) if settings.port_annotation else None)
        or settings.role_ports.get(role)
        or settings.port
    )
    raw: dict[str, Any] = {
        "id": pod_key(pod),
        "url": f"{settings.scheme}://{ip}:{port}",
        "role": role,
        "adapter": settings.adapter,
        "pod": f"{meta.get('namespace', '')}/{pod_key(pod)}",
    }
    revision = labels.get(settings.revision_label or "pod-template-hash")
    if revision:
        raw["revision"] = str(revision)
    if role != "decode" and settings.adapter in ("sglang", "mooncake"):
        bootstrap = _port_number(notes.get(settings.bootstrap_port_annotation)) or named.get(
            settings.bootstrap_port_name
        )
        if bootstrap:
            raw["bootstrap_port"] = bootstrap
    events = named.get(settings.kv_events_port_name)
    if events:
        kv: dict[str, Any] = {"endpoint": f"tcp://{ip}:{events}"}
        replay = named.get(settings.kv_events_replay_port_name)
        if replay:
            kv["replay_endpoint"] = f"tcp://{ip}:{replay}"
        if settings.kv_events_topic:
            kv["topic"] = settings.kv_events_topic
        raw["kv_events"] = kv
    if role != "prefill" and settings.kv_blocks is not None:
        raw["kv_blocks"] = settings.kv_blocks
    layout = _layout(pod, settings)
    if layout:
        raw["layout"] = layout
    return raw
