"""OpenTelemetry tracing (the optional extra): one request's span tree, and traceparent to
the workers under the router's spans; the router runs without the extra."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import settings_from_mapping
from router.edge.app import create_app
from router.edge.server import serving
from router.tenants import DEFAULT_TENANT
from tests.conftest import MODEL

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

CHAT = "/v1/chat/completions"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


def _traceparent(seen: list[dict[str, Any]]) -> list[str]:
    return [r["headers"].get("traceparent", "") for r in seen]


async def test_one_request_makes_a_span_tree_and_parents_the_workers() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    seen: dict[str, list[dict[str, Any]]] = {"p0": [], "d0": []}
    async with (
        running_worker(
            WorkerConfig(role="prefill", worker_id="p0", model=MODEL, time_scale=500.0)
        ) as p_url,
        running_worker(
            WorkerConfig(
                role="decode", worker_id="d0", model=MODEL, time_scale=500.0, kv_blocks=4096
            )
        ) as d_url,
    ):
        settings = settings_from_mapping(
            {
                "model": MODEL,
                "perf": {"model": MODEL, "gpu": "h100"},
                "tracing": True,
                "workers": [
                    {"id": "p0", "url": p_url, "role": "prefill", "adapter": "sim"},
                    {
                        "id": "d0",
                        "url": d_url,
                        "role": "decode",
                        "adapter": "sim",
                        "kv_blocks": 4096,
                    },
                ],
            }
        )
        app = create_app(settings, tracer_provider=provider)
        async with (
            serving(app, "127.0.0.1", 0, settings.timeouts) as runner,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "trace me"}],
                "max_tokens": 5,
                "stream": True,
            }
            headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}
            async with s.post(url + CHAT, json=body, headers=headers) as r:
                assert r.status == 200
                assert (await r.read()).rstrip().endswith(b"data: [DONE]")
            for wid, wurl in (("p0", p_url), ("d0", d_url)):
                async with s.get(wurl + "/sim/requests") as r:
                    seen[wid] = list(await r.json())

    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {
        "POST /v1/chat/completions",
        "admission",
        "prefill",
        "kv_handoff",
        "decode",
    }, sorted(spans)
    root = spans["POST /v1/chat/completions"]
    # The client's trace continues: the router's span is the child of the client's.
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert root.parent is not None and format(root.parent.span_id, "016x") == CLIENT_PARENT
    times = {n: (sp.start_time or 0, sp.end_time or 0) for n, sp in spans.items()}
    r0, r1 = times["POST /v1/chat/completions"]
    for name in ("admission", "prefill", "kv_handoff", "decode"):
        child = spans[name]
        assert child.parent is not None and child.parent.span_id == root.context.span_id, name
        assert child.context.trace_id == root.context.trace_id
        assert r0 <= times[name][0] <= times[name][1] <= r1, name
    assert times["admission"][1] <= times["prefill"][0]
    assert times["prefill"][1] <= times["kv_handoff"][0]
    assert dict(spans["prefill"].attributes or {})["worker"] == "p0"
    # Whose request waited: an operator filters the admission waits by tenant.
    assert dict(spans["admission"].attributes or {})["tenant"] == DEFAULT_TENANT
    assert dict(spans["decode"].attributes or {})["worker"] == "d0"
    # Each worker got its own leg's span as parent (W3C traceparent), not the client's.
    for wid, leg in (("p0", "prefill"), ("d0", "decode")):
        ctx = spans[leg].context
        want = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
        assert _traceparent(seen[wid]) == [want], (wid, seen[wid])


def test_the_router_runs_without_opentelemetry() -> None:
    """A fresh interpreter in which the extra cannot be imported: the app still builds."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from router.edge.app import create_app\n"
        "from router.config import settings_from_mapping\n"
        "from router.tracing import otel_available\n"
        "assert not otel_available()\n"
        "create_app(settings_from_mapping({'model': 'llama-3-8b', 'tracing': True}))\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
