"""The OpenAPI document: shipped with the package, served as is, valid OpenAPI 3.1, and in step
with the routes the application registers (both ways)."""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

import aiohttp
import jsonschema_rs  # comes with schemathesis
import pytest
import schemathesis

from router.config import settings_from_mapping
from router.edge.app import create_app
from tests.conftest import sim_cluster

HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def document() -> dict[str, Any]:
    return json.loads(files("router").joinpath("openapi.json").read_bytes())


def documented_routes() -> set[tuple[str, str]]:
    return {
        (method.upper(), path)
        for path, item in document()["paths"].items()
        for method in item
        if method in HTTP_METHODS
    }


def registered_routes() -> set[tuple[str, str]]:
    """(method, path template) of every route `create_app` registers; aiohttp's automatic HEAD
    beside each GET is not a route of ours."""
    app = create_app(settings_from_mapping({"model": "llama-3-8b"}))
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }


def test_document_is_valid_openapi_3_1() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1.")
    schemathesis.openapi.from_dict(doc).validate()  # the OpenAPI 3.1 meta-schema
    # The meta-schema leaves the JSON Schemas inside unchecked: check each against 2020-12.
    for name, schema in doc["components"]["schemas"].items():
        try:
            jsonschema_rs.meta.validate(schema)
        except jsonschema_rs.ValidationError as exc:
            pytest.fail(f"components.schemas.{name}: {exc}")


def test_every_registered_route_is_documented() -> None:
    missing = registered_routes() - documented_routes()
    assert not missing, f"routes missing from router/openapi.json: {sorted(missing)}"


def test_every_documented_route_is_registered() -> None:
    stale = documented_routes() - registered_routes()
    assert not stale, f"documented routes the app does not serve: {sorted(stale)}"


def test_error_statuses_use_the_openai_error_schema() -> None:
    doc = document()
    shared = doc["components"]["responses"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for status, resp in op["responses"].items():
                if status.startswith(("4", "5")) and path not in ("/health", "/ready"):
                    resp = shared[resp["$ref"].rsplit("/", 1)[1]] if "$ref" in resp else resp
                    schema = resp["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)


async def test_served_document_equals_the_file(redis_prefix: str) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix) as cluster,
        aiohttp.ClientSession() as session,
        session.get(cluster.router_url + "/openapi.json") as resp,
    ):
        assert resp.status == 200
        assert resp.content_type == "application/json"
        assert await resp.read() == files("router").joinpath("openapi.json").read_bytes()
