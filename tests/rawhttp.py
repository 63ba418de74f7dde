"""A blocking HTTP/1.1 client over a raw socket, for fuzzing: it sends exactly the bytes it is
given (malformed headers, lying Content-Lengths, control characters) where aiohttp's own client
would refuse to, and it never waits longer than its deadline."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from router.relay.http_reader import Head, HttpReadError, IncompleteResponse, ResponseReader

__all__ = ["Hang", "RawResponse", "build_request", "parse_response", "send_raw"]


class Hang(AssertionError):
    """The server neither answered nor closed the connection within the deadline."""


@dataclass
class RawResponse:
    status: int
    reason: str
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased names; last one wins
    body: bytes = b""

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()

    def __repr__(self) -> str:
        body = self.body[:200]
        return f"RawResponse({self.status} {self.reason!r}, {self.content_type}, {body!r})"


def build_request(
    method: str,
    target: str,
    headers: list[tuple[str | bytes, str | bytes]],
    body: bytes = b"",
    *,
    content_length: bool = True,
) -> bytes:
    """The request's bytes. Header names and values go out as given (str as UTF-8), so a caller
    can send bytes no well-behaved client would."""

    def enc(v: str | bytes) -> bytes:
        return v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass")

    lines = [f"{method} {target} HTTP/1.1".encode("utf-8", "surrogatepass"), b"Host: 127.0.0.1"]
    names = set()
    for name, value in headers:
        names.add(enc(name).lower())
        lines.append(enc(name) + b": " + enc(value))
    if content_length and b"content-length" not in names:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    if b"connection" not in names:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _recv_all(sock: socket.socket, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Hang(f"no complete answer within the deadline; got {b''.join(chunks)[:300]!r}")
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break  # the server answered and closed before reading all we sent
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def send_raw(port: int, request: bytes, *, timeout: float = 15.0) -> RawResponse:
    """Send `request` to 127.0.0.1:`port` and read the answer until the server closes.

    Raises `Hang` if the whole exchange takes longer than `timeout` seconds."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused part-way through (an oversized body): the answer may still be there
        raw = _recv_all(sock, deadline)
    return parse_response(raw)


def parse_response(raw: bytes) -> RawResponse:
    """The one response in `raw` (all the server sent before closing), read by the router's
    own reader (router/relay/http_reader.py): the tests share its one chunked decoder."""
    reader = ResponseReader()
    try:
        events = reader.feed(raw)
    except HttpReadError as exc:
        raise AssertionError(f"not an HTTP response ({exc}): {raw[:300]!r}") from exc
    try:
        events += reader.feed_eof()
    except IncompleteResponse:
        # A body cut short (aiohttp sends a head and closes on some refused requests): the
        # body is what came; the test's assertions judge it.
        pass
    heads = [e for e in events if isinstance(e, Head)]
    if not heads:
        raise AssertionError(f"not an HTTP response: {raw[:300]!r}")
    head = heads[0]
    body = b"".join(e for e in events if isinstance(e, bytes))
    return RawResponse(head.status, head.reason, head.headers, body)
