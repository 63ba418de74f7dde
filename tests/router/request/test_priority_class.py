"""A request's priority class (issue 33; router/request/priority_class.py): its tenant's highest
allowed class or a less urgent one it asks for (the body's `priority`, the X-Priority-Class
header), a more urgent ask ignored (and kept from the engine), a bad header a 400 naming it;
and the tenant's `priority:` / `class:` setting."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from router.config import ConfigError, settings_from_mapping
from router.errors import InvalidRequest
from router.request.priority_class import PRIORITY_HEADER, request_class
from router.tenants import ANONYMOUS, Keyring, TenantSpec
from tests.conftest import MODEL, sim_cluster

DEFAULT = TenantSpec("plain")
INTERACTIVE = TenantSpec("fast", priority=-1)
BATCH = TenantSpec("slow", priority=1)


def _class(tenant: TenantSpec, body: dict[str, Any], header: str | None = None) -> int:
    return request_class(tenant, body, {PRIORITY_HEADER: header} if header is not None else {})


def test_a_request_may_ask_for_a_less_urgent_class_never_a_more_urgent_one() -> None:
    assert _class(DEFAULT, {}) == 0 and _class(INTERACTIVE, {}) == -1 and _class(BATCH, {}) == 1
    assert _class(DEFAULT, {}, "batch") == 1
    assert _class(INTERACTIVE, {}, "default") == 0
    assert _class(DEFAULT, {"priority": 3}) == 3
    assert _class(DEFAULT, {"priority": 1}, "interactive") == 1  # the least urgent of the asks
    # more urgent than allowed: the tenant's class, as if nothing were asked
    assert _class(DEFAULT, {}, "interactive") == 0
    assert _class(BATCH, {}, "-5") == 1
    body: dict[str, Any] = {"priority": -1, "max_tokens": 5}
    assert _class(DEFAULT, body) == 0
    assert body == {"max_tokens": 5}  # and the engine never sees it
    # a priority within what the tenant may have reaches the engine as the client sent it
    body = {"priority": 2}
    assert _class(DEFAULT, body, "batch") == 2 and body == {"priority": 2}
    body = {"priority": 0}
    assert _class(BATCH, body) == 1 and body == {}
    # not an integer: unset, as before (the engine answers for it)
    for odd in ("high", 1.5, True, None):
        body = {"priority": odd}
        assert _class(DEFAULT, body) == 0 and body == {"priority": odd}


def test_open_mode_bounds_nothing() -> None:
    assert _class(ANONYMOUS, {}) == 0
    assert _class(ANONYMOUS, {}, "interactive") == -1
    body: dict[str, Any] = {"priority": -7}
    assert _class(ANONYMOUS, body) == -7 and body == {"priority": -7}


@pytest.mark.parametrize("header", ["urgent", "", "1.5", "9" * 30, "high priority"])
def test_a_bad_header_is_a_400_naming_it(header: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        _class(DEFAULT, {}, header)
    assert err.value.status == 400 and err.value.param == "X-Priority-Class"
    assert "interactive, default, batch" in err.value.message


def test_a_tenant_s_class_is_a_name_or_an_integer() -> None:
    raw = [
        {"name": "a", "priority": "interactive"},
        {"name": "b", "class": "batch"},
        {"name": "c", "priority": 4},
        {"name": "d"},
    ]
    settings = settings_from_mapping({"model": MODEL, "tenants": raw})
    assert [t.priority for t in settings.tenants] == [-1, 1, 4, 0]
    keyring = Keyring(settings.tenants, settings.tenant_keys)
    described = {t["name"]: (t["priority"], t["class"]) for t in keyring.describe()}
    assert described["a"] == (-1, "interactive") and described["c"] == (4, "4")
    for bad, match in [
        ({"name": "a", "priority": "urgent"}, "tenants\\[0\\].priority"),
        ({"name": "a", "priority": 1, "class": "batch"}, "give one"),
    ]:
        with pytest.raises(ConfigError, match=match):
            settings_from_mapping({"model": MODEL, "tenants": [bad]})


async def test_the_gateway_answers_a_bad_class_with_a_400_and_serves_a_good_one(
    redis_prefix: str,
) -> None:
    key = "sk-class-plain-3f9a1c7e5d2b4086"
    tenants = [{"name": "plain", "priority": "default", "keys": [key]}]
    async with sim_cluster(redis_prefix=redis_prefix, tenants=tenants) as c:
        async with AsyncOpenAI(
            base_url=c.router_url + "/v1", api_key=key, max_retries=0, timeout=30
        ) as client:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    extra_headers={PRIORITY_HEADER: "urgent"},
                )
            assert err.value.status_code == 400
            body = err.value.body
            assert isinstance(body, dict) and body["param"] == "X-Priority-Class"
            # The answer says the class it was served in: a more urgent one is not granted.
            for header, extra, stream, served in [
                ("batch", {}, False, "batch"),
                ("interactive", {"priority": -1}, False, "default"),
                ("7", {}, True, "7"),
                ("interactive", {}, True, "default"),
            ]:
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    stream=stream,
                    extra_headers={PRIORITY_HEADER: header},
                    extra_body=extra,
                )
                assert raw.headers[PRIORITY_HEADER] == served
                answer = raw.parse()
                if stream:
                    assert [chunk async for chunk in answer]  # type: ignore[union-attr]
                else:
                    assert answer.choices[0].message.content  # type: ignore[union-attr]
        assert sum((await c.reserved_blocks()).values()) == 0
