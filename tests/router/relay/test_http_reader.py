"""The pure HTTP/1.1 response reader (router/relay/http_reader.py): no sockets, bytes in, events
out.

The property tests cut one response's bytes at arbitrary places and check the reader sees the
same head, body and end whatever the cuts.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.relay.http_reader import (
    END,
    MAX_HEAD,
    Event,
    Head,
    HttpReadError,
    IncompleteResponse,
    ResponseReader,
)


def chunked(*pieces: bytes, ext: bytes = b"", trailers: bytes = b"") -> bytes:
    body = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces)
    return body + b"0\r\n" + trailers + b"\r\n"


CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
SSE = [b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(20)]

RESPONSES = {
    "chunked": (CHUNKED_HEAD + chunked(*SSE), 200, b"".join(SSE), True),
    "chunked, extensions and trailers": (
        CHUNKED_HEAD + chunked(b"abc", b"\r\n\r\n", ext=b";x=1", trailers=b"X-T: 1\r\n"),
        200,
        b"abc\r\n\r\n",
        True,
    ),
    "length": (
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nhello world",
        400,
        b"hello world",
        True,
    ),
    "length, close": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
        200,
        b"ok",
        False,
    ),
    "HTTP/1.0 keep-alive": (
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
        200,
        b"ok",
        True,
    ),
    "no body": (b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"", True),
    "until close": (
        b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\nall of it\r\n0\r\n",
        200,
        b"all of it\r\n0\r\n",
        False,
    ),  # read until the close
    "after 100 Continue": (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
        200,
        b"abc",
        True,
    ),
}


def read_all(pieces: list[bytes]) -> tuple[list[Head], bytes, int, ResponseReader]:
    """Feed `pieces`, then EOF: the heads, the body, how many ENDs, the reader."""
    reader = ResponseReader()
    events: list[Event] = []
    for piece in pieces:
        events += reader.feed(piece)
    events += reader.feed_eof()
    heads = [e for e in events if isinstance(e, Head)]
    body = b"".join(e for e in events if isinstance(e, bytes))
    for e in events:  # nothing but the three kinds, END last
        assert isinstance(e, (Head, bytes)) or e is END
    assert events[-1] is END
    return heads, body, sum(e is END for e in events), reader


def cut_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@pytest.mark.parametrize("name", RESPONSES)
def test_each_framing_whole(name: str) -> None:
    raw, status, body, keep_alive = RESPONSES[name]
    heads, got, ends, reader = read_all([raw])
    assert [h.status for h in heads] == [status] and got == body and ends == 1
    assert reader.done and reader.keep_alive is keep_alive


@pytest.mark.parametrize("name", RESPONSES)
def test_each_framing_one_byte_at_a_time(name: str) -> None:
    raw, status, body, keep_alive = RESPONSES[name]
    heads, got, ends, reader = read_all([raw[i : i + 1] for i in range(len(raw))])
    assert [h.status for h in heads] == [status] and got == body and ends == 1
    assert reader.keep_alive is keep_alive


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(RESPONSES)), cuts=st.lists(st.integers(0, 10_000), max_size=40))
def test_same_events_whatever_the_cuts(name: str, cuts: list[int]) -> None:
    raw, status, body, keep_alive = RESPONSES[name]
    whole_heads, _, _, _ = read_all([raw])
    heads, got, ends, reader = read_all(cut_at(raw, cuts))
    assert heads == whole_heads and heads[0].status == status
    assert got == body and ends == 1 and reader.keep_alive is keep_alive


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=0, max_size=300), max_size=12),
    cuts=st.lists(st.integers(0, 10_000), max_size=20),
)
def test_any_chunked_body_round_trips(pieces: list[bytes], cuts: list[int]) -> None:
    pieces = [p for p in pieces if p]  # an empty chunk is the last chunk
    raw = CHUNKED_HEAD + chunked(*pieces)
    _, got, ends, reader = read_all(cut_at(raw, cuts))
    assert got == b"".join(pieces) and ends == 1 and reader.keep_alive


def test_head_fields() -> None:
    reader = ResponseReader()
    (head,) = reader.feed(b"HTTP/1.1 503 Busy Now\r\nRetry-After: 2\r\nX-A:  b \r\n\r\n")
    assert head == Head(503, "Busy Now", {"retry-after": "2", "x-a": "b"})
    assert not reader.done and reader.started  # until close: the body is not over


def test_bytes_past_the_end_make_the_connection_not_reusable() -> None:
    reader = ResponseReader()
    events = reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert events[1:] == [b"ok", END] and not reader.keep_alive
    reader = ResponseReader()
    reader.feed(CHUNKED_HEAD + chunked(b"x") + b"HTTP/1.1")
    assert reader.done and not reader.keep_alive


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"SPDY 200\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        CHUNKED_HEAD + b"zz\r\n",
        CHUNKED_HEAD + b"0x5\r\nhello\r\n",
        CHUNKED_HEAD + b"3\r\nabcXY",
        CHUNKED_HEAD + b"1" * 5000,
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD,
    ],
)
def test_bad_bytes_raise_the_typed_error(raw: bytes) -> None:
    reader = ResponseReader()
    with pytest.raises(HttpReadError):
        reader.feed(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"HTTP/1.1 200 OK\r\nContent-",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabc",
        CHUNKED_HEAD + b"5\r\nab",
        CHUNKED_HEAD + chunked(b"abc")[:-2],  # the last chunk without its empty line
    ],
)
def test_a_close_before_the_end_is_an_incomplete_response(raw: bytes) -> None:
    reader = ResponseReader()
    reader.feed(raw)
    with pytest.raises(IncompleteResponse):
        reader.feed_eof()


def test_one_chunk_per_read_the_streaming_fast_path() -> None:
    """A streaming worker writes one event per chunk: each read is one whole chunk, the last
    one maybe with the last chunk after it."""
    framed = [b"%x\r\n%s\r\n" % (len(e), e) for e in SSE]
    reads = [CHUNKED_HEAD, *framed[:-1], framed[-1] + b"0\r\n\r\n"]
    reader = ResponseReader()
    events = [e for read in reads for e in reader.feed(read)]
    assert events[1:] == [*SSE, END] and reader.done and reader.keep_alive


def test_one_chunk_takes_a_whole_chunk_read_and_nothing_else() -> None:
    """`one_chunk` (the splice relay's per-read shortcut) answers only for a read that is
    exactly one whole non-last chunk at a chunk boundary; anything else is left to `feed`."""
    reader = ResponseReader()
    assert reader.one_chunk(b"5\r\nhello\r\n") is None  # no head yet
    reader.feed(CHUNKED_HEAD)
    assert reader.one_chunk(b"5\r\nhello\r\n") == b"hello"
    assert reader.one_chunk(b"A\r\n0123456789\r\n") == b"0123456789"  # upper-case hex
    for not_one in (
        b"5\r\nhel",  # split
        b"5\r\nhello\r\n0\r\n\r\n",  # the last chunk behind it: feed ends the body
        b"5\r\nhello\r\n1\r\nx\r\n",  # two chunks
        b"5;x=1\r\nhello\r\n",  # an extension
        b"0\r\n\r\n",  # the last chunk
        b"5\r\nhelloXY",  # no CRLF after the data
    ):
        assert reader.one_chunk(not_one) is None, not_one
    assert not reader.done and reader.feed(b"0\r\n\r\n") == [END]  # its state never moved
    held = ResponseReader()
    held.feed(CHUNKED_HEAD + b"5\r\nhe")  # mid-chunk: the rest is not a chunk start
    assert held.one_chunk(b"5\r\nhello\r\n") is None


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8))
def test_one_chunk_agrees_with_feed(pieces: list[bytes]) -> None:
    """Whatever the payload, the shortcut gives what `feed` would, and leaves the reader
    where `feed` would: a body read with the shortcut where it applies is the same body."""
    fast, slow = ResponseReader(), ResponseReader()
    fast.feed(CHUNKED_HEAD)
    slow.feed(CHUNKED_HEAD)
    got = []
    for piece in pieces:
        read = b"%x\r\n%s\r\n" % (len(piece), piece)
        one = fast.one_chunk(read)
        assert one == piece
        assert slow.feed(read) == [piece]
        got.append(one)
    assert fast.feed(b"0\r\n\r\n") == slow.feed(b"0\r\n\r\n") == [END]
    assert b"".join(got) == b"".join(pieces)


def test_coalesced_chunks_come_out_as_one_piece() -> None:
    """A read of several whole chunks (a worker's writes coalesced under load) gives their
    data as one piece; with the last chunk behind them, the end too."""
    framed = [b"%x\r\n%s\r\n" % (len(e), e) for e in SSE]
    reader = ResponseReader()
    reader.feed(CHUNKED_HEAD)
    assert reader.feed(b"".join(framed[:3])) == [b"".join(SSE[:3])]
    assert reader.feed(b"".join(framed[3:]) + b"0\r\n\r\n") == [b"".join(SSE[3:]), END]
    assert reader.done and reader.keep_alive
    # A chunk cut at the end of the read: the whole ones and the start of the cut one.
    reader = ResponseReader()
    reader.feed(CHUNKED_HEAD)
    cut = framed[0] + framed[1][:7]
    assert reader.feed(cut) == [SSE[0] + framed[1][4:7]]
    assert reader.feed(framed[1][7:]) == [SSE[1][3:]]
