"""A kubeconfig for the stand-in: plain HTTP on loopback, no credentials (it checks none)."""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["write_kubeconfig"]


def write_kubeconfig(path: Path, server_url: str, namespace: str = "default") -> Path:
    """Write a kubeconfig whose current context points kubectl (or a client library's config
    loader) at `server_url`; returns `path`."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "standin", "cluster": {"server": server_url}}],
        "users": [{"name": "standin", "user": {}}],
        "contexts": [
            {
                "name": "standin",
                "context": {"cluster": "standin", "user": "standin", "namespace": namespace},
            }
        ],
        "current-context": "standin",
        "preferences": {},
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path
