"""The admin API's guard rails and what answers without a key (issue 20), through real HTTP
against the router in front of simulated workers and the real Redis.

- A drain, a role switch or a removal that would leave a pool with no worker in rotation is a
  409 naming the pool and the worker, unless `{"force": true}`; workers out of rotation do
  not count, nor one on its way into the pool (its switch may fail: issue 31).
- The 503 of an empty pool says what each of its workers does instead, with an honest
  Retry-After.
- With client keys configured, the admin GETs need the admin token or the read-only token;
  /metrics and /openapi.json are public or not by a setting; 401 vs 403 as HTTP means them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from router.config import ConfigError, settings_from_mapping
from router.logs import secrets_of
from router.worker_spec import Secret
from tests.conftest import MODEL, REDIS_URL, sim_cluster

CHAT = "/v1/chat/completions"
TOKEN = "guard-admin-token"
READ = "guard-read-token"
CLIENT = "guard-client-key"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
FORCE = {"force": True}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "guard"}], "max_tokens": 4}
# Roles never finish switching within a test (settle_s): a switch stays `draining-to-<role>`.
SLOW_ROLES = {"settle_s": 600.0, "interval_s": 0.2}


async def _post(
    s: aiohttp.ClientSession, url: str, body: Any = None, headers: Any = ADMIN
) -> tuple[int, dict[str, Any]]:
    async with s.post(url, json=body, headers=headers) as r:
        return r.status, dict(await r.json())


async def _chat(s: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any], str | None]:
    async with s.post(url + CHAT, json=BODY) as r:
        return r.status, dict(await r.json()), r.headers.get("Retry-After")


async def test_draining_the_last_decode_worker_is_refused_unless_forced(redis_prefix: str) -> None:
    async with (
        sim_cluster(
            prefill=1, decode=2, redis_prefix=redis_prefix, auth={"admin_token": TOKEN}
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        url = c.router_url + "/admin/workers"
        assert (await _post(s, f"{url}/d0/drain"))[0] == 200
        status, body = await _post(s, f"{url}/d1/drain")
        assert status == 409, body
        err = body["error"]
        assert err["type"] == "conflict_error" and err["code"] == "last_worker_in_rotation"
        assert err["param"] == "force"
        message = err["message"]
        assert "draining d1" in message and f"the decode pool of {MODEL}" in message
        assert "d0 drained by the operator" in message and '"force": true' in message
        assert not c.parts.pools.workers["d1"].drained  # refused: nothing changed

        status, body = await _post(s, f"{url}/d1/drain", {"force": "yes"})
        assert status == 400 and body["error"]["param"] == "force"
        status, body = await _post(s, f"{url}/d1/drain", FORCE)
        assert status == 200 and body["drained"] is True

        # The 503 says why, and a drained pool does not come back by itself: a long retry.
        status, body, retry_after = await _chat(s, c.router_url)
        assert status == 503, body
        assert body["error"]["message"] == (
            "no decode worker is in rotation: "
            "d0 drained by the operator, d1 drained by the operator"
        )
        assert body["error"]["code"] == "no_worker_in_rotation"
        assert retry_after == "30"

        assert (await _post(s, f"{url}/d0/undrain"))[0] == 200
        status, body, _ = await _chat(s, c.router_url)
        assert status == 200, body

        # The only prefill worker: its pool is guarded too.
        status, body = await _post(s, f"{url}/p0/drain")
        assert status == 409 and f"the prefill pool of {MODEL}" in body["error"]["message"]


async def test_workers_out_of_rotation_do_not_count(redis_prefix: str) -> None:
    """d9 is registered but never answers its health probe: d0 is the last decode worker in
    rotation, and the refusal (and the 503 once forced) says what d9 is doing. Draining d9
    itself is fine: it serves nothing."""
    async with (
        sim_cluster(
            prefill=1, decode=1, redis_prefix=redis_prefix, auth={"admin_token": TOKEN}
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        url = c.router_url + "/admin/workers"
        down = {"id": "d9", "url": "http://127.0.0.1:9", "role": "decode", "kv_blocks": 64}
        status, body = await _post(s, url, down)
        assert status == 201 and body["healthy"] is False, body
        status, body = await _post(s, f"{url}/d0/drain")
        assert status == 409, body
        assert "d9 health probe failing" in body["error"]["message"]
        assert (await _post(s, f"{url}/d9/drain"))[0] == 200

        assert (await _post(s, f"{url}/d0/drain", FORCE))[0] == 200
        status, body, retry_after = await _chat(s, c.router_url)
        assert status == 503
        assert body["error"]["message"] == (
            "no decode worker is in rotation: d0 drained by the operator, "
            "d9 drained by the operator and health probe failing"
        )
        assert retry_after == "30"
        assert (await _post(s, f"{url}/d9/undrain"))[0] == 200
        status, body, retry_after = await _chat(s, c.router_url)
        # d9 may come back by itself (its next probe): the retry is a probe interval away.
        assert status == 503 and retry_after == "1", body
        assert body["error"]["message"].endswith("d9 health probe failing")


async def test_removing_the_last_registered_decode_worker_is_refused(redis_prefix: str) -> None:
    async with (
        sim_cluster(
            prefill=1, decode=0, redis_prefix=redis_prefix, auth={"admin_token": TOKEN}
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        url = c.router_url + "/admin/workers"
        # A worker that answers /health: the prefill worker's own address stands in for one.
        entry = {"id": "dn", "url": c.workers["p0"], "role": "decode", "kv_blocks": 64}
        assert (await _post(s, url, entry))[0] == 201
        async with s.delete(f"{url}/dn", headers=ADMIN) as r:
            assert r.status == 409
            message = (await r.json())["error"]["message"]
        assert message.startswith(f"removing dn would leave the decode pool of {MODEL}")
        assert "dn is its only worker" in message
        assert "dn" in c.parts.pools.workers
        async with s.delete(f"{url}/dn", headers=ADMIN, json=FORCE) as r:
            assert r.status == 200
        assert "dn" not in c.parts.pools.workers


async def test_role_switches_are_guarded_and_the_503_names_the_other_role(
    redis_prefix: str,
) -> None:
    """b0 (`both`, no role yet) decodes and prefills its own requests; d0 decodes, p0
    prefills. A switch drains b0 first (in neither pool)."""
    async with (
        sim_cluster(
            prefill=1,
            decode=1,
            both=1,
            redis_prefix=redis_prefix,
            auth={"admin_token": TOKEN},
            roles=SLOW_ROLES,
            admission={"max_wait_s": 0.5},
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        url = c.router_url + "/admin/workers"
        status, body = await _post(s, f"{url}/b0/role", {"role": "prefill"})
        assert status == 200 and body["current_role"] == "draining-to-prefill", body
        # Again: already on its way, nothing changes, nothing refused.
        assert (await _post(s, f"{url}/b0/role", {"role": "prefill"}))[0] == 200

        # d0 is now the last decode worker in rotation: b0 is heading to prefill.
        status, body = await _post(s, f"{url}/d0/drain")
        assert status == 409, body
        assert "b0 draining for a role switch to prefill" in body["error"]["message"]
        status, body = await _post(s, f"{url}/b0/role", {"role": "decode", "force": 1})
        assert status == 400 and body["error"]["param"] == "force"

        # Forced: the 503 says what each decode-capable worker does instead.
        assert (await _post(s, f"{url}/d0/drain", FORCE))[0] == 200
        status, body, retry_after = await _chat(s, c.router_url)
        assert status == 503
        assert body["error"]["message"] == (
            "no decode worker is in rotation: "
            "d0 drained by the operator, b0 draining for a role switch to prefill"
        )
        assert retry_after == "30"  # the static role policy never switches it back

        # b0 on its way back to decode: the pool refills by itself, so a request waits for
        # room (here until its short admission deadline: a 429), it is not failed at once.
        status, body = await _post(s, f"{url}/b0/role", {"role": "decode"})
        assert status == 200 and body["current_role"] == "draining-to-decode", body
        status, body, _ = await _chat(s, c.router_url)
        assert status == 429, body

        # p0 is the last prefill worker (b0 drains to decode): draining it is refused. d0 is
        # still the last decode worker serving: b0, only on its way there, does not count.
        assert (await _post(s, f"{url}/d0/undrain"))[0] == 200
        status, body = await _post(s, f"{url}/p0/drain")
        assert status == 409 and f"the prefill pool of {MODEL}" in body["error"]["message"]
        status, body = await _post(s, f"{url}/d0/drain")
        assert status == 409 and "b0 draining for a role switch to decode" in str(body), body


async def test_switching_the_only_both_worker_is_refused(redis_prefix: str) -> None:
    """b0 alone serves both sides: a switch to decode empties the prefill pool for good (the
    decode pool only while it drains: it is on its way back there)."""
    async with (
        sim_cluster(
            prefill=0,
            decode=0,
            both=1,
            redis_prefix=redis_prefix,
            auth={"admin_token": TOKEN},
            roles=SLOW_ROLES,
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        url = c.router_url + "/admin/workers"
        status, body = await _post(s, f"{url}/b0/role", {"role": "decode"})
        assert status == 409, body
        message = body["error"]["message"]
        assert message.startswith("switching b0 to decode would leave")
        assert f"the prefill pool of {MODEL} with no worker" in message
        assert "decode pool" not in message
        status, body = await _post(s, f"{url}/b0/role", {"role": "prefill"})
        assert status == 409 and f"the decode pool of {MODEL}" in body["error"]["message"]
        assert c.parts.pools.workers["b0"].role_state is None
        status, body, _ = await _chat(s, c.router_url)
        assert status == 200, body


def _closed(**auth: Any) -> dict[str, Any]:
    """Every credential configured, and `auth`'s other settings."""
    return {"auth": {"admin_token": TOKEN, "admin_read_token": READ, "api_keys": [CLIENT], **auth}}


