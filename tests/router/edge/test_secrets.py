"""No secret is ever printed: the router run as a real process with a distinct secret in every
field, exercised, and every byte it put out searched for each of them.

The secrets: the Redis URL's password (a private `redis-server --requirepass`), the admin token
and the read-only one, two client API keys, two workers' API keys, the passwords in the URLs of
three workers (one serving, one dead, one answering 500) and of the workers registered through
the admin API. The outputs searched: stdout (the start-up line, the console span exporter's
traces), stderr (the JSON logs, at DEBUG), every admin answer, /metrics, every error body and
answer header. The unit tests below pin the masking rule and the log paths one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
from openai import AsyncOpenAI

from disagg_tools.sim.faults import FaultConfig
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.logs import configure_logging, secrets_of
from router.redact import Redactor, mask_url
from router.worker_spec import Secret
from tests.conftest import MODEL, free_port
from tests.redis_cluster import die_with_parent

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "say something"}]


def _secret(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:12]}"


SECRETS = {
    name: _secret(name)
    for name in (
        "redis-pw",
        "admin-token",
        "admin-read-token",
        "client-key-a",
        "client-key-b",
        "prefill-worker-key",
        "decode-worker-key",
        "serving-url-pw",
        "dead-url-pw",
        "failing-url-pw",
        "registered-url-pw",
        "registered-key",
        "bad-url-pw",
        "discover-url-pw",
    )
}


def _with_userinfo(url: str, user: str, password: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{user}:{password}@{rest}"


@contextlib.contextmanager
def _redis_with_password(password: str) -> Iterator[int]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no", "--requirepass", password],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    try:
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def _wait_redis(port: int, password: str) -> None:
    client = aioredis.Redis(host="127.0.0.1", port=port, password=password)
    try:
        for _ in range(200):
            with contextlib.suppress(OSError, aioredis.ConnectionError):
                if await client.ping():
                    return
            await asyncio.sleep(0.05)
        raise AssertionError("the private redis-server did not come up")
    finally:
        await client.aclose()


def _router_argv(*args: str) -> list[str]:
    script = Path(sys.executable).parent / "disagg-router"
    if script.exists():
        return [str(script), "serve", *args]
    entry = "from router.edge.serve_cli import main; raise SystemExit(main())"
    return [sys.executable, "-c", entry, "serve", *args]


@contextlib.asynccontextmanager
async def _router(config: Path, out: Path, err: Path) -> AsyncIterator[None]:
    env = {
        **os.environ,
        "DISAGG_ROUTER_LOG_LEVEL": "DEBUG",
        "OTEL_TRACES_EXPORTER": "console",  # spans on stdout, searched like the rest
    }
    with out.open("wb") as o, err.open("wb") as e:
        proc = await asyncio.create_subprocess_exec(
            *_router_argv("--config", str(config), "--log-format", "json"),
            stdout=o,
            stderr=e,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env=env,
        )
    try:
        yield
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()


class Seen:
    """Everything the router answered, by where it came from, for the search at the end."""

    def __init__(self) -> None:
        self.outputs: list[tuple[str, str]] = []

    async def call(
        self, s: aiohttp.ClientSession, method: str, url: str, token: str | None = None, **kw: Any
    ) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with s.request(method, url, headers=headers, **kw) as r:
            text = await r.text()
            self.outputs.append((f"{method} {url} -> {r.status}", f"{dict(r.headers)} {text}"))
            return r.status, text


async def _wait_ready(s: aiohttp.ClientSession, base: str, err: Path) -> None:
    for _ in range(300):
        with contextlib.suppress(aiohttp.ClientError):
            async with s.get(base + "/ready") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.1)
    tail = (await asyncio.to_thread(err.read_text))[-3000:]
    raise AssertionError(f"the router never became ready:\n{tail}")


async def _exercise(s: aiohttp.ClientSession, base: str, seen: Seen, dead: str) -> None:
    key, admin = SECRETS["client-key-a"], SECRETS["admin-token"]
    # Requests that succeed (some retried off the dead and the failing workers first).
    async with AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30) as ai:
        answers = 0
        for i in range(8):
            with contextlib.suppress(Exception):
                if i % 2:
                    stream = await ai.chat.completions.create(
                        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True
                    )
                    async for _ in stream:
                        pass
                else:
                    await ai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
                answers += 1
        assert answers, "no request was answered"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    await seen.call(s, "POST", base + CHAT, "wrong-" + key, json=body)
    await seen.call(s, "POST", base + CHAT, None, json=body)
    await seen.call(s, "POST", base + CHAT, key, data=b"{not json")
    await seen.call(s, "POST", base + CHAT, key, json={**body, "model": "no-such-model"})
    await seen.call(s, "POST", base + CHAT, SECRETS["client-key-b"], json={**body, "messages": 3})
    for path in ("/admin/state", "/admin/workers", "/admin/scaling", "/admin/roles"):
        for token in (admin, SECRETS["admin-read-token"], key, None):
            await seen.call(s, "GET", base + path, token)
    registration = {
        "id": "r0",
        "url": _with_userinfo(dead, "ruser", SECRETS["registered-url-pw"]),
        "role": "decode",
        "adapter": "sim",
        "kv_blocks": 64,
    }
    with_key = {**registration, "id": "r1", "url": dead, "api_key": SECRETS["registered-key"]}
    workers = base + "/admin/workers"
    await seen.call(s, "POST", workers, "wrong-" + admin, json=registration)
    for entry in (registration, with_key):
        status, text = await seen.call(s, "POST", workers, admin, json=entry)
        assert status == 201, text
    refused = [
        {**registration, "id": "r2", "url": f"ftp://buser:{SECRETS['bad-url-pw']}@h:1"},
        {**with_key, "id": "r3", "url": registration["url"]},  # a key and URL credentials
        {
            **registration,
            "id": "r4",
            "url": _with_userinfo(dead, "duser", SECRETS["discover-url-pw"]),
            "discover_layout": True,
        },
    ]
    for entry in refused:
        status, text = await seen.call(s, "POST", workers, admin, json=entry)
        assert status == 400, text
    await seen.call(s, "GET", workers, admin)
    await seen.call(s, "POST", workers + "/d0/drain", admin)
    await seen.call(s, "POST", workers + "/d0/undrain", admin)
    await seen.call(s, "POST", workers + "/d0/role", admin, json={"role": "prefill"})
    await seen.call(s, "DELETE", workers + "/r0", admin)
    await seen.call(s, "DELETE", workers + "/r1", admin)
    await seen.call(s, "GET", base + "/metrics", None)
    await seen.call(s, "GET", base + "/metrics", admin)


async def test_no_secret_in_anything_the_router_process_prints(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with _redis_with_password(SECRETS["redis-pw"]) as redis_port:
        await _wait_redis(redis_port, SECRETS["redis-pw"])
        async with contextlib.AsyncExitStack() as stack:

            async def worker(wid: str, role: str, **kw: Any) -> str:
                cfg = WorkerConfig(role=role, worker_id=wid, model=MODEL, time_scale=100.0, **kw)
                return await stack.enter_async_context(running_worker(cfg))

            p0, d0 = await worker("p0", "prefill"), await worker("d0", "decode")
            d1 = await worker("d1", "decode")
            d3 = await worker("d3", "decode", faults=FaultConfig(error_rate=1.0))
            decode = {"role": "decode", "adapter": "sim", "kv_blocks": 4096}
            settings: dict[str, Any] = {
                "model": MODEL,
                "server": {"port": free_port()},
                "store": {"url": f"redis://default:{SECRETS['redis-pw']}@127.0.0.1:{redis_port}/0"},
                "auth": {
                    "api_keys": [SECRETS["client-key-a"], SECRETS["client-key-b"]],
                    "admin_token": SECRETS["admin-token"],
                },
                "loops": {"health_interval_s": 0.2},
                "tracing": True,
                "workers": [
                    {"id": "p0", "url": p0, "role": "prefill", "adapter": "sim"}
                    | {"api_key": SECRETS["prefill-worker-key"]},
                    {"id": "d0", "url": d0, **decode, "api_key": SECRETS["decode-worker-key"]},
                    {"id": "d1", "url": _with_userinfo(d1, "wuser", SECRETS["serving-url-pw"])}
                    | decode,
                    {"id": "d2", "url": _with_userinfo(dead, "xuser", SECRETS["dead-url-pw"])}
                    | decode,
                    {"id": "d3", "url": _with_userinfo(d3, "fuser", SECRETS["failing-url-pw"])}
                    | decode,
                ],
            }
            settings["auth"]["admin_read_token"] = SECRETS["admin-read-token"]
            config, out, err = tmp_path / "router.yaml", tmp_path / "out", tmp_path / "err"
            config.write_text(yaml.safe_dump(settings))
            base, seen = f"http://127.0.0.1:{settings['server']['port']}", Seen()
            async with aiohttp.ClientSession() as s:
                async with asyncio.timeout(90):
                    async with _router(config, out, err):
                        await _wait_ready(s, base, err)
                        await _exercise(s, base, seen, dead)
                    sent = {}
                    for wid, url in (("p0", p0), ("d0", d0)):
                        async with s.get(url + "/sim/requests") as r:
                            sent[wid] = [q["headers"] for q in await r.json()]
    stdout, stderr = out.read_text(), err.read_text()
    outputs = [("stdout", stdout), ("stderr", stderr), *seen.outputs]
    leaks = [
        f"{name} in {where}"
        for name, secret in SECRETS.items()
        for where, text in outputs
        if secret in text
    ]
    assert not leaks, leaks
    # The searches looked at real output: the start-up line, spans, JSON logs, masked URLs.
    assert f"state=redis://default:***@127.0.0.1:{redis_port}/0" in stdout, stdout[:2000]
    assert '"name": "POST /v1/chat/completions"' in stdout, "no span was exported"
    logs = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert any(rec.get("level") == "WARNING" for rec in logs), stderr[-3000:]
    assert any("wuser:***@127.0.0.1" in text for _, text in seen.outputs)
    # The workers still got their real keys: masked when printed, sent as they are.
    for wid, name in (("p0", "prefill-worker-key"), ("d0", "decode-worker-key")):
        auth = {h.get("Authorization") or h.get("authorization") for h in sent[wid]}
        assert auth and auth <= {f"Bearer {SECRETS[name]}"}, (wid, auth)


def test_a_redis_url_that_fails_at_start_up_is_told_masked(tmp_path: Path) -> None:
    """redis-py reads a password with an unescaped '#' as the port, and its error quoted it:
    Python's traceback printed the password. The router says one masked line instead."""
    password = _secret("start-pw")
    for url in (f"redis://u:{password}#x@127.0.0.1:1/0", f"redis://u:{password}@127.0.0.1:1/0"):
        argv = _router_argv("--redis-url", url, "--port", "0")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 1, done
        assert password not in done.stdout + done.stderr, done.stderr
        assert "redis://u:***@127.0.0.1:1/0" in done.stderr, done.stderr


