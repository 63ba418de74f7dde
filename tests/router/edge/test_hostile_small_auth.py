"""A credential in an oversized or malformed `Authorization` / `x-api-key` header is never
echoed (issue 31, item 6a): not in the 400 body, not in any log line at any level.

aiohttp's parser quotes the offending line in its errors (a header value's first 100 bytes
past 8,190, the data around a control character); the router used to pass that text to the
client and to its DEBUG log, where only a `Bearer `/`Basic ` credential was masked. Raw
sockets (tests/rawhttp.py) against a live router, since no well-behaved client sends these.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tests.conftest import MODEL, sim_cluster
from tests.rawhttp import RawResponse, build_request, send_raw

# Distinctive enough that a hit anywhere is this secret; a part of it, since aiohttp quotes
# only a header's first 100 bytes.
SECRET = "sk-NEVER-ECHO-7f3a9c21b5"
CLIENT_KEY = "sk-a-valid-client-key-0001"
OVER_LIMIT = "x" * 8300  # past aiohttp's 8,190-byte header line

CHAT_BODY = json.dumps(
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
).encode()

# name -> the header's value (bytes: sent as is)
VALUES: dict[str, bytes] = {
    "Token scheme, over the limit": f"Token {SECRET}{OVER_LIMIT}".encode(),
    "ApiKey scheme, over the limit": f"ApiKey {SECRET}{OVER_LIMIT}".encode(),
    "no scheme, over the limit": f"{SECRET}{OVER_LIMIT}".encode(),
    "Bearer, over the limit": f"Bearer {SECRET}{OVER_LIMIT}".encode(),
    "Basic, over the limit": f"Basic {SECRET}{OVER_LIMIT}".encode(),
    "Token scheme, control character": f"Token {SECRET}\x01tail".encode(),
    "no scheme, control character": f"{SECRET}\x7fx".encode(),
    "Token scheme, not UTF-8": f"Token {SECRET}".encode() + b"\xff\xfe",
    "Token scheme, fits": f"Token {SECRET}".encode(),
    "no scheme, fits": SECRET.encode(),
}


def _requests() -> dict[str, bytes]:
    out = {}
    for header in ("Authorization", "x-api-key", "Proxy-Authorization"):
        for name, value in VALUES.items():
            req = build_request(
                "POST",
                "/v1/chat/completions",
                [("Content-Type", "application/json"), (header, value)],
                CHAT_BODY,
            )
            out[f"{header}: {name}"] = req
    return out


def _shown(resp: RawResponse) -> str:
    return f"{resp.status} {resp.reason} {resp.headers!r} {resp.body!r}"


@pytest.mark.parametrize("keys", [[CLIENT_KEY], []], ids=["client keys", "open mode"])
async def test_a_credential_header_is_never_echoed(
    caplog: pytest.LogCaptureFixture, keys: list[str]
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level
    requests = _requests()
    async with sim_cluster(redis_prefix=None, auth={"api_keys": keys}) as c:
        port = int(c.router_url.rsplit(":", 1)[1])

        def work() -> dict[str, RawResponse]:
            return {name: send_raw(port, raw, timeout=30.0) for name, raw in requests.items()}

        answers = await asyncio.to_thread(work)
    for name, resp in answers.items():
        shown = _shown(resp)
        assert SECRET not in shown and SECRET[:12] not in shown, f"{name}: echoed: {shown}"
        if resp.status >= 400:
            assert resp.status < 500, f"{name}: {shown}"
            err = json.loads(resp.body)["error"]
            assert err["type"] in ("invalid_request_error", "authentication_error"), name
    # Some answers are the parser's 400 (the path that quoted the line), some the 401.
    statuses = {r.status for r in answers.values()}
    assert 400 in statuses, statuses
    if keys:
        assert 401 in statuses, statuses
    # The log at DEBUG: messages, arguments, tracebacks.
    assert any(r.name == "router.edge.server" for r in caplog.records), (
        "the parser errors were logged"
    )
    for record in caplog.records:
        line = f"{record.getMessage()} {record.exc_text or ''} {record.args!r}"
        assert SECRET[:12] not in line, f"logged by {record.name}: {line[:400]}"
    assert SECRET[:12] not in caplog.text


@pytest.mark.parametrize(
    "text",
    [
        f"{{'Authorization': 'Token {SECRET}', 'Host': 'x'}}",
        f"<CIMultiDictProxy('X-Api-Key': '{SECRET}')>",
        f"x-api-key: {SECRET}\r\nHost: x",
        f"proxy-authorization=ApiKey {SECRET}",
        f"GET /v1/models?api-key={SECRET} HTTP/1.1",
    ],
)
def test_scrub_hides_a_credential_header_under_any_scheme(text: str) -> None:
    """What else may print a request's headers (a worker's error echoing them, a repr in a
    traceback) is scrubbed by name, not only after `Bearer `/`Basic ` (router/redact.py)."""
    from router.redact import Redactor, scrub

    assert SECRET not in scrub(text) and SECRET not in Redactor()(text)
    assert "***" in scrub(text)


def test_scrub_leaves_our_own_messages_alone() -> None:
    message = "a valid API key is required (Authorization: Bearer ...)"
    assert scrub_of(message) == message


def scrub_of(text: str) -> str:
    from router.redact import scrub

    return scrub(text)
