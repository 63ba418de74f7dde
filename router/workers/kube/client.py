"""The Kubernetes API client: kubernetes_asyncio, imported only when discovery is on.

Why this library: it is the asyncio port of the official Python client (generated from the
same OpenAPI spec, kept in step with Kubernetes releases), built on aiohttp as the router is,
so a watch is one more aiohttp stream on the router's loop, not a thread; it loads both the
in-cluster configuration (the pod's service-account token, refreshed as the kubelet rotates
it) and kubeconfig files (with their exec and token plugins).

Where the credentials come from: `discovery.kubeconfig` when set; else the in-cluster service
account when the router runs in a pod; else $KUBECONFIG or ~/.kube/config.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from router.settings_groups import DiscoverySettings

__all__ = ["ApiCalls", "open_api", "own_namespace"]

log = logging.getLogger(__name__)

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def own_namespace(settings: DiscoverySettings) -> str:
    """The namespace watched: the setting, else the router pod's own, else `default`."""
    if settings.namespace:
        return settings.namespace
    try:
        return _SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class ApiCalls:
    """The two list functions discovery needs, for one namespace, and the client to close."""

    def __init__(self, client: Any, namespace: str) -> None:
        from kubernetes_asyncio import client as k8s

        self.client = client
        self.namespace = namespace
        self._core = k8s.CoreV1Api(client)
        self._discovery = k8s.DiscoveryV1Api(client)

    async def pods(self, **kw: Any) -> Any:
        return await self._core.list_namespaced_pod(self.namespace, **kw)

    async def endpoint_slices(self, **kw: Any) -> Any:
        return await self._discovery.list_namespaced_endpoint_slice(self.namespace, **kw)

    async def close(self) -> None:
        await self.client.close()


async def open_api(settings: DiscoverySettings) -> ApiCalls:
    """An authenticated client for the namespace watched (ConfigException when no
    configuration is found)."""
    from kubernetes_asyncio import client as k8s
    from kubernetes_asyncio import config

    configuration = k8s.Configuration()
    if settings.kubeconfig:
        await config.load_kube_config(
            config_file=settings.kubeconfig, client_configuration=configuration
        )
        source = settings.kubeconfig
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            source = "the in-cluster service account"
        except config.ConfigException:
            await config.load_kube_config(client_configuration=configuration)
            source = "the default kubeconfig"
    namespace = own_namespace(settings)
    log.info("kubernetes discovery: %s at %s, namespace %s", source, configuration.host, namespace)
    return ApiCalls(k8s.ApiClient(configuration), namespace)
