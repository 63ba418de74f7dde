"""schemathesis against a live router: every documented operation, with data that fits
router/openapi.json (positive) and data that does not (negative), sent over loopback to a
router in front of simulated workers and a real Redis.

Checks on every answer: no 5xx (a 503 only with Retry-After: a dependency down, which none is
here), no hang (a per-call timeout), an error is OpenAI JSON, and the answer's status, content
type, headers and body are the ones documented; a negative case must be refused.

The router runs on this test's event loop; hypothesis and schemathesis (synchronous, `requests`)
run in a worker thread and talk to it over loopback. `FUZZ_EXAMPLES=N` runs N examples per
operation and mode instead of the CI default.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any
from urllib.parse import quote

import hypothesis
import hypothesis.errors
import jsonschema_rs  # comes with schemathesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Ok

from tests.conftest import MODEL, sim_cluster

ADMIN_TOKEN = "fuzz-admin-token"
TENANT = "t1"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES") or 0) or 40  # per operation and mode
CALL_TIMEOUT_S = 20.0
# Loopback and refused: a fuzzed registration may name any URL, and the router health-probes
# and (discover_layout) calls what is registered. Nothing leaves the machine.
DEAD_WORKER_URL = "http://127.0.0.1:9"

_DOC = json.loads(files("router").joinpath("openapi.json").read_bytes())
_ERROR = jsonschema_rs.validator_for(_DOC["components"]["schemas"]["Error"])


@schemathesis.check
def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """Never a 5xx, except the documented 503 with Retry-After (a dependency down)."""
    if response.status_code == 503 and "Retry-After" in response.headers:
        return None
    if response.status_code >= 500:
        raise AssertionError(f"server error {response.status_code}: {response.text[:500]}")
    return None


@schemathesis.check
def errors_are_openai_json(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error answer is `application/json` in the OpenAI error shape."""
    if response.status_code < 400:
        return None
    ctype = (response.headers.get("content-type") or [""])[0].split(";")[0].strip()
    if ctype != "application/json":
        raise AssertionError(f"{response.status_code} answered as {ctype!r}: {response.text[:300]}")
    try:
        _ERROR.validate(json.loads(response.content))
    except (ValueError, jsonschema_rs.ValidationError) as exc:
        raise AssertionError(f"{response.status_code} body is not an OpenAI error: {exc}") from exc
    return None


@schemathesis.check
def refused_without_token(ctx: Any, response: Any, case: Any) -> bool | None:
    """The admin write routes, called without the admin token: 401 whatever the body."""
    sent = (case.headers or {}).get("Authorization")
    if sent != f"Bearer {ADMIN_TOKEN}" and response.status_code != 401:
        raise AssertionError(f"{response.status_code} without the admin token, not 401")
    return None