ADMIN_GETS = ("/admin/state", "/admin/workers", "/admin/scaling", "/admin/roles")


async def _get(s: aiohttp.ClientSession, url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with s.get(url, headers=headers) as r:
        if r.status == 401:
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            assert (await r.json())["error"]["type"] == "authentication_error"
        if r.status == 403:
            assert (await r.json())["error"]["type"] == "permission_error"
        return r.status


async def test_with_client_keys_the_admin_reads_need_an_admin_token(redis_prefix: str) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix, **_closed()) as c,
        aiohttp.ClientSession() as s,
    ):
        for path in ADMIN_GETS:
            url = c.router_url + path
            assert await _get(s, url) == 401, path
            assert await _get(s, url, "wrong") == 401, path
            assert await _get(s, url, CLIENT) == 403, path  # a client: known, not allowed
            assert await _get(s, url, READ) == 200, path
            assert await _get(s, url, TOKEN) == 200, path
        # The read-only token (and a client key) cannot change anything.
        drain = c.router_url + "/admin/workers/d0/drain"
        for token, want in ((READ, 403), (CLIENT, 403), ("wrong", 401), (None, 401)):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            assert (await _post(s, drain, headers=headers))[0] == want, token
        # /metrics and /openapi.json stay public by default; so do /health and /ready.
        for path in ("/metrics", "/openapi.json", "/health", "/ready"):
            assert await _get(s, c.router_url + path) == 200, path


