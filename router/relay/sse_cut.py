"""The SSE event cutter both decode-leg relays share (router/relay/aiohttp_relay.py,
router/relay/splice.py).

A relay hands it each read of the worker's body (framing removed) and forwards what it gives
back. The cutter's rules, once:

- whole events only: the start of an event whose end has not come yet is held back, so a
  worker that dies mid-event never leaves half an event at the client that the resumed
  stream's bytes would corrupt;
- a server-side error event (vLLM answers 200, then reports a failed KV pull or engine error
  as `data: {"error": ...}`) ends the stream: what came before it is forwarded, the rest not,
  and the caller retries or resumes;
- a first event that is not an answer's (not a JSON object with `choices` or an `error`: a
  broken engine, a proxy's error page) ends the stream before anything reached the client, so
  the request can be retried; reads with no data event (comments, stray lines) before it are
  not forwarded, so a body with no SSE framing at all never reaches the client either;
- later, an event that does not parse ends the stream where it starts (what came before is
  forwarded; the caller resumes): a read is parsed only when one of its events does not end
  in `}` as a JSON event does (the final `[DONE]` read, comments, junk), so the ordinary read,
  one event, pays one `find` and no parse (~0.15 µs; issue 20: before, the junk went to the
  client, whose SSE parser failed mid-answer). Junk that happens to end in `}` still passes;
- tokens are counted with byte searches over the whole read, and the last bytes are kept to
  tell a finished stream (`data: [DONE]`) from a cut one.

The Responses API's stream (`responses=True`; named events, `event: <type>` then `data:`):
a token is a `response.output_text.delta` event; the stream is finished once a
`response.completed` (or `response.incomplete`) event came; an `error` or `response.failed`
event ends it like a server-side error event. Its opening events (`response.created`,
`response.in_progress`) are held back until the first event after them: vLLM sends them before
the engine has run (before the KV pull), so forwarding them would tell the relay the decode
took the KV, and leave the client holding the start of an answer a retry would start again.

The per-read cost is a few `bytes` methods over the read (`endswith`, `count`, one `in`); no
Python object per event. JSON is parsed only for the first forwarded piece and for a read that
mentions `"error"`.
"""

from __future__ import annotations

from typing import Final

import orjson

from router.adapters.errors import WorkerError, sse_data, stream_error

__all__ = [
    "SseCutter",
    "count_tokens",
    "malformed",
    "split_at_error",
    "ERROR_EVENT",
    "MALFORMED_EVENT",
    "MALFORMED_FIRST_EVENT",
]

ERROR_EVENT: Final = "decode worker reported an error mid-stream"
MALFORMED_FIRST_EVENT: Final = "decode worker's first event is not a JSON object"
MALFORMED_EVENT: Final = "decode worker sent an event that does not parse mid-stream"
_DONE: Final = b"data: [DONE]"
_TAIL: Final = 32  # bytes kept to find `[DONE]` at the end, even when split over reads
# The Responses stream's events, as their first line (whole events only reach these checks).
_R_DELTA: Final = b"event: response.output_text.delta\n"
_R_ENDS: Final = (b"event: response.completed\n", b"event: response.incomplete\n")
_R_FAILS: Final = (b"event: error\n", b"event: response.failed\n")
_R_OPENING: Final = (b"event: response.created\n", b"event: response.in_progress\n")


def malformed(data: bytes) -> bool:
    """True if a data line of these whole events is not a JSON object (`[DONE]` and comments
    aside). Run on the first forwarded piece only: a worker that answers 200 with garbage does
    so from the start, and parsing every event would cost CPU per token."""
    for line in data.split(b"\n"):
        payload = sse_data(line)
        if payload is None or payload == b"[DONE]":
            continue
        try:
            if not isinstance(orjson.loads(payload), dict):
                return True
        except orjson.JSONDecodeError:
            return True
    return False


def _payloads(data: bytes) -> list[tuple[int, bytes]]:
    """(offset of its event, payload) of every `data:` line of whole events `data`, [DONE]
    aside."""
    out = []
    start = 0
    while start < len(data):
        end = data.find(b"\n\n", start)
        end = len(data) if end < 0 else end + 2
        for line in data[start:end].split(b"\n"):
            payload = sse_data(line)
            if payload is not None and payload != b"[DONE]":
                out.append((start, payload))
        start = end
    return out


def _as_object(payload: bytes) -> dict[str, object] | None:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def first_events(data: bytes) -> str | None:
    """The verdict on whole events `data` of a completions or chat stream before anything was
    forwarded: "junk" if a data event is not an answer's chunk (a JSON object with `choices`)
    or an error, None if there is no data event yet, "ok" otherwise."""
    payloads = _payloads(data)
    for _, payload in payloads:
        obj = _as_object(payload)
        if obj is None or not ("choices" in obj or "error" in obj):
            return "junk"
    return "ok" if payloads else None


def junk_at(data: bytes) -> int | None:
    """Where in whole events `data` the first event whose data does not parse as a JSON object
    starts, or None when every one does."""
    for start, payload in _payloads(data):
        if _as_object(payload) is None:
            return start
    return None


def split_at_error(data: bytes) -> tuple[bytes, WorkerError | None]:
    """Whole events `data` → (the part before a retryable error event, that error).

    A server-side error (5xx, or no code at all) ends the relay there; a 4xx in the stream is
    the worker's verdict on the request itself and is passed through.
    """
    if b'"error"' not in data:  # the cheap check: this runs once per read
        return data, None
    start = 0
    while start < len(data):
        end = data.find(b"\n\n", start)
        end = len(data) if end < 0 else end + 2
        for line in data[start:end].split(b"\n"):
            payload = sse_data(line)
            err = stream_error(payload) if payload is not None else None
            if err is not None and not (err.status is not None and 400 <= err.status < 500):
                return data[:start], err
        start = end
    return data, None