CHECKS = [
    no_server_error,
    errors_are_openai_json,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def specialised_document(served: set[tuple[str, str]], key_ids: list[str]) -> dict[str, Any]:
    """The shipped document, for this cluster: the model names are configuration (the document
    says "any of GET /v1/models"), so name the one model served, or nearly every generated
    request would be a 404 that never reaches a worker; so are the tenants, and the key ids
    are made at run time (`key_ids`: made before the fuzzing starts), so the tenant routes
    name those (their negative cases, any other name: a 404). Operations the app does not
    register (none, when the document and the app agree: test_openapi.py) are left out."""
    doc = json.loads(json.dumps(_DOC))
    doc["components"]["schemas"]["ModelName"] = {"enum": [MODEL]}
    params = doc["components"]["parameters"]
    params["TenantName"]["schema"] = {"enum": [TENANT, "default"]}
    params["KeyId"]["schema"] = {"enum": key_ids}
    for path in list(doc["paths"]):
        item = doc["paths"][path]
        for method in list(item):
            if (method.upper(), path) not in served:
                del item[method]
        if not item:
            del doc["paths"][path]
    return doc


@dataclass
class Tally:
    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


class LoopBridge:
    """Runs coroutines on the router's event loop from the fuzzing thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT_S)


def _fuzz_operation(
    op: Any,
    mode: GenerationMode,
    label: str,
    base_url: str,
    session: requests.Session,
    headers: dict[str, str],
    checks: list[Callable[..., Any]],
    after: Callable[[Any, Any], None],
    tally: Tally,
) -> None:
    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=not os.environ.get("FUZZ_EXAMPLES"),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if op.method.upper() == "POST" and op.path == "/admin/workers":
            if isinstance(case.body, dict) and isinstance(case.body.get("url"), str):
                case.body["url"] = DEAD_WORKER_URL
        tally.cases[label] += 1
        response = case.call(
            base_url=base_url, session=session, headers=headers, timeout=CALL_TIMEOUT_S
        )
        tally.statuses[f"{label} {response.status_code}"] += 1
        try:
            case.validate_response(response, checks=checks, headers=headers)
        finally:
            after(case, response)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        tally.skipped[f"{label}: no input to make invalid"] += 1
    except Exception as exc:  # one operation's failure must not hide the others'
        tally.failures.append(f"{label}:\n{exc}")


def made_keys(base_url: str, auth: dict[str, str]) -> list[str]:
    """The ids of two keys of TENANT made through the admin API: one for the rotations, one
    for the revocations (the first revocation takes its key; the rest are 404s)."""
    ids = []
    for _ in range(2):
        r = requests.post(f"{base_url}/admin/tenants/{TENANT}/keys", headers=auth, timeout=5)
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def fuzz(base_url: str, served: set[tuple[str, str]], bridge: LoopBridge, gw: Any) -> Tally:
    # Unmasked reports: "max_tokens" and "X-Expected-Output-Tokens" look like secrets to it.
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    document = specialised_document(served, made_keys(base_url, auth))
    schema = schemathesis.openapi.from_dict(document, config=config)
    tally = Tally()

    def remove_registered(case: Any, response: Any) -> None:
        """A worker a case registered leaves at once: later cases see the configured pools."""
        if response.status_code != 201:
            return
        wid = response.json()["id"]
        r = requests.delete(
            f"{base_url}/admin/workers/{quote(wid, safe='')}", headers=auth, timeout=CALL_TIMEOUT_S
        )
        if r.status_code != 200:
            # "." and "..": requests (urllib3) removes dot segments from the path even when
            # percent-encoded, so the DELETE went elsewhere; the router itself takes /%2E.
            tally.skipped[f"id the HTTP client cannot address, removed in the store: {wid!r}"] += 1
            bridge.run(gw.store.unregister_worker(wid))
            gw.pools.members.remove(wid)

    def nothing(case: Any, response: Any) -> None:
        return None

    with requests.Session() as session:
        for result in schema.get_all_operations():
            if not isinstance(result, Ok):  # test_openapi.py checks the document is valid
                raise AssertionError(f"an operation schemathesis cannot use: {result!r}")
            op = result.ok()
            write = op.method.upper() in ("POST", "DELETE") and op.path.startswith("/admin/")
            variants = [("token", auth), ("no token", {})] if write else [("", {})]
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                for who, headers in variants:
                    checks = list(CHECKS)
                    if write and not headers:
                        checks.append(refused_without_token)
                    # Negative data must be refused; the registration parser coerces instead
                    # (int("12"), layout values unchecked): a known leniency, not checked.
                    if mode is GenerationMode.NEGATIVE and op.path != "/admin/workers":
                        checks.append(negative_data_rejection)
                    label = f"{op.method.upper()} {op.path} {mode.value} {who}".strip()
                    after = remove_registered if op.path == "/admin/workers" else nothing
                    _fuzz_operation(
                        op, mode, label, base_url, session, headers, checks, after, tally
                    )
    return tally


# Long runs (FUZZ_EXAMPLES) get a per-test timeout in proportion; the CI default stays 120 s.
@pytest.mark.timeout(120 + EXAMPLES)
async def test_schemathesis_against_a_live_router(redis_prefix: str) -> None:
    async with sim_cluster(
        redis_prefix=redis_prefix,
        prefill=1,
        decode=1,
        time_scale=2000.0,
        max_model_len=2048,
        auth={"admin_token": ADMIN_TOKEN},
        # A tenant without configured keys: the router stays open (the generation routes take
        # no key), and the tenant routes have a tenant and keys to work on.
        tenants=[{"name": TENANT, "weight": 2}],
    ) as cluster:
        served = {
            (r.method, r.resource.canonical)
            for r in cluster.app.router.routes()
            if r.resource is not None and r.method != "HEAD"
        }
        bridge = LoopBridge(asyncio.get_running_loop())
        tally = await asyncio.to_thread(fuzz, cluster.router_url, served, bridge, cluster.parts)
    # As in test_fuzz_http.py: collected now, the router's garbage cannot break pytest's
    # report of a failure (CPython 3.11.7, "AST constructor recursion depth mismatch").
    gc.collect()
    total = sum(tally.cases.values())
    print(f"\nschemathesis: {total} cases over {len(tally.cases)} operation/mode runs")
    for label, n in sorted(tally.statuses.items()):
        print(f"  {label}: {n}")
    for reason, n in tally.skipped.items():
        print(f"  skipped ({reason}): {n}")
    assert not tally.failures, "\n\n".join(tally.failures)
    assert total >= len(tally.cases) > 10