async def test_the_launcher_tells_its_redis_masked(tmp_path: Path) -> None:
    from disagg_tools.launcher.localcluster import ClusterShape, LocalCluster, _start_redis

    cluster = LocalCluster(ClusterShape(), workdir=tmp_path)
    await _start_redis(cluster, "redis://:launch-pw-8@127.0.0.1:6379/0")
    assert cluster.redis_note == "Redis at REDIS_URL (redis://:***@127.0.0.1:6379/0)"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://default:pw@127.0.0.1:6379/0", "redis://default:***@127.0.0.1:6379/0"),
        ("rediss://:pw@h:6380/0", "rediss://:***@h:6380/0"),
        ("redis://h/0?password=pw&db=2", "redis://h/0?password=***&db=2"),
        ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
        ("unix://u:pw@/run/r.sock?password=x", "unix://u:***@/run/r.sock?password=***"),
        ("https://TOKEN@host/x", "https://***@host/x"),
        ("http://h/p?api_key=K&x=1#access_token=T", "http://h/p?api_key=***&x=1#access_token=***"),
        ("redis://u:p#w@h:6379", "redis://u:***@h:6379"),  # '#' in a password, unescaped
        ("http://u:pa/ss@h/0", "http://u:***@h/0"),
        ("http://[::1", "http://[::1"),  # malformed: no exception
        ("redis+cluster://u:p@h1:1,h2:2/0", "redis+cluster://u:***@h1:1,h2:2/0"),
        ("", ""),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_a_secret_never_prints_but_sends_its_value() -> None:
    s = Secret("tok-12345")
    printed = {repr(s), str(s), f"{s}", f"{s:>3}", "%s" % s, "{}".format(s)}  # noqa: UP031, UP032
    assert printed == {
        "Secret('***')",
        "***",
    }
    assert s == "tok-12345" and s.reveal() == "tok-12345" and type(s.reveal()) is str
    assert Redactor([s])("a tok-12345 b") == "a *** b"


