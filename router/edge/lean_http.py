"""The lean front door's wire (router/edge/lean_door.py): a request head of the common shape
read strictly, its body as it arrives, the request the flow reads, and an answer's head.

`parse_head` answers None for anything it does not read with certainty — the door then hands
the connection to aiohttp, whose parser judges it. What it refuses: a request line other than
`POST <one of ours> HTTP/1.1`; a header line without a colon, with a space before it, with a
name that is not a token, with a control character (HTAB aside), or folded; a second or
non-decimal `Content-Length`, none, or one over `server.max_body_bytes`; `Transfer-Encoding`,
`Expect`, `Upgrade`; a `Content-Encoding` other than identity; a `Connection` other than
keep-alive or close.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "Body",
    "Head",
    "LeanRequest",
    "head_bytes",
    "json_answer",
    "parse_head",
    "request_route",
]

_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_REFUSED_HEADERS = frozenset({"transfer-encoding", "expect", "upgrade"})
# Control characters (HTAB aside): aiohttp's parser refuses them in a head, so they go there.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class Head:
    route: str
    headers: CIMultiDictProxy[str]
    length: int
    close: bool  # `Connection: close`


def request_route(line: bytes, paths: Mapping[bytes, str]) -> str | None:
    """The route of a request line `POST <one of paths> HTTP/1.1`; None for any other line."""
    parts = line.split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
        return None
    return paths.get(parts[1])


def parse_head(head: bytes, paths: Mapping[bytes, str], max_body: int) -> Head | None:
    """`head` (up to its blank line) as a request of the common shape; None: anything else."""
    lines = head.split(b"\r\n")
    route = request_route(lines[0], paths)
    if route is None:
        return None
    pairs: list[tuple[str, str]] = []
    length: int | None = None
    close = False
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or not _TOKEN.issuperset(name) or _CONTROL.search(value):
            return None  # no colon, a space before it, an obs-fold, a control character
        text = value.strip(b" \t").decode("utf-8", "surrogateescape")
        key = name.decode("ascii").lower()
        if key in _REFUSED_HEADERS:
            return None
        if key == "content-length":
            if length is not None or not text.isdigit() or not text.isascii():
                return None
            length = int(text)
        elif key == "content-encoding" and text.lower() != "identity":
            return None
        elif key == "connection":
            tokens = {t.strip().lower() for t in text.split(",")}
            if not tokens <= {"keep-alive", "close"}:
                return None
            close = "close" in tokens
        pairs.append((name.decode("ascii"), text))
    if length is None or length > max_body:
        return None
    return Head(route, CIMultiDictProxy(CIMultiDict(pairs)), length, close)


class Body:
    """The request body as it arrives: whole once `length` bytes have."""

    __slots__ = ("data", "length", "whole")

    def __init__(self, length: int, first: bytes, loop: asyncio.AbstractEventLoop) -> None:
        self.data = bytearray(first)
        self.length = length
        self.whole: asyncio.Future[bytes] = loop.create_future()
        if len(self.data) >= length:
            self.whole.set_result(bytes(self.data))

    def feed(self, data: bytes) -> bytes:
        """Take what belongs to the body; returns what follows it (a pipelined head)."""
        need = self.length - len(self.data)
        self.data += data[:need]
        if len(self.data) >= self.length and not self.whole.done():
            self.whole.set_result(bytes(self.data))
        return data[need:]

    def is_eof(self) -> bool:
        return self.whole.done()


class LeanRequest:
    """What the generation flow reads of a request (the attributes of aiohttp's it uses)."""

    __slots__ = ("app", "headers", "content_length", "content", "method", "path")

    def __init__(self, app: Any, head: Head, body: Body, path: str) -> None:
        self.app, self.headers, self.content_length = app, head.headers, head.length
        self.content = body
        self.method, self.path = "POST", path

    def __repr__(self) -> str:
        return f"LeanRequest({self.path}, {self.content_length} bytes)"

    async def read(self) -> bytes:
        return await self.content.whole


class _HttpDate:
    """The `Date` header's value (RFC 9110 asks an origin server with a clock for one), made
    once a second, not once an answer."""

    __slots__ = ("second", "text")

    def __init__(self) -> None:
        self.second, self.text = -1, ""

    def now(self) -> str:
        second = int(time.time())
        if second != self.second:
            self.second, self.text = second, formatdate(second, usegmt=True)
        return self.text


_DATE = _HttpDate()


def head_bytes(status: int, headers: Mapping[str, str], framing: str, close: bool) -> bytes:
    """An answer's head: its status line, `headers` (but `Connection`), `Date`, `framing`
    (its `Content-Length` or chunked line) and `Connection: close` when it closes."""
    reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Unknown"
    out = [f"HTTP/1.1 {status} {reason}\r\nDate: {_DATE.now()}\r\n"]
    out += [f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "connection"]
    out.append(framing)
    if close:
        out.append("Connection: close\r\n")
    out.append("\r\n")
    # UTF-8 as aiohttp writes headers; the flow's values are ASCII (a client's X-Request-Id is
    # kept only when it is: router/edge/front_door.py).
    return "".join(out).encode("utf-8", "surrogateescape")


def json_answer(status: int, headers: Mapping[str, str], body: bytes, close: bool) -> bytes:
    """A whole JSON answer, head and body (the flow's, an error's)."""
    framing = f"Content-Length: {len(body)}\r\n"
    return (
        head_bytes(status, {"Content-Type": "application/json", **headers}, framing, close) + body
    )