def count_tokens(data: bytes, chat: bool) -> int:
    """Token chunks in `data`: one non-empty `content` (chat) or `text` (completions) per token."""
    if chat:
        return data.count(b'"content":"') - data.count(b'"content":""')
    return data.count(b'"text":"') - data.count(b'"text":""')


def _responses_failure(data: bytes) -> tuple[bytes, str | None]:
    """Whole Responses events `data` → (the part before an `error`/`response.failed` event,
    that event's message), or (data, None) when it has none."""
    start = 0
    while start < len(data):
        end = data.find(b"\n\n", start)
        end = len(data) if end < 0 else end + 2
        event = data[start:end]
        if event.startswith(_R_FAILS):
            message = "the Responses stream failed"
            for line in event.split(b"\n")[1:]:
                payload = sse_data(line)
                try:
                    obj = orjson.loads(payload) if payload else None
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict):
                    inner = (obj.get("response") or {}).get("error") or obj
                    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
                        message = inner["message"]
            return data[:start], message
        start = end
    return data, None


class SseCutter:
    """One stream's cutting state. `feed(read)` → the bytes to forward now (b"" for none; the
    read itself, not a copy, when it is whole events and nothing was held); after it, `stop`
    set means the stream ends here (its text for `RelayResult.upstream_error`, `stop_kind`
    for the metrics), once the returned bytes are forwarded."""

    __slots__ = (
        "chat",
        "responses",
        "pending",
        "tail",
        "tokens",
        "forwarded",
        "stop",
        "stop_kind",
        "ended",
        "_token",
        "_empty",
    )

    def __init__(self, chat: bool, responses: bool = False) -> None:
        self.chat = chat
        self.responses = responses  # the Responses API's named events (the module docstring)
        self.ended = False  # a Responses stream's completing event was forwarded
        self.pending = b""  # the start of an event whose end has not arrived yet
        self.tail = b""  # the last forwarded read (its last _TAIL bytes when reads are short)
        self.tokens = 0
        self.forwarded = False
        self.stop: str | None = None
        self.stop_kind: str | None = None
        # count_tokens' two needles, chosen once (the count is inlined in feed: once per read).
        self._token, self._empty = (
            (b'"content":"', b'"content":""') if chat else (b'"text":"', b'"text":""')
        )

    def feed(self, data: bytes) -> bytes:
        if self.pending:
            data = self.pending + data
            self.pending = b""
        if not data.endswith(b"\n\n"):
            end = data.rfind(b"\n\n")
            if end < 0:  # not one whole event yet: hold it all
                self.pending = data
                return b""
            data, self.pending = data[: end + 2], data[end + 2 :]
        if b'"error"' in data:  # split_at_error's own cheap check, without the call per read
            data, error = split_at_error(data)
            if error is not None:
                self.stop, self.stop_kind = f"{ERROR_EVENT}: {error.message}", "error_event"
            if not data:
                return b""
        if self.responses:
            return self._responses(data)
        if not self.forwarded:
            verdict = first_events(data)
            if verdict != "ok":
                if verdict == "junk":
                    self.stop, self.stop_kind = MALFORMED_FIRST_EVENT, "malformed"
                return b""  # no data event yet: nothing the client could use
            self.forwarded = True
        elif data.find(b"\n\n") != len(data) - 2 or data[-3:-2] != b"}":  # not one `...}` event
            # Several events, or one that does not end as JSON does: every event must end in
            # `}`, else look (the rare read: [DONE], comments, junk).
            if data.count(b"}\n\n") != data.count(b"\n\n"):
                cut = junk_at(data)
                if cut is not None:
                    data = data[:cut]
                    self.stop, self.stop_kind = MALFORMED_EVENT, "malformed"
                    if not data:
                        return b""
        self.tokens += data.count(self._token) - data.count(self._empty)
        # A reference, not a slice: `finished` looks at the end only when asked, once.
        self.tail = data if len(data) >= _TAIL else (self.tail + data)[-_TAIL:]
        return data

    def _responses(self, data: bytes) -> bytes:
        deltas = data.count(_R_DELTA)
        if self.forwarded and deltas == data.count(b"\n\n"):
            self.tokens += deltas  # the common read, deltas only: the rare events not looked for
            return data
        if b"event: error\n" in data or b"event: response.failed\n" in data:
            data, failure = _responses_failure(data)
            if failure is not None:
                self.stop, self.stop_kind = f"{ERROR_EVENT}: {failure}", "error_event"
                deltas = data.count(_R_DELTA)
        if not self.forwarded and data:
            if malformed(data):
                self.stop, self.stop_kind = MALFORMED_FIRST_EVENT, "malformed"
                return b""
            if sum(data.count(e) for e in _R_OPENING) == data.count(b"\n\n"):
                if self.stop is None:  # only the opening events so far: hold them
                    self.pending = data + self.pending
                return b""  # (a failure right after them: the client gets none, it is retried)
            self.forwarded = True
        self.tokens += deltas
        if not self.ended:
            self.ended = _R_ENDS[0] in data or _R_ENDS[1] in data
        return data

    @property
    def finished(self) -> bool:
        """The forwarded stream ended with `data: [DONE]` (a Responses stream: its
        `response.completed` event came)."""
        return self.ended if self.responses else _DONE in self.tail[-_TAIL:]

    @property
    def end_name(self) -> str:
        """What a finished stream ends with, for the message of one that did not."""
        return "response.completed" if self.responses else "[DONE]"
