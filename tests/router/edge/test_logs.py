"""Structured logs: JSON lines, the request id on every line of a request, no secret shown."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from router.config import settings_from_mapping
from router.logs import configure_logging, secrets_of
from tests.conftest import MODEL, sim_cluster

CHAT = "/v1/chat/completions"
CLIENT_KEY = "client-key-7f3a9c"
ADMIN_TOKEN = "admin-token-51be02"
WORKER_KEY = "worker-key-c0ffee"
REDIS_PASSWORD = "redis-pw-d00dfeed"


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, list[str]]]:
    """The root logger's output as the CLI sets it up (JSON, DEBUG), restored afterwards."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    out = io.StringIO()
    secrets = [CLIENT_KEY, ADMIN_TOKEN, WORKER_KEY, REDIS_PASSWORD]
    handler = configure_logging("DEBUG", "json", secrets=secrets, stream=out)
    try:
        yield out, secrets
    finally:
        root.removeHandler(handler)
        for h in before:
            root.addHandler(h)
        root.setLevel(level)


def test_secrets_of_settings_finds_every_secret() -> None:
    settings = settings_from_mapping(
        {
            "model": MODEL,
            "store": {"url": f"redis://user:{REDIS_PASSWORD}@127.0.0.1:6379/0"},
            "auth": {"api_keys": [CLIENT_KEY], "admin_token": ADMIN_TOKEN},
            "workers": [
                {
                    "id": "d0",
                    "url": "http://h:1",
                    "role": "decode",
                    "kv_blocks": 8,
                    "api_key": WORKER_KEY,
                }
            ],
        }
    )
    assert set(secrets_of(settings)) == {CLIENT_KEY, ADMIN_TOKEN, WORKER_KEY, REDIS_PASSWORD}


async def test_a_request_logs_json_with_its_id_and_no_secret(
    captured: tuple[io.StringIO, list[str]],
) -> None:
    out, secrets = captured
    async with (
        sim_cluster(
            redis_prefix=None,
            auth={"api_keys": [CLIENT_KEY], "admin_token": ADMIN_TOKEN},
        ) as cluster,
        aiohttp.ClientSession() as s,
    ):
        headers = {"Authorization": f"Bearer {CLIENT_KEY}", "X-Request-Id": "req-logs-1"}
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "log me"}],
            "max_tokens": 4,
        }
        async with s.post(cluster.router_url + CHAT, json=body, headers=headers) as r:
            assert r.status == 200
        # Whatever a line says, however a secret got into it, it is scrubbed.
        log = logging.getLogger("router.test")
        log.warning("worker key %s, header Authorization: Bearer %s", WORKER_KEY, "tok-abc123")
        log.warning("store at redis://:%s@10.0.0.1:6379/0", REDIS_PASSWORD)
    text = out.getvalue()
    for secret in [*secrets, "tok-abc123"]:
        assert secret not in text
    lines = [orjson.loads(line) for line in text.splitlines()]  # every line is one JSON object
    assert all({"time", "level", "logger", "message", "request_id"} <= set(r) for r in lines)
    mine = [r for r in lines if r["request_id"] == "req-logs-1"]
    messages = [r["message"] for r in mine]
    assert any(m.startswith("placed on p0 -> d0") for m in messages), messages
    assert any(m == f"{CHAT} answered 200" for m in messages), messages
    assert all(r["request_id"] == "-" for r in lines if r["logger"] == "router.test")
