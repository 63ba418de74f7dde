"""OpenTelemetry tracing, optional: `pip install -e '.[otel]'` and `tracing: true`.

One span per request (`POST <route>`, a child of the client's `traceparent` when it sent one)
with children for each step of docs/design.md §2:

    admission    estimate done → decode room reserved (the admission queue's wait included);
                 its `tenant` attribute says whose request waited
    prefill      the prefill leg's POST, to its answer
    kv_handoff   the prefill's answer (KV stranded) → the decode's first event (KV accepted)
    decode       the decode leg, from its POST to the end of the request

The workers get W3C `traceparent`/`tracestate` of their own leg's span, replacing the
client's (which the router forwards unchanged when tracing is off), so a worker's spans hang
under the router's. Without the extra installed, or with `tracing: false`, every call here is
a no-op on a shared null object: the request path pays one attribute lookup per step.

Spans are begun and finished by name rather than as context managers: the KV handoff starts in
the prefill step and ends in the relay, and the two legs of SGLang/Mooncake run at once.

No span carries a secret: string attributes go through `router.redact.scrub` (URL credentials,
Authorization values), and an error's status says only its exception's type.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from router.redact import scrub

__all__ = ["Tracing", "RequestTrace", "otel_available", "configure_sdk"]

log = logging.getLogger(__name__)

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Status, StatusCode
except ImportError:  # the extra is not installed: tracing stays off
    trace = None  # type: ignore[assignment]


def otel_available() -> bool:
    return trace is not None


class RequestTrace:
    """The spans of one request. This base class is the no-op one."""

    __slots__ = ()

    def begin(self, name: str, **attributes: Any) -> None:
        return None

    def finish(self, name: str) -> None:
        return None

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[None]:
        yield

    def event(self, name: str, **attributes: Any) -> None:
        """Something that happened to the request (a preemption), on its root span."""
        return None

    def inject(self, headers: dict[str, str], leg: str) -> None:
        return None

    def close(self, status: int) -> None:
        return None


_NULL = RequestTrace()


def _scrubbed(attributes: dict[str, Any]) -> dict[str, Any]:
    """Ids and counts pass as they are; a string that could hold a URL or a header is scrubbed
    (one `in` test per string attribute: the request path pays nothing more)."""
    for key, value in attributes.items():
        if isinstance(value, str) and ("://" in value or " " in value):
            attributes[key] = scrub(value)
    return attributes


class _OtelTrace(RequestTrace):
    __slots__ = ("_tracer", "_root", "_root_ctx", "_open")

    def __init__(self, tracer: Any, name: str, parent: Any, attributes: dict[str, Any]) -> None:
        self._tracer = tracer
        self._root = tracer.start_span(
            name, context=parent, kind=trace.SpanKind.SERVER, attributes=_scrubbed(attributes)
        )
        self._root_ctx = trace.set_span_in_context(self._root)
        self._open: dict[str, Any] = {}

    def begin(self, name: str, **attributes: Any) -> None:
        self.finish(name)  # a retried leg: the failed attempt's span ends here
        self._open[name] = self._tracer.start_span(
            name, context=self._root_ctx, attributes=_scrubbed(attributes)
        )

    def finish(self, name: str) -> None:
        span = self._open.pop(name, None)
        if span is not None:
            span.end()

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[None]:
        self.begin(name, **attributes)
        try:
            yield
        except BaseException as exc:
            span = self._open.get(name)
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            self.finish(name)

    def event(self, name: str, **attributes: Any) -> None:
        self._root.add_event(name, attributes=_scrubbed(attributes))

    def inject(self, headers: dict[str, str], leg: str) -> None:
        span = self._open.get(leg, self._root)
        headers.pop("traceparent", None)
        headers.pop("tracestate", None)
        propagate.inject(headers, context=trace.set_span_in_context(span))

    def close(self, status: int) -> None:
        for name in list(self._open):
            self.finish(name)
        self._root.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._root.set_status(Status(StatusCode.ERROR))
        self._root.end()


class Tracing:
    """Makes each request's `RequestTrace`: real spans when enabled and installed."""

    def __init__(self, enabled: bool, tracer_provider: Any = None) -> None:
        self.enabled = enabled and otel_available()
        if enabled and not otel_available():
            log.warning(
                "tracing: true, but OpenTelemetry is not installed "
                "(pip install 'disagg-router[otel]'): tracing stays off"
            )
        self._tracer = None
        if self.enabled:
            provider = tracer_provider or trace.get_tracer_provider()
            self._tracer = provider.get_tracer("disagg-router")

    def __repr__(self) -> str:
        return f"Tracing(enabled={self.enabled})"

    def request(self, route: str, headers: Mapping[str, str], request_id: str) -> RequestTrace:
        if self._tracer is None:
            return _NULL
        parent = propagate.extract(headers)
        return _OtelTrace(
            self._tracer,
            f"POST {route}",
            parent,
            {"http.request.method": "POST", "http.route": route, "request.id": request_id},
        )


def configure_sdk(service_name: str = "disagg-router", exporter: str = "") -> None:
    """The process entry's setup when tracing is on: an SDK provider exporting by OTLP when
    the exporter package is installed (its endpoint from the standard OTEL_EXPORTER_OTLP_*
    variables), or to stdout when `exporter` is "console" (the entry passes the standard
    OTEL_TRACES_EXPORTER: for a look at the spans without a collector). A provider set up
    already (e.g. by `opentelemetry-instrument`) is kept."""
    if trace is None:
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError:
        log.warning("tracing: the OpenTelemetry SDK is not installed: spans are not exported")
        return
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter.strip().lower() == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        trace.set_tracer_provider(provider)
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning(
            "tracing: no OTLP exporter installed (opentelemetry-exporter-otlp-proto-http):"
            " spans are propagated to the workers but not exported"
        )
    else:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