def test_a_logged_traceback_is_scrubbed_in_json() -> None:
    """The JSON formatter formats exc_info itself: the filter's scrubbed text must be what
    it shows, not the raw exception (a URL's password, a header's key)."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    out = io.StringIO()
    handler = configure_logging("DEBUG", "json", secrets=["known-secret-1"], stream=out)
    try:
        try:
            raise ValueError("at redis://u:url-pw-99@h/0 with Basic dTpwdzEyMw== known-secret-1")
        except ValueError:
            logging.getLogger("t").exception("failed", extra={"where": "http://a:extra-pw@h"})
    finally:
        root.removeHandler(handler)
        for h in before:
            root.addHandler(h)
        root.setLevel(level)
    text = out.getvalue()
    assert "ValueError" in text and "u:***@h" in text
    for secret in ("url-pw-99", "dTpwdzEyMw==", "known-secret-1", "extra-pw"):
        assert secret not in text, text


def test_a_worker_with_a_key_and_url_credentials_is_refused() -> None:
    """Both become an Authorization header: aiohttp refused every request to it (a 500)."""
    from router.config import ConfigError, settings_from_mapping

    worker = {"id": "d0", "url": "http://u:url-pw-6@h:1", "role": "decode", "kv_blocks": 8}
    with pytest.raises(ConfigError, match="cannot both be given") as err:
        settings_from_mapping({"model": MODEL, "workers": [{**worker, "api_key": "key-7777"}]})
    assert "url-pw-6" not in str(err.value) and "key-7777" not in str(err.value)


def test_the_settings_know_their_secrets_and_never_show_them() -> None:
    from router.config import settings_from_mapping

    worker = {"id": "d0", "url": "http://u:url-pw-2@h:1", "role": "decode", "kv_blocks": 8}
    settings = settings_from_mapping(
        {
            "model": MODEL,
            "store": {"url": "redis://h:6379/0?password=query-pw-1"},
            "auth": {"api_keys": ["client-key-3"], "admin_token": "admin-token-4"},
            "workers": [
                worker,
                {**worker, "id": "d1", "url": "http://h:2", "api_key": "worker-key-5"},
            ],
        }
    )
    secrets = {"query-pw-1", "url-pw-2", "client-key-3", "admin-token-4", "worker-key-5"}
    assert secrets <= set(secrets_of(settings))
    shown = f"{settings!r} {settings} {settings.workers[0]!r}"
    assert "redis://h:6379/0?password=***" in shown and "u:***@h:1" in shown
    assert not [s for s in secrets if s in shown], shown


def test_a_secret_made_from_a_secret_keeps_its_value() -> None:
    """The environment's parser makes a Secret and the auth group wraps it again: before, the
    second Secret took the first's mask, and an admin token from the environment was '***'."""
    from router.config import load_settings
    from router.worker_spec import Secret

    assert Secret(Secret("abc")).reveal() == "abc"
    settings = load_settings(None, env={"DISAGG_ROUTER_AUTH_ADMIN_TOKEN": "abc"})
    assert settings.auth.admin_token.reveal() == "abc"
    assert str(settings.auth.admin_token) == "***"
