"""Kubernetes discovery (`discovery.kind: kubernetes`; docs/kubernetes.md): pods by a label
selector per role, listed and watched (listwatch.py) with kubernetes_asyncio (client.py,
imported only when discovery is on), turned into registrations (pods.py) and kept in the
shared registry (discovery.py)."""

from __future__ import annotations

from router.workers.kube.discovery import KubeDiscovery

__all__ = ["KubeDiscovery"]