async def test_client_keys_without_admin_tokens_close_the_admin_reads(redis_prefix: str) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix, auth={"api_keys": [CLIENT]}) as c,
        aiohttp.ClientSession() as s,
    ):
        for path in ADMIN_GETS:
            assert await _get(s, c.router_url + path) == 403, path  # no token could open it
            assert await _get(s, c.router_url + path, CLIENT) == 403, path


async def test_a_read_token_closes_the_admin_reads_in_open_mode(redis_prefix: str) -> None:
    """No client keys (open mode): the admin GETs stay public, unless a read token is set."""
    async with (
        sim_cluster(redis_prefix=redis_prefix, auth={"admin_read_token": READ}) as c,
        aiohttp.ClientSession() as s,
    ):
        assert await _get(s, c.router_url + "/admin/workers") == 401
        assert await _get(s, c.router_url + "/admin/workers", READ) == 200
        status, _, _ = await _chat(s, c.router_url)
        assert status == 200  # the generation routes stay open
    async with (
        sim_cluster(redis_prefix=redis_prefix) as c,
        aiohttp.ClientSession() as s,
    ):
        for path in ADMIN_GETS:
            assert await _get(s, c.router_url + path) == 200, path


async def test_metrics_and_openapi_can_be_private(redis_prefix: str) -> None:
    closed = _closed(public_metrics=False, public_openapi=False)
    async with sim_cluster(redis_prefix=redis_prefix, **closed) as c, aiohttp.ClientSession() as s:
        for path in ("/metrics", "/openapi.json"):
            url = c.router_url + path
            assert await _get(s, url) == 401, path
            assert await _get(s, url, "wrong") == 401, path
            for token in (CLIENT, READ, TOKEN):  # a Prometheus scrape can carry any of them
                assert await _get(s, url, token) == 200, (path, token)
        assert await _get(s, c.router_url + "/health") == 200  # probes stay open
    # Only /metrics private: the description stays public.
    async with (
        sim_cluster(redis_prefix=redis_prefix, **_closed(public_metrics=False)) as c,
        aiohttp.ClientSession() as s,
    ):
        assert await _get(s, c.router_url + "/metrics") == 401
        assert await _get(s, c.router_url + "/openapi.json") == 200


