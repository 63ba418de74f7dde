"""No tenant key is ever anywhere in plain text (issue 25's security target): a router with tenants
whose keys are in its configuration, and keys made and rotated through the admin API, is used
with every key, right and wrong, and everything it put out is searched for each of them.

The keys: two configured plainly (one with an id, one without), one of the old `api_keys`, two
made through the admin API, one of them rotated (both the made key and its successor), and a
wrong one. Each is sent as `Authorization: Bearer` (the only place the router takes a client
key: router/edge/auth.py) and in places it does not take one (another scheme, no scheme,
`X-Api-Key`, `api-key`, the query string), to the generation routes, a passthrough route, the
admin API (reads and writes) and `/metrics` (not public here, so it takes a key too); the
revoked and the rotated-out keys are refused. A second replica on the same store takes requests
too, after it adopted the changes (that it does so within one `registry_refresh_s` is
tests/router/edge/test_tenant_keys_shared.py's).

What is searched, and how each channel is shown to be read (a search that finds nothing because
it read nothing would pass by accident): each channel gets a control that carries the keys
through the same collection and must be found by the same search.

    logs       every record of every logger at DEBUG, as logged (before any redaction) and as
               the production handlers print it, text and JSON (router/logs.py); the router
               has no access log (router/edge/server.py `access_log=None`)
    spans      every span's JSON (attributes, events, status, links, resource), with tracing
               on and an in-memory exporter (OpenTelemetry's SDK: skipped without it)
    answers    every answer's status line, headers and body: /admin (all its GETs, the key
               calls), /metrics, the errors; a create or rotate answer shows its own new key
               once, and no other
    Redis      every key under the test's prefix and every value, read by its type
    workers    what the simulated workers were sent (the router forwards no client key)

The scenario runs once for the module (`material`); each channel is its own test.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import Settings, settings_from_mapping
from router.edge.app import create_app
from router.edge.server import serving
from router.logs import configure_logging, secrets_of
from tests.conftest import MODEL, REDIS_URL, running_router
from tests.redis_dump import delete_prefix, redis_dump

try:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
except ImportError:  # the otel extra is not installed: the spans' test skips, saying so
    TracerProvider = None  # type: ignore[assignment,misc]

CHAT = "/v1/chat/completions"
REFRESH_S = 1.0  # registry_refresh_s
SLACK_S = 2.0  # a loaded CI machine's latency on top of one refresh
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _key(name: str) -> str:
    # Distinct and random per run: no other test's output, nor a stale Redis, can hold one.
    return f"sk-{name}-{uuid.uuid4().hex}"


CFG_A = _key("cfg-a")  # configured plainly, with an id
CFG_B = _key("cfg-b")  # configured plainly, no id (it gets k-<fingerprint>)
OLD = _key("api-keys")  # the old `api_keys` list: the default tenant's
WRONG = _key("wrong")  # never configured
ADMIN = _key("admin-token")
READ = _key("read-token")
TOKENS = {"ADMIN": ADMIN, "READ": READ}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
READ_AUTH = {"Authorization": f"Bearer {READ}"}


@dataclass
class Material:
    """Everything the router put out, by channel, and the keys to search it for."""

    keys: dict[str, str] = field(default_factory=dict)  # name -> the plain key
    answers: list[str] = field(default_factory=list)  # every answer but the new-key ones
    new_key_answers: list[tuple[str, str]] = field(default_factory=list)  # (own key name, text)
    statuses: dict[str, int] = field(default_factory=dict)  # what each probe was answered
    raw_logs: list[str] = field(default_factory=list)
    text_logs: str = ""
    json_logs: str = ""
    log_control: list[str] = field(default_factory=list)
    spans: list[str] | None = None  # None: no OpenTelemetry SDK
    span_control: list[str] = field(default_factory=list)
    redis: list[bytes] = field(default_factory=list)
    redis_control: list[bytes] = field(default_factory=list)
    redis_types: set[str] = field(default_factory=set)
    sent_to_workers: list[str] = field(default_factory=list)


def leaks(keys: dict[str, str], texts: Iterable[str | bytes]) -> list[str]:
    """The names of the keys found in `texts` (each as text and as bytes)."""
    as_text = [t for t in texts if isinstance(t, str)]
    as_bytes = [t for t in texts if isinstance(t, bytes)]
    return [
        name
        for name, key in keys.items()
        if any(key in t for t in as_text) or any(key.encode() in t for t in as_bytes)
    ]


# -- the collectors ----------------------------------------------------------------------------


class _RawRecords(logging.Handler):
    """Every record as its call site made it: the message with its arguments and the
    traceback, before any filter (router/logs.py's `_Redact` rewrites records in place, so
    this handler is the root logger's first)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except (TypeError, ValueError):
            text = f"{record.msg!r} % {record.args!r}"
        parts = [record.name, text, repr(record.args)]
        if record.exc_info:
            parts.append(logging.Formatter().formatException(record.exc_info))
        parts += [str(v) for k, v in record.__dict__.items() if k not in _PLAIN_FIELDS]
        self.texts.append(" ".join(parts))


_PLAIN_FIELDS = frozenset(logging.makeLogRecord({}).__dict__) | {"message"}


@contextlib.contextmanager
def _logs_captured(settings: Settings) -> Iterator[tuple[_RawRecords, io.StringIO, io.StringIO]]:
    """Every logger at DEBUG into the raw collector and the production handlers, text and JSON
    (configured as the process entry does, router/edge/serve_cli.py); the root logger as it was
    afterwards."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    text, as_json = io.StringIO(), io.StringIO()
    try:
        text_handler = configure_logging("DEBUG", "text", secrets=secrets_of(settings), stream=text)
        json_handler = configure_logging(
            "DEBUG", "json", secrets=secrets_of(settings), stream=as_json
        )
        raw = _RawRecords()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in (raw, *saved_handlers, text_handler, json_handler):
            root.addHandler(handler)
        yield raw, text, as_json
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)


async def _redis_dump(prefix: str, types: set[str]) -> list[bytes]:
    return await redis_dump(REDIS_URL, prefix, types)


async def _redis_control(prefix: str, keys: dict[str, str], types: set[str]) -> list[bytes]:
    """The keys written under `prefix` in a value of every type, and read back by
    `_redis_dump`: the search of Redis reads what it must."""
    client = aioredis.from_url(REDIS_URL)
    joined = " ".join(keys.values())
    try:
        await client.set(prefix + "s", f"x{joined}x")
        await client.hset(prefix + "h", mapping={"f": f"x{joined}x"})
        await client.sadd(prefix + "set", f"x{joined}x")
        await client.zadd(prefix + "z", {f"x{joined}x": 1.0})
        await client.rpush(prefix + "l", f"x{joined}x")
        await client.xadd(prefix + "x", {"f": f"x{joined}x"})
        return await _redis_dump(prefix, types)
    finally:
        await client.aclose()
        await delete_prefix(REDIS_URL, prefix)


# -- the scenario ------------------------------------------------------------------------------


def _settings(prefix: str, p_url: str, d_url: str, tracing: bool) -> Settings:
    return settings_from_mapping(
        {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "store": {"url": REDIS_URL, "key_prefix": prefix},
            "loops": {
                "health_interval_s": 0.5,
                "state_refresh_s": 0.05,
                "registry_refresh_s": REFRESH_S,
            },
            "auth": {
                "api_keys": [OLD],
                "admin_token": ADMIN,
                "admin_read_token": READ,
                "public_metrics": False,  # so /metrics takes a client key too
            },
            "workers": [
                {"id": "p0", "url": p_url, "role": "prefill", "adapter": "sim"},
                {"id": "d0", "url": d_url, "role": "decode", "adapter": "sim", "kv_blocks": 4096},
            ],
            "tenants": [
                {"name": "a", "weight": 2, "keys": [{"id": "a-cfg", "key": CFG_A}]},
                {"name": "b", "keys": [CFG_B]},
            ],
            "tracing": tracing,
        }
    )


@contextlib.asynccontextmanager
async def _workers() -> AsyncIterator[tuple[str, str]]:
    """A prefill and a decode simulated worker: their URLs."""
    time_scale = 500.0
    async with (
        running_worker(
            WorkerConfig(role="prefill", worker_id="p0", model=MODEL, time_scale=time_scale)
        ) as p_url,
        running_worker(
            WorkerConfig(
                role="decode",
                worker_id="d0",
                model=MODEL,
                time_scale=time_scale,
                kv_blocks=4096,
                kv_lease_s=30.0 * time_scale,
            )
        ) as d_url,
    ):
        yield p_url, d_url


@contextlib.asynccontextmanager
async def _replicas(settings: Settings, tracer_provider: Any) -> AsyncIterator[tuple[str, str]]:
    """Replica A (traced into `tracer_provider`) and B, on one store: their URLs."""
    app = create_app(settings, tracer_provider=tracer_provider)
    async with (
        serving(app, "127.0.0.1", 0, settings.timeouts) as runner,
        running_router(settings) as (b_url, _),
    ):
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", b_url


class _Client:
    """Sends the probes, keeps every answer as text."""

    def __init__(self, session: aiohttp.ClientSession, found: Material) -> None:
        self.session, self.found = session, found

    async def call(
        self,
        label: str,
        method: str,
        url: str,
        headers: dict[str, str] | None = None,
        body: Any = None,
        *,
        new_key: str = "",
    ) -> dict[str, Any]:
        """The answer's JSON ({} when it is not); `new_key`: the answer shows that key."""
        kwargs: dict[str, Any] = {"headers": headers or {}}
        if body is not None:
            kwargs["json"] = body
        async with self.session.request(method, url, **kwargs) as r:
            data = await r.read()
            head = "".join(f"{k}: {v}\n" for k, v in r.headers.items())
            text = f"{r.status} {r.reason}\n{head}\n{data.decode(errors='replace')}"
            self.found.statuses[label] = r.status
        if new_key:
            self.found.new_key_answers.append((new_key, text))
        else:
            self.found.answers.append(text)
        try:
            answer = json.loads(data)
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {}

    async def chat(
        self, label: str, url: str, headers: dict[str, str], stream: bool = False
    ) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "stream": stream,
        }
        # A client's trace context: the router's spans hang under it.
        headers = {**headers, "traceparent": TRACEPARENT}
        await self.call(label, "POST", url + CHAT, headers, body)
        return self.found.statuses[label]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _until(check: Any, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "not within one refresh"
        await asyncio.sleep(0.05)


async def _use_every_key(c: _Client, a: str, b: str) -> None:
    """Every key, everywhere a key goes (and some places it does not), on both replicas."""
    keys = c.found.keys
    for name in ("CFG_A", "CFG_B", "OLD"):
        assert await c.chat(f"{name} on A", a, _bearer(keys[name])) == 200
    assert await c.chat("CFG_A streamed", a, _bearer(CFG_A), stream=True) == 200

    # Made through the admin API: the answer shows it once.
    made_a = await c.call(
        "create a", "POST", f"{a}/admin/tenants/a/keys", ADMIN_AUTH, new_key="MADE_A"
    )
    keys["MADE_A"] = made_a["key"]
    made_b = await c.call(
        "create b", "POST", f"{a}/admin/tenants/b/keys", ADMIN_AUTH, new_key="MADE_B"
    )
    keys["MADE_B"] = made_b["key"]
    rotate = f"{a}/admin/tenants/b/keys/{made_b['id']}/rotate"
    keys["ROTATED_B"] = (await c.call("rotate b", "POST", rotate, ADMIN_AUTH, new_key="ROTATED_B"))[
        "key"
    ]
    # CFG_B's id, as the list shows it (k-<fingerprint>), then revoked.
    listed = await c.call("list", "GET", f"{a}/admin/tenants", ADMIN_AUTH)
    b_keys = next(t["keys"] for t in listed["tenants"] if t["name"] == "b")
    cfg_b = next(k["id"] for k in b_keys if k["source"] == "config")
    await c.call("revoke CFG_B", "DELETE", f"{a}/admin/tenants/b/keys/{cfg_b}", ADMIN_AUTH)

    assert await c.chat("MADE_A on A", a, _bearer(keys["MADE_A"])) == 200
    assert await c.chat("ROTATED_B on A", a, _bearer(keys["ROTATED_B"])) == 200
    assert await c.chat("MADE_B (rotated out) on A", a, _bearer(keys["MADE_B"])) == 401
    assert await c.chat("CFG_B (revoked) on A", a, _bearer(CFG_B)) == 401
    assert await c.chat("WRONG on A", a, _bearer(WRONG)) == 401

    # Replica B, once it adopted the table (within one refresh: test_tenant_keys_shared.py).
    async def b_adopted() -> bool:
        return await c.chat("CFG_B (revoked) on B", b, _bearer(CFG_B)) == 401

    await _until(b_adopted, REFRESH_S + SLACK_S)
    assert await c.chat("MADE_A on B", b, _bearer(keys["MADE_A"])) == 200
    assert await c.chat("MADE_B (rotated out) on B", b, _bearer(keys["MADE_B"])) == 401
    assert await c.chat("WRONG on B", b, _bearer(WRONG)) == 401

    # Every key on every route that takes one or refuses one, and in the places the router
    # takes none (refused there: the router is closed).
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for name, key in list(keys.items()):
        for where, headers in (
            ("bearer lower-case", {"Authorization": f"bearer {key}"}),
            ("no scheme", {"Authorization": key}),
            ("Basic", {"Authorization": f"Basic {key}"}),
            ("X-Api-Key", {"X-Api-Key": key}),
            ("api-key", {"api-key": key}),
        ):
            await c.chat(f"{name} as {where}", a, headers)
        await c.call(f"{name} in the query", "POST", f"{a}{CHAT}?api_key={key}", {}, None)
        bearer = _bearer(key)
        await c.call(f"{name} completions", "POST", f"{a}/v1/completions", bearer, completion)
        await c.call(f"{name} tokenize", "POST", f"{a}/tokenize", bearer, completion)
        await c.call(f"{name} models", "GET", f"{a}/v1/models", bearer)
        await c.call(f"{name} metrics", "GET", f"{a}/metrics", bearer)
        await c.call(f"{name} reads admin", "GET", f"{a}/admin/tenants", bearer)
        await c.call(f"{name} writes admin", "POST", f"{a}/admin/tenants/a/keys", bearer)
        # A key pasted where its id goes: a 404 that does not echo it.
        revoke = f"{a}/admin/tenants/a/keys/{key}"
        await c.call(f"{name} as a key id", "DELETE", revoke, ADMIN_AUTH)
    statuses = c.found.statuses
    assert statuses["CFG_A as bearer lower-case"] == 200
    assert statuses["CFG_A as X-Api-Key"] == 401
    assert statuses["CFG_A completions"] == 200
    assert statuses["CFG_A metrics"] == 200 and statuses["WRONG metrics"] == 401
    assert statuses["CFG_A reads admin"] == 403
    assert statuses["CFG_B reads admin"] == 401  # revoked: not a key any more
    assert statuses["ROTATED_B writes admin"] == 403
    assert statuses["MADE_A as a key id"] == 404

    # Everything the admin API and /metrics say, with either token, on both replicas.
    for url in (a, b):
        for auth in (ADMIN_AUTH, READ_AUTH):
            for route in ("tenants", "state", "workers", "scaling", "roles"):
                await c.call(f"{route} on {url}", "GET", f"{url}/admin/{route}", auth)
            await c.call(f"metrics on {url}", "GET", f"{url}/metrics", auth)


async def _scenario(prefix: str) -> Material:
    found = Material(keys={"CFG_A": CFG_A, "CFG_B": CFG_B, "OLD": OLD, "WRONG": WRONG})
    provider = exporter = None
    if TracerProvider is not None:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with _workers() as (p_url, d_url):
        settings = _settings(prefix, p_url, d_url, tracing=provider is not None)
        # From before the replicas start until they have stopped: every line they log.
        with _logs_captured(settings) as (raw, text, as_json):
            async with _replicas(settings, provider) as (a, b), aiohttp.ClientSession() as s:
                await _use_every_key(_Client(s, found), a, b)
                for url in (p_url, d_url):
                    async with s.get(url + "/sim/requests") as r:
                        found.sent_to_workers.append(await r.text())
        found.raw_logs = raw.texts
        found.text_logs, found.json_logs = text.getvalue(), as_json.getvalue()
        # The control: a record that carries the keys, through the same collectors.
        with _logs_captured(settings) as (raw, text, as_json):
            logging.getLogger("tests.control").debug("keys: %s", " ".join(found.keys.values()))
            found.log_control = [*raw.texts, text.getvalue(), as_json.getvalue()]
    if provider is not None and exporter is not None:
        found.spans = [span.to_json() for span in exporter.get_finished_spans()]
        exporter.clear()
        with provider.get_tracer("control").start_as_current_span("control") as span:
            span.set_attribute("control", " ".join(found.keys.values()))
        found.span_control = [span.to_json() for span in exporter.get_finished_spans()]
    found.redis = await _redis_dump(prefix, found.redis_types)
    found.redis_control = await _redis_control(prefix + "control:", found.keys, set())
    return found


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def material() -> AsyncIterator[Material]:
    """The scenario, run once for the module's tests; its Redis keys deleted afterwards."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    try:
        yield await _scenario(prefix)
    finally:
        await delete_prefix(REDIS_URL, prefix)


# -- the tests ---------------------------------------------------------------------------------

ALL_KEYS = {"CFG_A", "CFG_B", "OLD", "WRONG", "MADE_A", "MADE_B", "ROTATED_B"}


def test_every_key_was_used_and_answered_as_it_should(material: Material) -> None:
    assert set(material.keys) == ALL_KEYS
    assert len(set(material.keys.values())) == len(material.keys)
    # Accepted and refused as they should be: _use_every_key asserted each; here the tally.
    statuses = material.statuses
    assert sum(s == 200 for s in statuses.values()) > 10
    assert sum(s == 401 for s in statuses.values()) > 10
    assert not {k: s for k, s in statuses.items() if s >= 500}


def test_no_key_in_the_logs(material: Material) -> None:
    keys = material.keys
    # The control: a record with the keys is found in every collector's output; the printed
    # ones mask the one key they know (`api_keys` are the log redactor's secrets), no other.
    raw, text, as_json = material.log_control
    assert set(leaks(keys, [raw])) == set(keys)
    assert set(leaks(keys, [text])) == set(leaks(keys, [as_json])) == set(keys) - {"OLD"}
    assert len(material.raw_logs) > 50  # the requests' DEBUG lines were read
    assert any("tenant b: key" in t and "rotated" in t for t in material.raw_logs)
    assert material.text_logs and material.json_logs
    assert not leaks(keys, material.raw_logs), "a key in a log record, as logged"
    assert not leaks(keys, [material.text_logs]), "a key in the text log"
    assert not leaks(keys, [material.json_logs]), "a key in the JSON log"
    # The admin tokens are printed nowhere either (they are the logs' configured secrets).
    assert not leaks(TOKENS, [material.text_logs, material.json_logs])


def test_no_key_in_a_span(material: Material) -> None:
    if material.spans is None:
        pytest.skip(
            "OpenTelemetry's SDK is not installed (pip install -e '.[otel]'): spans not searched"
        )
    keys = material.keys
    assert set(leaks(keys, material.span_control)) == set(keys)
    assert any(f'"POST {CHAT}"' in s for s in material.spans), "no request span was recorded"
    assert any('"decode"' in s for s in material.spans)
    assert not leaks(keys | TOKENS, material.spans)


def test_no_key_in_an_answer(material: Material) -> None:
    keys = material.keys
    # The control: a new-key answer shows its own key once, and the search finds it there.
    assert [own for own, _ in material.new_key_answers] == ["MADE_A", "MADE_B", "ROTATED_B"]
    for own, text in material.new_key_answers:
        assert leaks(keys, [text]) == [own], (own, text[:300])
        assert text.count(keys[own]) == 1
    assert any("disagg_router_tenant_requests_total" in t for t in material.answers)
    assert any('"fingerprint"' in t for t in material.answers)
    assert not leaks(keys | TOKENS, material.answers)


def test_no_key_in_redis(material: Material) -> None:
    assert set(leaks(material.keys, material.redis_control)) == set(material.keys)
    assert {"hash", "set"} <= material.redis_types  # the key table and the revoked digests
    assert not leaks(material.keys | TOKENS, material.redis)


def test_no_key_sent_to_a_worker(material: Material) -> None:
    assert len(material.sent_to_workers) == 2 and all(material.sent_to_workers)
    assert not leaks(material.keys | TOKENS, material.sent_to_workers)
