"""A pure HTTP/1.1 response reader: bytes in, events out, no I/O.

`ResponseReader.feed(data)` takes whatever a socket read returned and gives back the events
it completes, in order:

- a `Head` (status, reason, headers) once the status line and headers are whole (1xx interim
  answers are skipped: the real head follows them);
- body bytes (`bytes`): at most one piece per `feed`, the chunk framing already removed;
- `END` once the body is whole.

Framing is chosen as RFC 9112 section 6.3 says for a response to a POST: `Transfer-Encoding:
chunked`, else `Content-Length`, else 204/304 (no body), else read until the connection closes
(`feed_eof()` ends it). Whatever the bytes are cut into, the events carry the same head, the
same body bytes and the same end (tests/router/relay/test_http_reader.py checks it for arbitrary
cuts).

Errors are typed: `HttpReadError` for bytes that are not an HTTP/1.1 response as we read it,
its subclass `IncompleteResponse` for a connection that closed before the answer was whole.

This is the one chunked decoder of router/ and tests/ (tests/rawhttp.py reads with it). The
bench's measuring client and stand-in worker keep their own on purpose: what measures the
system shares no parser with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "END",
    "End",
    "Event",
    "Head",
    "HttpReadError",
    "IncompleteResponse",
    "ResponseReader",
    "MAX_HEAD",
]

MAX_HEAD: Final = 65536  # bytes of status line and headers; beyond that it is not a worker
_MAX_LINE: Final = 4096  # a chunk-size or trailer line
_HEX: Final = b"0123456789abcdefABCDEF"


class HttpReadError(ValueError):
    """The bytes are not an HTTP/1.1 response as we read it."""


class IncompleteResponse(HttpReadError):
    """The connection closed before the answer was whole."""


@dataclass(frozen=True, slots=True)
class Head:
    status: int
    reason: str
    headers: dict[str, str]  # lower-cased names, latin-1 values; the last of a repeated name


class End:
    """The body is whole (the one instance is `END`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


END: Final = End()
Event = Head | bytes | End

# Reader states.
_HEAD, _LENGTH, _SIZE, _DATA, _DATA_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class ResponseReader:
    """Reads one response. `keep_alive` says, once it is `done`, whether the connection may
    carry another request (HTTP/1.1, no `Connection: close`, no stray bytes after the end)."""

    __slots__ = ("_buf", "_state", "_left", "keep_alive", "status")

    def __init__(self) -> None:
        self._buf = bytearray()  # bytes of an unfinished head or chunk-size line
        self._state = _HEAD
        self._left = 0  # body bytes still to come: of the Content-Length, or of this chunk
        self.keep_alive = False
        self.status = 0

    def __repr__(self) -> str:
        return f"ResponseReader(state={self._state}, status={self.status}, left={self._left})"

    @property
    def started(self) -> bool:
        """The head is in (body bytes may follow)."""
        return self._state != _HEAD

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> list[Event]:
        """The events that `data` completes (see the module docstring)."""
        events: list[Event] = []
        state = self._state
        if state == _HEAD:
            data = self._head(data, events)
            state = self._state
        if not data:
            return events
        if state >= _SIZE and state <= _TRAILER:
            self._chunked(data, events)
        elif state == _LENGTH:
            left = self._left
            if len(data) > left:  # more than the answer: a confused worker, not reusable
                self.keep_alive = False
                data = data[:left]
            self._left = left - len(data)
            events.append(data)
            if self._left == 0:
                self._end(events)
        elif state == _UNTIL_CLOSE:
            events.append(data)
        elif state == _DONE:
            self.keep_alive = False  # bytes nobody asked for
        return events

    def feed_eof(self) -> list[Event]:
        """The connection closed: `[END]` for a read-until-close body, nothing if already done.
        Raises `IncompleteResponse` otherwise."""
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            return [END]
        if self._state == _DONE:
            return []
        what = "its head" if self._state == _HEAD else "its body"
        raise IncompleteResponse(f"the connection closed before the answer's end ({what})")

    # -- the head -----------------------------------------------------------------------------
    def _head(self, data: bytes, events: list[Event]) -> bytes:
        """Parse heads while one is whole; return the bytes after the last one."""
        buf = self._buf
        while self._state == _HEAD:
            buf += data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise HttpReadError(f"response head over {MAX_HEAD} bytes")
                return b""
            if end > MAX_HEAD:
                raise HttpReadError(f"response head over {MAX_HEAD} bytes")
            head = bytes(buf[:end])
            data = bytes(buf[end + 4 :])
            buf.clear()
            self._start(head, events)
        return data

    def _start(self, raw: bytes, events: list[Event]) -> None:
        status_line, *lines = raw.split(b"\r\n")
        version, sep, rest = status_line.partition(b" ")
        code, _, reason = rest.partition(b" ")
        if not sep or version not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise HttpReadError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        if len(code) != 3 or not code.isdigit():
            raise HttpReadError(f"bad status code: {status_line[:80]!r}")
        status = int(code)
        if 100 <= status < 200:  # 100 Continue and friends: the real head follows
            return
        headers: dict[str, str] = {}
        length: int | None = None
        for line in lines:
            name, colon, value = line.partition(b":")
            name = name.strip().lower()
            if not colon or not name:
                raise HttpReadError(f"bad header line: {line[:80]!r}")
            value = value.strip()
            if name == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise HttpReadError(f"bad Content-Length: {value[:40]!r}")
                length = int(value)
            headers[name.decode("latin-1")] = value.decode("latin-1")
        keep_alive = version == b"HTTP/1.1"
        connection = headers.get("connection", "").lower()
        if "close" in connection:
            keep_alive = False
        elif "keep-alive" in connection:
            keep_alive = True
        self.status = status
        events.append(Head(status, reason.decode("latin-1"), headers))
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _SIZE
        elif length is not None or status in (204, 304):
            self._state, self._left = _LENGTH, length or 0
        else:
            self._state = _UNTIL_CLOSE
            keep_alive = False
        self.keep_alive = keep_alive
        if self._state == _LENGTH and self._left == 0:
            self._end(events)

    def _end(self, events: list[Event]) -> None:
        self._state = _DONE
        events.append(END)

    # -- chunked bodies -----------------------------------------------------------------------
    def one_chunk(self, data: bytes) -> bytes | None:
        """The per-token fast path: at a chunk boundary with nothing held, `data` is exactly one
        whole, non-last chunk (a streaming worker writes one event per chunk and the socket
        read returns it whole): its payload, and the reader stays at the boundary. None: not
        that case, `feed` decides. No event list, no state change: the splice relay's
        `data_received` calls it first on every read."""
        if self._state != _SIZE or self._buf:
            return None
        # _chunk_span's checks, inlined: this runs once per token.
        eol = data.find(b"\r\n", 0, 18)
        if eol <= 0:
            return None
        size_field = data[:eol]
        if size_field.strip(_HEX):
            return None
        end = eol + 2 + int(size_field, 16)
        if end + 2 != len(data) or end == eol + 2 or not data.endswith(b"\r\n"):
            return None
        return data[eol + 2 : end]

    def _whole_chunks(self, data: bytes, events: list[Event]) -> bool:
        """`data` is whole chunks (one, or several when the worker's writes coalesced), maybe
        the last chunk after them: their data as one piece. False: take the loop (nothing
        was added to `events`)."""
        pieces: list[bytes] = []
        pos, n = 0, len(data)
        while pos < n:
            span = _chunk_span(data, pos)
            if span is None:
                break
            pieces.append(data[span[0] : span[1]])
            pos = span[1] + 2
        if not pieces:
            return False
        last = pos != n
        if last and not (n - pos == 5 and data.endswith(b"0\r\n\r\n")):
            return False
        events.append(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if last:
            self._end(events)
        return True

    def _chunked(self, data: bytes, events: list[Event]) -> None:
        """Decode chunk framing; chunk data goes out as it comes (a chunk split over reads is
        not held back), all of this read's data as one piece."""
        buf = self._buf
        if not buf and self._state == _SIZE and self._whole_chunks(data, events):
            return
        view: bytes | bytearray
        if buf:
            buf += data
            view = buf
        else:
            view = data
        n, pos, state, left = len(view), 0, self._state, self._left
        parts: list[bytes] = []
        while pos < n:
            if state == _DATA:
                take = min(left, n - pos)
                parts.append(bytes(view[pos : pos + take]))  # bytes(): no second copy
                pos += take
                left -= take
                if left == 0:
                    state = _DATA_END
            elif state == _SIZE:
                eol = view.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > _MAX_LINE:
                        raise HttpReadError("chunk-size line too long")
                    break
                size = view[pos:eol].split(b";", 1)[0].strip()
                if not size or size.strip(_HEX):
                    raise HttpReadError(f"bad chunk size: {bytes(view[pos:eol])[:40]!r}")
                left = int(size, 16)
                pos = eol + 2
                state = _DATA if left else _TRAILER
            elif state == _DATA_END:
                if n - pos < 2:
                    break
                if view[pos : pos + 2] != b"\r\n":
                    raise HttpReadError("chunk data not followed by CRLF")
                pos += 2
                state = _SIZE
            elif state == _TRAILER:  # trailer fields, skipped, up to the empty line
                eol = view.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > _MAX_LINE:
                        raise HttpReadError("trailer line too long")
                    break
                end_of_trailers = eol == pos
                pos = eol + 2
                if end_of_trailers:
                    state = _DONE
                    if pos < n:  # bytes after the end: not reusable
                        self.keep_alive = False
                    pos = n
            else:  # pragma: no cover - _DONE is handled by the caller
                break
        if view is buf:
            del buf[:pos]
        elif pos < n:
            buf += view[pos:]
        self._state, self._left = state, left
        if parts:
            events.append(parts[0] if len(parts) == 1 else b"".join(parts))
        if state == _DONE:
            buf.clear()
            events.append(END)


def _chunk_span(data: bytes, start: int = 0) -> tuple[int, int] | None:
    """Where the data of the chunk that begins at `start` begins and ends (its CRLF follows),
    if `data` holds it whole with a plain hex size line (no extensions) and a non-zero size."""
    eol = data.find(b"\r\n", start, start + 18)
    if eol <= start:
        return None
    size_field = data[start:eol]
    if size_field.strip(_HEX):  # extensions, or not hex
        return None
    begin = eol + 2
    end = begin + int(size_field, 16)
    if end == begin or data[end : end + 2] != b"\r\n":
        return None
    return begin, end