def test_private_metrics_need_a_credential_to_accept() -> None:
    base = {"model": MODEL, "store": {"url": REDIS_URL}}
    with pytest.raises(ConfigError, match="needs a credential"):
        settings_from_mapping({**base, "auth": {"public_metrics": False}})
    auth = {"public_openapi": False, "admin_read_token": READ}
    settings = settings_from_mapping({**base, "auth": auth})
    assert not settings.auth.public_openapi
    assert isinstance(settings.auth.admin_read_token, Secret)  # hidden in reprs
    assert READ in secrets_of(settings)  # and scrubbed from the logs


async def test_a_guard_sees_another_replicas_drain_at_once(redis_prefix: str) -> None:
    """Two replicas: d0 drained through one, d1 through the other right after. The second
    reads the shared drained set before deciding, not its last refresh (1 s here)."""
    async with (
        sim_cluster(
            prefill=1, decode=2, redis_prefix=redis_prefix, auth={"admin_token": TOKEN},
            loops={"registry_refresh_s": 30.0},
        ) as a,
        sim_cluster(
            prefill=0, decode=0, redis_prefix=redis_prefix, auth={"admin_token": TOKEN},
            loops={"registry_refresh_s": 30.0}, workers=_entries(a),
        ) as b,
        aiohttp.ClientSession() as s,
    ):  # fmt: skip
        assert (await _post(s, a.router_url + "/admin/workers/d0/drain"))[0] == 200
        status, body = await _post(s, b.router_url + "/admin/workers/d1/drain")
        assert status == 409, body
        assert "d0 drained by the operator" in body["error"]["message"]


def _entries(c: Any) -> list[dict[str, Any]]:
    """The workers of cluster `c` as configuration entries (for a second replica)."""
    out = []
    for wid, wurl in c.workers.items():
        role = c.configs[wid].role
        entry: dict[str, Any] = {"id": wid, "url": wurl, "role": role, "adapter": "sim"}
        if role != "prefill":
            entry["kv_blocks"] = c.configs[wid].kv_blocks
        out.append(entry)
    return out


async def test_a_request_waits_for_a_worker_on_its_way_to_an_empty_decode_pool(
    redis_prefix: str,
) -> None:
    """The decode pool is empty (b0, the only decode-capable worker, was switched to prefill,
    forced) and b0 drains back toward decode: a request waits for it and is served when it
    lands. Before, an empty decode pool counted as "too large for every decode worker" and
    the request got a 429 at once (seen on real vLLM engines swapping two kv_both workers'
    roles together)."""
    async with (
        sim_cluster(
            prefill=1,
            decode=0,
            both=1,
            redis_prefix=redis_prefix,
            auth={"admin_token": TOKEN},
            roles={"settle_s": 0.5, "interval_s": 0.1},
            admission={"max_wait_s": 20.0},
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        url = c.router_url + "/admin/workers"
        pools = c.parts.pools
        status, body = await _post(s, f"{url}/b0/role", {"role": "prefill", "force": True})
        assert status == 200, body
        for _ in range(200):
            if pools.workers["b0"].current_role == "prefill":
                break
            await asyncio.sleep(0.05)
        assert pools.workers["b0"].current_role == "prefill"
        status, body = await _post(s, f"{url}/b0/role", {"role": "decode"})
        assert status == 200 and body["current_role"] == "draining-to-decode", body
        assert list(pools.decode_workers) == []
        status, body, _ = await _chat(s, c.router_url)
        assert status == 200, body
        assert pools.workers["b0"].current_role == "decode"
