"""The raw pool writes a request's headers as aiohttp's client does (router/relay/upstream_pool.py
`header_lines`): a leg sends a worker the same bytes whichever client carries it."""

from __future__ import annotations

import pytest
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

from router.relay.upstream_pool import header_lines


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "application/json", "X-Request-Id": "dr-0123"},
        {"traceparent": "☃" * 10, "X-Request-Id": "é☃😀"},  # forwarded as the client sent them
        {"tracestate": "a=b\tc"},  # a tab is allowed
    ],
)
def test_the_same_bytes_as_aiohttps_client(headers: dict[str, str]) -> None:
    theirs = _serialize_headers("POST / HTTP/1.1", CIMultiDict(headers))
    ours = b"POST / HTTP/1.1\r\n" + header_lines(headers) + b"\r\n"
    assert ours == theirs


@pytest.mark.parametrize("value", ["a\r\nInjected: 1", "a\nb", "a\x00b", "a\x7fb"])
def test_a_control_character_is_refused_as_aiohttp_refuses_it(value: str) -> None:
    with pytest.raises(ValueError):
        _serialize_headers("POST / HTTP/1.1", CIMultiDict({"traceparent": value}))
    with pytest.raises(ValueError):
        header_lines({"traceparent": value})
