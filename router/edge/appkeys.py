"""The aiohttp application keys the handlers share, in a module of their own so the route
modules (`router.edge.app`, `router.edge.admin`) read them without importing each other."""

from __future__ import annotations

from aiohttp import web

from router.edge.gateway import Gateway

__all__ = ["GATEWAY"]

GATEWAY = web.AppKey("gateway", Gateway)
