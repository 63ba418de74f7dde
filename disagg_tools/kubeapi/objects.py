"""The objects the stand-in serves: core/v1 Pods and discovery.k8s.io/v1 EndpointSlices.

Built with the fields of the published API types (k8s.io/api core/v1 Pod, discovery/v1
EndpointSlice) that discovery reads: labels, annotations, named container ports, phase, the
Ready condition, podIP, deletionTimestamp for Terminating. The store stamps `uid`,
`resourceVersion` and `creationTimestamp`; everything else is what the caller describes.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PodSpec",
    "Resource",
    "RESOURCES",
    "PODS",
    "ENDPOINT_SLICES",
    "endpoint_slice_object",
    "now_rfc3339",
    "pod_object",
    "set_ready",
]

Obj = dict[str, Any]


def now_rfc3339() -> str:
    """The API's timestamp format: RFC 3339, UTC, whole seconds."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Resource:
    """One served resource: its URL name and the type names its documents carry."""

    name: str  # "pods"
    kind: str  # "Pod"
    api_version: str  # "v1" or "discovery.k8s.io/v1"
    singular: str
    short_names: tuple[str, ...] = ()

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


PODS = Resource("pods", "Pod", "v1", "pod", ("po",))
ENDPOINT_SLICES = Resource(
    "endpointslices", "EndpointSlice", "discovery.k8s.io/v1", "endpointslice"
)
RESOURCES = {r.name: r for r in (PODS, ENDPOINT_SLICES)}


@dataclass(slots=True)
class PodSpec:
    """What a test or the simulator says about a pod; `pod_object` makes the API document."""

    name: str
    namespace: str = "default"
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # container port name → number
    phase: str = "Running"  # Pending, Running, Succeeded, Failed, Unknown
    ready: bool = True
    pod_ip: str | None = "10.0.0.1"
    node_name: str = "standin-node"
    image: str = "standin/engine:latest"
    container: str = "engine"


def _condition(kind: str, status: bool, when: str) -> Obj:
    return {
        "type": kind,
        "status": "True" if status else "False",
        "lastProbeTime": None,
        "lastTransitionTime": when,
    }


def pod_object(spec: PodSpec) -> Obj:
    """The Pod document for `spec` (without uid, resourceVersion, creationTimestamp)."""
    when = now_rfc3339()
    running = spec.phase == "Running"
    ready = spec.ready and running
    container: Obj = {
        "name": spec.container,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [
            {"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in spec.ports.items()
        ],
    }
    status: Obj = {
        "phase": spec.phase,
        "conditions": [
            _condition("PodScheduled", True, when),
            _condition("Initialized", True, when),
            _condition("ContainersReady", ready, when),
            _condition("Ready", ready, when),
        ],
        "hostIP": "192.168.0.1",
        "startTime": when,
        "containerStatuses": [
            {
                "name": spec.container,
                "image": spec.image,
                "imageID": "",
                "ready": ready,
                "restartCount": 0,
                "started": running,
                "state": {"running": {"startedAt": when}}
                if running
                else {"waiting": {"reason": "ContainerCreating"}},
            }
        ],
    }
    if spec.pod_ip is not None:
        status["podIP"] = spec.pod_ip
        status["podIPs"] = [{"ip": spec.pod_ip}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": dict(spec.labels),
            "annotations": dict(spec.annotations),
        },
        "spec": {
            "containers": [container],
            "nodeName": spec.node_name,
            "restartPolicy": "Always",
            "schedulerName": "default-scheduler",
            "serviceAccountName": "default",
            "terminationGracePeriodSeconds": 30,
        },
        "status": status,
    }


def set_ready(pod: Obj, ready: bool) -> Obj:
    """A copy of `pod` whose Ready and ContainersReady conditions say `ready` (the kubelet's
    readiness probe flipping); the transition time moves only when the status does."""
    out = copy.deepcopy(pod)
    status = "True" if ready else "False"
    for cond in out["status"]["conditions"]:
        if cond["type"] in ("Ready", "ContainersReady") and cond["status"] != status:
            cond["status"] = status
            cond["lastTransitionTime"] = now_rfc3339()
    for cs in out["status"].get("containerStatuses", []):
        cs["ready"] = ready
    return out


def endpoint_slice_object(
    name: str,
    *,
    service: str,
    namespace: str = "default",
    endpoints: list[Obj],
    ports: Mapping[str, int],
    labels: Mapping[str, str] | None = None,
) -> Obj:
    """An EndpointSlice of `service` (the `kubernetes.io/service-name` label ties it to its
    Service). Each endpoint: {"addresses": [ip], "conditions": {"ready", "serving",
    "terminating"}, "targetRef": {"kind": "Pod", "name", "namespace"}, "nodeName"}."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "standin",
                **(labels or {}),
            },
        },
        "addressType": "IPv4",
        "endpoints": copy.deepcopy(endpoints),
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
    }
