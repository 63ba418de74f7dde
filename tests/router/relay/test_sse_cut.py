"""The SSE event cutter both relays share (router/relay/sse_cut.py), fed reads directly."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from router.relay.sse_cut import ERROR_EVENT, MALFORMED_FIRST_EVENT, SseCutter, count_tokens

DONE = b"data: [DONE]\n\n"


def event(text: str, chat: bool = True) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"


def error_event(code: int | None) -> bytes:
    err: dict[str, object] = {"message": "KV pull failed", "type": "x"}
    if code is not None:
        err["code"] = code
    return b"data: " + orjson.dumps({"error": err}) + b"\n\n"


def feed_all(cutter: SseCutter, reads: list[bytes]) -> list[bytes]:
    out = []
    for read in reads:
        piece = cutter.feed(read)
        if piece:
            out.append(piece)
        if cutter.stop is not None:
            break
    return out


def cut_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


TEXT = [f"w{i} " for i in range(30)] + ["é✓", ""]  # the empty content is not a token
STREAM = b"".join(event(t) for t in TEXT) + DONE


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(0, 100_000), max_size=60), chat=st.booleans())
def test_whole_events_only_and_the_same_stream_whatever_the_reads(
    cuts: list[int], chat: bool
) -> None:
    stream = b"".join(event(t, chat) for t in TEXT) + DONE
    cutter = SseCutter(chat)
    out = feed_all(cutter, cut_at(stream, cuts))
    assert b"".join(out) == stream
    assert all(piece.endswith(b"\n\n") for piece in out)
    assert cutter.tokens == len(TEXT) - 1 == count_tokens(stream, chat)
    assert cutter.finished and cutter.stop is None and cutter.pending == b""


def test_a_partial_event_is_held_until_its_end() -> None:
    cutter = SseCutter(True)
    a, b = event("a"), event("b")
    assert cutter.feed(a + b[:5]) == a
    assert cutter.feed(b[5:-1]) == b""
    assert cutter.feed(b[-1:]) == b
    assert cutter.tokens == 2 and not cutter.finished


def test_a_cut_stream_is_not_finished() -> None:
    cutter = SseCutter(True)
    feed_all(cutter, [event("a"), DONE[:8]])
    assert not cutter.finished


def test_done_split_over_reads_is_seen() -> None:
    cutter = SseCutter(True)
    feed_all(cutter, [event("a" * 100) + DONE[:5], DONE[5:]])
    assert cutter.finished


def test_a_server_error_event_ends_the_stream_after_what_came_before() -> None:
    for code in (500, None):
        cutter = SseCutter(True)
        before = event("a") + event("b")
        out = feed_all(cutter, [before + error_event(code) + DONE])
        assert out == [before] and cutter.tokens == 2
        assert cutter.stop == f"{ERROR_EVENT}: KV pull failed"
        assert cutter.stop_kind == "error_event"


def test_an_error_event_first_forwards_nothing() -> None:
    cutter = SseCutter(True)
    assert cutter.feed(error_event(503)) == b"" and cutter.stop_kind == "error_event"


def test_a_client_error_event_is_passed_through() -> None:
    cutter = SseCutter(True)
    stream = event("a") + error_event(400) + DONE
    assert feed_all(cutter, [stream]) == [stream] and cutter.stop is None and cutter.finished


def test_a_malformed_first_event_forwards_nothing() -> None:
    for first in (b"data: <html>oops</html>\n\n", b"data: [1, 2]\n\n"):
        cutter = SseCutter(True)
        assert cutter.feed(first + event("a")) == b""
        assert cutter.stop == MALFORMED_FIRST_EVENT and cutter.stop_kind == "malformed"


def test_junk_mid_stream_ends_the_stream_where_it_starts() -> None:
    """Later junk never reaches the client (its SSE parser would fail mid-answer): the events
    before it are forwarded, the stream stops there and is resumed (issue 20)."""
    for junk in (b"data: not json\n\n", b'data: {"choices": [{"delta": \n\n'):
        cutter = SseCutter(True)
        assert cutter.feed(event("a")) == event("a")
        assert cutter.feed(event("b") + junk + event("c")) == event("b")
        assert cutter.stop_kind == "malformed" and cutter.tokens == 2


def test_a_body_without_sse_framing_reaches_nobody() -> None:
    """Plain lines and comments before the first data event are not forwarded; a first event
    of the wrong shape (JSON, but no `choices`) is junk like one that does not parse."""
    cutter = SseCutter(True)
    assert cutter.feed(b"upstream connect error\n\n") == b"" and cutter.stop is None
    assert cutter.feed(b'data: {"status": "ok"}\n\n') == b""
    assert cutter.stop_kind == "malformed" and not cutter.forwarded


def test_comments_and_done_are_not_malformed() -> None:
    cutter = SseCutter(False)
    stream = b": keep-alive\n\n" + event("x", chat=False) + DONE
    assert cutter.feed(stream) == stream and cutter.stop is None and cutter.tokens == 1
