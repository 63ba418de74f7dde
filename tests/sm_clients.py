"""The state machine's clients (tests/system/test_state_machine.py): each an asyncio task on the
cluster's loop that records what it saw, and what it saw wrong.

- `whole_or_stream`: reads the answer to its end (aiohttp);
- `vanish`: a raw connection that reads a little and closes mid-answer;
- `hold`: a raw connection with a tiny receive buffer that reads the head and then nothing,
  holding its room until a later step closes it (`Held.close`).

What counts as wrong: a 5xx other than 503 (a dependency down) and 504 (the request's
deadline), an error body that is not OpenAI's shape, a 200
stream that does not end in `data: [DONE]`, a whole answer without its n choices, and any text
that is not exactly the simulated worker's answer (`expected`, each choice's): through resumes
and preemptions alike, a stream's text is the unbroken answer, or a prefix of it when the
stream ends with an error frame (an answer of n > 1 choices cannot be resumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from tests.rawhttp import build_request

__all__ = ["Outcomes", "Held", "whole_or_stream", "vanish", "hold"]

CHAT = "/v1/chat/completions"


@dataclass
class Outcomes:
    statuses: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)

    def count(self, what: str) -> None:
        self.statuses[what] = self.statuses.get(what, 0) + 1


def _check_error(status: int, raw: bytes, out: Outcomes, rid: str) -> None:
    # 503: a dependency down; 504: the request's own deadline (time to first token) passed
    if status >= 500 and status not in (503, 504):
        out.problems.append(f"{rid}: {status} {raw[:300]!r}")
        return
    try:
        error = orjson.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        if status == 429:  # why, for the run's report
            out.reasons[str(error["message"]).split(":")[0][:60]] += 1
    except Exception as exc:
        out.problems.append(f"{rid}: {status} with a body that is not an OpenAI error: {exc!r}")


async def whole_or_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    out: Outcomes,
    expected: list[str] | None = None,
) -> None:
    rid = headers["X-Request-Id"]
    try:
        async with session.post(url + CHAT, json=body, headers=headers) as r:
            raw = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError):
        out.count("cut")  # its replica was killed under it
        return
    out.count(str(status))
    if status != 200:
        _check_error(status, raw, out, rid)
    elif body.get("stream"):
        if not raw.endswith(b"data: [DONE]\n\n"):
            out.problems.append(f"{rid}: a 200 stream not ending in [DONE]: {raw[-200:]!r}")
        elif expected is not None:
            _check_stream_text(raw, expected, out, rid)
    else:
        choices = orjson.loads(raw).get("choices", [])
        if len(choices) != body.get("n", 1):
            out.problems.append(f"{rid}: {len(choices)} choices, asked {body.get('n', 1)}")
        elif expected is not None:
            texts = {ch["index"]: ch["message"]["content"] or "" for ch in choices}
            for i, want in enumerate(expected):
                if texts.get(i) != want:
                    out.problems.append(f"{rid}: choice {i} is {texts.get(i)!r}, not {want!r}")


def _check_stream_text(raw: bytes, expected: list[str], out: Outcomes, rid: str) -> None:
    texts: dict[int, list[str]] = {}
    errors = []
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        obj = orjson.loads(event[6:])
        if "error" in obj:
            errors.append(obj["error"])
            continue
        for choice in obj.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                texts.setdefault(choice["index"], []).append(content)
    for i, want in enumerate(expected):
        got = "".join(texts.get(i, []))
        if got == want or (errors and want.startswith(got)):
            continue
        out.problems.append(
            f"{rid}: choice {i} streamed {got!r} (errors {errors}), not the answer {want!r}"
        )


def _request_bytes(
    url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    head = [("Content-Type", "application/json"), *headers.items()]
    return (
        parts.hostname or "",
        parts.port or 80,
        build_request("POST", CHAT, head, orjson.dumps(body)),
    )


async def vanish(
    url: str, body: dict[str, Any], headers: dict[str, str], after_bytes: int, out: Outcomes
) -> None:
    """Read `after_bytes` of the answer (0: not even the head), then close the connection."""
    host, port, data = _request_bytes(url, body, headers)
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        out.count("cut")
        return
    try:
        writer.write(data)
        if after_bytes:
            with contextlib.suppress(asyncio.IncompleteReadError, OSError, TimeoutError):
                await asyncio.wait_for(reader.readexactly(after_bytes), 5.0)
        else:
            await asyncio.sleep(0.01)
        out.count("vanished")
    finally:
        writer.transport.abort()


@dataclass
class Held:
    writer: asyncio.StreamWriter | None = None
    status: int | None = None
    closed: bool = False  # closed before it connected: `hold` drops the connection at once

    async def close(self) -> None:
        self.closed = True
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.transport.abort()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def hold(
    url: str, body: dict[str, Any], headers: dict[str, str], held: Held, out: Outcomes
) -> None:
    """Read the response head, then nothing: a receive buffer of a few KB fills and the router's
    writes stall, with its reservation held."""
    host, port, data = _request_bytes(url, body, headers)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    except OSError:
        sock.close()
        out.count("cut")
        return
    held.writer = writer
    if held.closed:  # a later step closed it while it was connecting
        await held.close()
        return
    writer.write(data)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
        held.status = int(head.split(b" ", 2)[1])
        out.count(f"held {held.status}")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, TimeoutError):
        out.count("held cut")
