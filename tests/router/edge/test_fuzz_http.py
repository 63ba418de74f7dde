"""Raw-HTTP fuzzing of a live router: bodies and headers no well-behaved client sends, over a
plain socket (tests/rawhttp.py), to a router in front of simulated workers and a real Redis.

For every case: the status is below 500, a 4xx is an OpenAI-style JSON error, and the router
answers (or closes) within the deadline. The explicit table holds every bug seen so far (each a
500 or a plain-text 4xx before its fix: docs/reliability.md); the hypothesis strategies then
search around them. `FUZZ_EXAMPLES=N` runs N examples per
strategy instead of the CI default.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import os
import zlib
from collections.abc import Callable
from importlib.resources import files
from typing import Any, cast

import hypothesis
import jsonschema_rs  # comes with schemathesis
import pytest
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st

from router.config import merged_settings
from router.errors import InvalidRequest
from router.openai.api import CHAT, COMPLETIONS, parse_request
from tests.conftest import MODEL, sim_cluster
from tests.rawhttp import RawResponse, build_request, send_raw

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES") or 0) or 200
DEADLINE_S = 20.0  # per request: a router that neither answers nor closes by then hangs
ADMIN_TOKEN = "fuzz-admin-token"
MAX_BODY = 1 << 20  # a small max_body_bytes, so that oversize cases stay cheap
JSON_CT = ("Content-Type", "application/json")
AUTH = ("Authorization", f"Bearer {ADMIN_TOKEN}")

_DOC = json.loads(files("router").joinpath("openapi.json").read_bytes())
_ERROR = jsonschema_rs.validator_for(_DOC["components"]["schemas"]["Error"])


def cluster(redis_prefix: str, **kw: Any) -> Any:
    base = {"server": {"max_body_bytes": MAX_BODY}, "auth": {"admin_token": ADMIN_TOKEN}}
    return sim_cluster(
        redis_prefix=redis_prefix,
        time_scale=2000.0,
        max_model_len=2048,
        **merged_settings(base, kw),  # a test's auth settings join the admin token
    )


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def against_live_router(
    redis_prefix: str, work: Callable[[int], Any], **settings: Any
) -> Any:
    """`work(port)` in a worker thread, against a fresh router; its result.

    The router's garbage is collected before the test returns. Without that, on CPython
    3.11.7, a test that fails or xfails after the router logged a 500 can break pytest's
    `ast.parse` of this file for the report ("SystemError: AST constructor recursion depth
    mismatch", an INTERNALERROR instead of the report); a collection here prevents it."""
    try:
        async with cluster(redis_prefix, **settings) as c:
            return await asyncio.to_thread(work, port_of(c.router_url))
    finally:
        gc.collect()


async def exchange(redis_prefix: str, requests: list[bytes], **settings: Any) -> list[RawResponse]:
    """Send `requests` one after another to a fresh router; the answers."""

    def work(port: int) -> list[RawResponse]:
        return [send_raw(port, r, timeout=DEADLINE_S) for r in requests]

    return list(await against_live_router(redis_prefix, work, **settings))


def check_answer(resp: RawResponse) -> None:
    """The invariant: no 5xx, and a 4xx is OpenAI JSON (`{"error": {...}}`)."""
    assert resp.status < 500, f"server error: {resp!r}"
    if resp.status >= 400:
        assert resp.content_type == "application/json", f"error not in JSON: {resp!r}"
        try:
            _ERROR.validate(json.loads(resp.body))
        except (ValueError, jsonschema_rs.ValidationError) as exc:
            raise AssertionError(f"not an OpenAI error body: {resp!r}: {exc}") from exc


def body(path: str = CHAT, **fields: Any) -> bytes:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
    if path == CHAT:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    base.update(fields)
    return json.dumps(base).encode()


def post(path: str, data: bytes, *headers: tuple[str | bytes, str | bytes]) -> bytes:
    return build_request("POST", path, [JSON_CT, *headers], data)


OK = body()
# 16 MiB of JSON in 16 KiB of gzip: 16 times max_body_bytes once inflated.
BOMB = gzip.compress(b'{"model": "' + b"a" * (16 << 20) + b'"}', compresslevel=9)
GZIP_HEADER = ("Content-Encoding", "gzip")


# -- the explicit table ---------------------------------------------------------------------
# (request bytes, the status expected or None for "any below 500"), by id
# The cases of the observed-bug table (issue 10) and those this fuzzing found: 500s, or 4xx in
# aiohttp's plain text, before their fixes (docs/reliability.md). Any status below 500 with an
# OpenAI body will do.
FIXED_BUGS: list[Any] = [
    pytest.param(
        post(CHAT, OK, GZIP_HEADER),
        None,
        id="gzip-not-gzip",
    ),
    pytest.param(
        post(CHAT, OK[:10] + b"\x1f\x8b", GZIP_HEADER),
        None,
        id="gzip-garbage",
    ),
    pytest.param(
        post(CHAT, OK, ("Content-Encoding", "deflate")),
        None,
        id="deflate-not-deflate",
    ),
    pytest.param(
        post(CHAT, OK, ("Content-Encoding", "br")),
        None,
        id="brotli-unsupported",
    ),
    pytest.param(
        post(CHAT, OK, ("X-Expected-Output-Tokens", "²")),
        None,
        id="eot-superscript-2",
    ),
    pytest.param(
        post(CHAT, OK, ("X-Expected-Output-Tokens", "①")),
        None,
        id="eot-circled-1",
    ),
    pytest.param(
        post(CHAT, OK, ("X-Foo", b"a\x01b")),
        None,
        id="header-control-char",
    ),
    pytest.param(
        post(CHAT, OK, ("X-Foo", b"a\x00b")),
        None,
        id="header-nul",
    ),
    pytest.param(
        post(CHAT, OK, ("X-Request-Id", b"a\x7fb")),
        None,
        id="header-del",
    ),
    pytest.param(
        post(CHAT, OK, ("Content-Length", "abc")),
        None,
        id="content-length-not-a-number",
    ),
    pytest.param(
        post(CHAT, OK, ("Content-Length", "-1")),
        None,
        id="content-length-negative",
    ),
    pytest.param(
        post(CHAT, OK, ("Content-Length", "3"), ("Content-Length", "5")),
        None,
        id="content-length-twice",
    ),
    pytest.param(
        build_request("GET", "/v1/models?q=" + "a" * 9 * 1024, []),
        None,
        id="url-9kb",
    ),
    pytest.param(
        post(CHAT, OK, ("X-Big", "a" * 9 * 1024)),
        None,
        id="header-9kb",
    ),
    pytest.param(
        post(CHAT, OK, ("Content-Type", "text/plain")),
        None,
        id="duplicate-content-type",
    ),
    pytest.param(
        post(CHAT, OK, ("X-Request-Id", b"\xff\xfe")),
        None,
        id="request-id-not-utf8",
    ),
    pytest.param(
        b"GARBAGE\r\n\r\n",
        None,
        id="request-line-garbage",
    ),
    pytest.param(
        build_request(
            "POST",
            CHAT,
            [JSON_CT, ("Transfer-Encoding", "chunked")],
            b"zz\r\n{}\r\n0\r\n\r\n",
            content_length=False,
        ),
        None,
        id="chunk-size-not-hex",
    ),
]

EXPLICIT: list[Any] = [
    # compression
    pytest.param(post(CHAT, BOMB, GZIP_HEADER), 413, id="gzip-bomb"),
    pytest.param(post(CHAT, gzip.compress(OK), GZIP_HEADER), 200, id="gzip-valid"),
    pytest.param(post(CHAT, gzip.compress(OK)[:-12], GZIP_HEADER), 400, id="gzip-truncated"),
    pytest.param(
        post(CHAT, zlib.compress(OK), ("Content-Encoding", "deflate")), 200, id="deflate-valid"
    ),
    pytest.param(post(CHAT, OK, ("Content-Encoding", "identity")), 200, id="identity"),
    pytest.param(post(CHAT, OK, ("Content-Encoding", "x-unknown")), 200, id="unknown-encoding"),
    pytest.param(
        post(CHAT, b'{"model": "' + b"a" * (MAX_BODY + 10) + b'"}'),
        413,
        id="body-over-max_body_bytes",
    ),
    # JSON that is not, or is not an object
    pytest.param(post(CHAT, OK[:-3]), 400, id="json-truncated"),
    pytest.param(post(CHAT, OK + b"}"), 400, id="json-trailing-garbage"),
    pytest.param(post(CHAT, b"{'model': 'x'}"), 400, id="json-single-quotes"),
    pytest.param(post(CHAT, b'{"model": NaN}'), 400, id="json-nan"),
    pytest.param(post(CHAT, b'{"max_tokens": 1e400}'), 400, id="json-number-overflows-double"),
    pytest.param(post(CHAT, b"\xef\xbb\xbf" + OK), 400, id="json-utf8-bom"),
    pytest.param(post(CHAT, b'{"model": "\xff\xfe"}'), 400, id="json-not-utf8"),
    pytest.param(post(CHAT, b'{"model": "\\ud800"}'), 400, id="json-lone-surrogate"),
    pytest.param(post(CHAT, b""), 400, id="empty-body"),
    pytest.param(
        build_request("POST", CHAT, [], b"", content_length=False), 400, id="no-body-no-length"
    ),
    pytest.param(post(CHAT, b"null"), 400, id="json-null"),
    pytest.param(post(CHAT, b"[]"), 400, id="json-array"),
    pytest.param(post(CHAT, b'"text"'), 400, id="json-string"),
    pytest.param(post(CHAT, b"[" * 100_000), 400, id="json-deep-nesting"),
    # wrong types for every validated field
    *(
        pytest.param(
            post(path, body(path, **{field: value})),
            status,
            id=f"{path.rsplit('/', 1)[1]}-{field}-{label}",
        )
        for path in (CHAT, COMPLETIONS)
        for field, value, label, status in [
            ("model", 7, "int", 400),
            ("model", None, "null", 400),
            ("model", "", "empty", 400),
            ("model", ["llama-3-8b"], "list", 400),
            ("model", "no-such-model", "unknown", 404),
            ("stream", "true", "string", 400),
            ("stream", 1, "int", 400),
            ("stream_options", "usage", "string", 400),
            ("stream_options", {"include_usage": True}, "without-stream", 400),
            ("n", 0, "zero", 400),
            ("n", 129, "over-cap", 400),
            ("n", "1", "string", 400),
            ("n", 1.5, "fraction", 400),
            ("n", True, "bool", 400),
            ("temperature", "0.5", "string", 400),
            ("temperature", True, "bool", 400),
            ("top_p", [], "list", 400),
            ("presence_penalty", {}, "object", 400),
            ("frequency_penalty", "x", "string", 400),
            ("max_tokens", "10", "string", 400),
            ("max_tokens", True, "bool", 400),
            ("max_tokens", 0, "zero", 400),
            ("max_tokens", -1, "negative", 400),
            ("max_tokens", 1.5, "fraction", 400),
            ("max_tokens", 4.0, "integral-float", 200),
            ("max_completion_tokens", [], "list", 400),
            ("max_completion_tokens", 0, "zero", 400),
            ("min_tokens", -1, "negative", 400),
            ("min_tokens", "1", "string", 400),
        ]
    ),
    *(
        pytest.param(post(CHAT, body(messages=value)), 400, id=f"chat-messages-{label}")
        for value, label in [
            ("hi", "string"),
            ({}, "object"),
            ([], "empty"),
            ([1], "item-int"),
            ([{"content": "x"}], "no-role"),
            ([{"role": 1, "content": "x"}], "role-int"),
            ([{"role": "", "content": "x"}], "role-empty"),
            ([{"role": "user", "content": 5}], "content-int"),
            ([{"role": "user", "content": {}}], "content-object"),
            ([{"role": "user", "content": [{"text": "x"}]}], "part-no-type"),
            ([{"role": "user", "content": [5]}], "part-int"),
            ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "part-text-int"),
            ([{"role": "user", "content": [{"type": 1}]}], "part-type-int"),
        ]
    ),
    *(
        pytest.param(
            post(COMPLETIONS, body(COMPLETIONS, prompt=value)),
            400,
            id=f"completions-prompt-{label}",
        )
        for value, label in cast(
            list[tuple[Any, str]],
            [
                (5, "int"),
                (None, "null"),
                ([], "empty"),
                ([-1], "negative-id"),
                ([1, "a"], "mixed"),
                (["a", "b"], "batch"),
                ([[1], [2]], "batch-ids"),
                ({}, "object"),
                ([2**63], "id-beyond-int64"),
                ([1.5], "fractional-id"),
            ],
        )
    ),
    # huge numbers
    pytest.param(post(CHAT, body(max_tokens=2**63 - 1)), 400, id="max_tokens-int64-max"),
    pytest.param(post(CHAT, body(max_tokens=2**63)), 400, id="max_tokens-2^63"),
    pytest.param(post(CHAT, body(max_tokens=2**64 - 1)), 400, id="max_tokens-uint64-max"),
    pytest.param(
        post(
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "u"}], '
            b'"max_tokens": 100000000000000000000000000000}',
        ),
        400,
        id="max_tokens-10^29",
    ),
    pytest.param(post(CHAT, body(max_tokens=1e300)), 400, id="max_tokens-1e300"),
    pytest.param(post(CHAT, body(min_tokens=2**63)), 400, id="min_tokens-2^63"),
    pytest.param(post(CHAT, body(min_tokens=1e300)), 400, id="min_tokens-1e300"),
    pytest.param(post(CHAT, body(temperature=1.7976931348623157e308)), None, id="temperature-max"),
    pytest.param(post(CHAT, body(priority=2**64 - 1)), 200, id="priority-uint64-max"),
    pytest.param(post(CHAT, body(priority=-(2**63))), 200, id="priority-int64-min"),
    pytest.param(post(CHAT, OK, ("X-Expected-Output-Tokens", "9" * 40)), 200, id="eot-40-digits"),
    pytest.param(post(CHAT, OK, ("X-Expected-Output-Tokens", "-5")), 200, id="eot-negative"),
    pytest.param(post(CHAT, OK, ("X-Expected-Output-Tokens", "٣")), 200, id="eot-arabic-digit"),
    pytest.param(
        post(CHAT, body(messages=[{"role": "user", "content": "a" * 500_000}])),
        400,
        id="prompt-beyond-max_model_len",
    ),
    # unicode
    pytest.param(
        post(CHAT, body(messages=[{"role": "üser", "content": "😀 \u202e \u0000"}])),
        200,
        id="unicode-message",
    ),
    pytest.param(post(CHAT, body(model="llama-3-8b\u0000")), 404, id="unicode-model-nul"),
    pytest.param(post(CHAT, body(model="ｌｌａｍａ-3-8b")), 404, id="unicode-model-fullwidth"),
    pytest.param(post(CHAT, OK, ("X-Request-Id", "é☃😀")), 200, id="unicode-request-id"),
    pytest.param(post(CHAT, OK, ("traceparent", "☃" * 1000)), 200, id="unicode-traceparent"),
    pytest.param(post(CHAT, OK, ("x-sim-output-tokens", "²")), None, id="forwarded-header-junk"),
    pytest.param(post(CHAT, OK, ("Authorization", "Bearer ☃")), 200, id="unicode-bearer"),
    # streaming, methods, paths
    pytest.param(
        post(CHAT, body(stream=True, stream_options={"include_usage": True})),
        200,
        id="stream-with-usage",
    ),
    pytest.param(
        build_request(
            "POST",
            CHAT,
            [JSON_CT, ("Transfer-Encoding", "chunked")],
            f"{len(OK):x}\r\n".encode() + OK + b"\r\n0\r\n\r\n",
            content_length=False,
        ),
        200,
        id="chunked-body",
    ),
    pytest.param(build_request("PUT", CHAT, [JSON_CT], OK), 405, id="wrong-method"),
    pytest.param(build_request("GET", "/v1/nope%00%ff", []), 404, id="unknown-path"),
    pytest.param(
        build_request("GET", "/v1/models?" + "&".join(["a=b"] * 1000), []),
        200,
        id="many-query-params",
    ),
    pytest.param(build_request("GET", "/health", [("X-H", "v")] * 90), 200, id="many-headers"),
    # admin
    pytest.param(post("/admin/workers", b"{}"), 401, id="admin-register-no-token"),
    pytest.param(post("/admin/workers", b"{", AUTH), 400, id="admin-register-bad-json"),
    pytest.param(post("/admin/workers", b"[]", AUTH), 400, id="admin-register-not-object"),
    pytest.param(post("/admin/workers", b'{"id": "x"}', AUTH), 400, id="admin-register-no-url"),
    pytest.param(
        post(
            "/admin/workers",
            b'{"id": "x", "url": "http://127.0.0.1:9", "role": "decode", "layout": 5}',
            AUTH,
        ),
        400,
        id="admin-register-layout-int",
    ),
    pytest.param(
        post(
            "/admin/workers",
            b'{"id": "x", "url": "http://127.0.0.1:9", "role": "decode", "discover_layout": "yes"}',
            AUTH,
        ),
        400,
        id="admin-register-discover-string",
    ),
    pytest.param(
        post(
            "/admin/workers", b'{"id": "p0", "url": "http://127.0.0.1:9", "role": "decode"}', AUTH
        ),
        400,
        id="admin-register-configured-id",
    ),
    pytest.param(
        build_request("DELETE", "/admin/workers/p0", [AUTH]), 400, id="admin-remove-configured"
    ),
    pytest.param(
        build_request("DELETE", "/admin/workers/%ff%fe", [AUTH]), 404, id="admin-remove-bad-percent"
    ),
    pytest.param(
        build_request("DELETE", "/admin/workers/x", [("Authorization", "Bearer no")]),
        401,
        id="admin-remove-wrong-token",
    ),
]


def _verdict(resp: RawResponse, expected: int | None) -> str | None:
    try:
        check_answer(resp)
        assert expected is None or resp.status == expected, f"expected {expected}: {resp!r}"
    except AssertionError as exc:
        return str(exc)
    return None


async def test_explicit_cases(redis_prefix: str) -> None:
    """The whole table, one after another against one router (a router per case would
    cost a second or so each on a loaded machine); every failing case is named."""
    cases = [(p.id, p.values[0], p.values[1]) for p in FIXED_BUGS + EXPLICIT]
    answers = await exchange(redis_prefix, [raw for _, raw, _ in cases])
    failures = [
        f"{case_id}: {verdict}"
        for (case_id, _, expected), resp in zip(cases, answers, strict=True)
        if (verdict := _verdict(resp, expected)) is not None
    ]
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)


API_KEY = "fuzz-api-key"


@pytest.mark.parametrize(
    ("authorization", "expected"),
    [
        (None, 401),
        ("Bearer wrong", 401),
        ("Bearer", 401),
        ("Basic " + API_KEY, 401),
        (f"bearer {API_KEY}", 200),
        (f"Bearer  {API_KEY} ", 200),
        ("Bearer ☃", 401),
        (f"Bearer {API_KEY}\t", 200),
        (f"Bearer {API_KEY}x", 401),
    ],
)
async def test_api_keys(redis_prefix: str, authorization: str | None, expected: int) -> None:
    """With `api_keys` set, the generation routes take only a configured bearer key."""
    headers = [] if authorization is None else [("Authorization", authorization)]
    (resp,) = await exchange(redis_prefix, [post(CHAT, OK, *headers)], auth={"api_keys": [API_KEY]})
    check_answer(resp)
    assert resp.status == expected, resp


# -- found by fuzzing in router/openai/api.py, fixed there -----------------------------------------


def test_integral_floats_are_integers() -> None:
    """schemathesis sent `"max_completion_tokens": 16.0`, valid to router/openapi.json (JSON
    Schema's "integer" is a value, not a spelling) and to the workers' pydantic models; the
    router said "must be an integer, not float". It takes it now, and forwards an int."""
    parsed = parse_request(
        COMPLETIONS,
        b'{"model": "llama-3-8b", "prompt": [1.0, 2], "max_tokens": 16.0, "min_tokens": 0.0, '
        b'"n": 1.0}',
        models=(MODEL,),
        max_model_len=None,
    )
    assert parsed.max_tokens == 16 and parsed.prompt_tokens == 2
    fields = {k: parsed.body[k] for k in ("prompt", "max_tokens", "min_tokens", "n")}
    assert fields == {"prompt": [1, 2], "max_tokens": 16, "min_tokens": 0, "n": 1}
    assert all(type(v) is int for v in [*fields["prompt"], *list(fields.values())[1:]])


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'"max_tokens": 1.5', "max_tokens"),
        (b'"max_tokens": 9223372036854775808', "max_tokens"),
        (b'"max_tokens": 1e300', "max_tokens"),
        (b'"min_tokens": 9223372036854775808', "min_tokens"),
        (b'"min_tokens": 1e300', "min_tokens"),
        (b'"n": 1.5', "n"),
    ],
)
def test_integers_beyond_int64_or_with_a_fraction_are_refused(raw: bytes, param: str) -> None:
    """Beyond int64 the router used to forward what a worker's int64 cannot hold (min_tokens
    2**63 went through to the simulator); and now that integral floats count, 1e300 would be
    an integer orjson cannot serialise for the worker."""
    with pytest.raises(InvalidRequest) as err:
        parse_request(
            COMPLETIONS,
            b'{"model": "llama-3-8b", "prompt": "x", ' + raw + b"}",
            models=(MODEL,),
            max_model_len=None,
        )
    assert err.value.param == param


def test_prompt_token_ids_beyond_int64_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="at most") as err:
        parse_request(
            COMPLETIONS,
            b'{"model": "llama-3-8b", "prompt": [9223372036854775808]}',
            models=(MODEL,),
            max_model_len=None,
        )
    assert err.value.param == "prompt"


# -- bugs found by fuzzing in worker registration (router/config.py parse_worker) and the
#    adapters a registered worker may use (router/edge/request_stages.py): fixed, kept as
#    regressions --

REGISTER = b'{"id": "%s", "url": "http://127.0.0.1:9", "role": "decode", %s}'


async def test_registration_with_kv_blocks_beyond_64_bits(redis_prefix: str) -> None:
    answers = await exchange(
        redis_prefix,
        [
            post("/admin/workers", REGISTER % (b"big", b'"kv_blocks": 1e20'), AUTH),
            build_request("GET", "/admin/state", []),
        ],
    )
    for resp in answers:
        check_answer(resp)


async def test_registration_with_a_string_tp_size(redis_prefix: str) -> None:
    perf = b'"perf": {"model": "llama-3-8b", "gpu": "h100", "tp_size": "2"}'
    answers = await exchange(
        redis_prefix,
        [
            post("/admin/workers", REGISTER % (b"tp", perf), AUTH),
        ],
    )
    for resp in answers:
        check_answer(resp)


async def test_registration_with_a_brace_in_the_id(redis_prefix: str) -> None:
    answers = await exchange(
        redis_prefix,
        [
            post("/admin/workers", REGISTER % (b"a{b", b'"kv_blocks": 10'), AUTH),
        ],
    )
    for resp in answers:
        check_answer(resp)


async def test_request_placed_on_a_registered_worker_of_a_new_adapter(redis_prefix: str) -> None:
    """A registered decode worker (same layout, never probed yet, so "healthy") takes a share of
    the placements: send a few requests so one lands on it."""
    register = [
        post("/admin/workers", REGISTER % (f"v{i}".encode(), b'"kv_blocks": 100000'), AUTH)
        for i in range(3)
    ]
    answers = await exchange(redis_prefix, register + [post(CHAT, OK)] * 4)
    assert [r.status for r in answers[:3]] == [201] * 3
    for resp in answers[3:]:
        check_answer(resp)


async def test_registered_layout_model_must_be_a_string(redis_prefix: str) -> None:
    answers = await exchange(
        redis_prefix,
        [
            post(
                "/admin/workers",
                REGISTER % (b"m", b'"kv_blocks": 10, "layout": {"model": 5}'),
                AUTH,
            ),
            build_request("GET", "/v1/models", []),
        ],
    )
    for resp in answers:
        check_answer(resp)
    models = json.loads(answers[-1].body)["data"]
    assert all(isinstance(m["id"], str) for m in models), models


# -- hypothesis -----------------------------------------------------------------------------

# Long runs (FUZZ_EXAMPLES) get a per-test timeout in proportion; the CI default stays 120 s.
LONG_RUN_TIMEOUT = pytest.mark.timeout(120 + EXAMPLES // 10)
FUZZ_SETTINGS = hypothesis.settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("FUZZ_EXAMPLES"),
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
VALIDATED = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "priority",
]


@st.composite
def generation_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid request with some validated fields replaced by arbitrary JSON, pass-through
    fields added, and now and then the bytes broken."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    fields = json.loads(body(path))
    if draw(st.booleans()):  # half of them streamed, some with a usage event
        fields["stream"] = True
        if draw(st.booleans()):
            fields["stream_options"] = {"include_usage": True}
    for key in draw(st.lists(st.sampled_from(VALIDATED), max_size=3, unique=True)):
        if draw(st.booleans()):
            fields.pop(key, None)
        else:
            fields[key] = draw(json_values)
    if path == CHAT and draw(st.booleans()):
        fields["messages"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.text(max_size=5)}, optional={"content": json_values | st.text()}
                ),
                max_size=3,
            )
        )
    fields.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=3)))
    raw = json.dumps(fields, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    cut = draw(st.sampled_from(["none", "none", "none", "truncate", "insert", "replace"]))
    if cut != "none" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        junk = draw(st.binary(min_size=1, max_size=4))
        raw = {
            "truncate": raw[:at],
            "insert": raw[:at] + junk + raw[at:],
            "replace": raw[:at] + junk + raw[at + len(junk) :],
        }[cut]
    return path, raw


# Header values: anything but CR and LF (which would end the header), control characters
# included (aiohttp's parser refuses them, with an OpenAI body now).
header_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=40)
token = st.text(
    st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_.!#$%&'*+^`|~"), min_size=1, max_size=12
)
interesting_headers = st.sampled_from(
    [
        "X-Expected-Output-Tokens",
        "X-Request-Id",
        "Authorization",
        "Content-Type",
        "traceparent",
        "tracestate",
        "x-sim-output-tokens",
        "Accept",
        "Accept-Encoding",
        "Expect",
        "Connection",
        "X-Resumed-Output-Tokens",
        "Cookie",
        "Range",
        "If-None-Match",
    ]
)
headers_lists = st.lists(
    st.tuples(interesting_headers | token, header_text).filter(
        lambda h: (
            # Connection: upgrade or keep-alive would hold the socket open past the answer.
            h[0].lower()
            not in (
                "connection",
                "content-length",
                "transfer-encoding",
                "content-encoding",
                "host",
                "expect",
            )
        )
    ),
    max_size=6,
)


@LONG_RUN_TIMEOUT
async def test_fuzzed_bodies(redis_prefix: str) -> None:
    def work(port: int) -> int:
        sent = 0

        @FUZZ_SETTINGS
        @given(case=generation_bodies())
        def run(case: tuple[str, bytes]) -> None:
            nonlocal sent
            sent += 1
            path, raw = case
            check_answer(send_raw(port, post(path, raw), timeout=DEADLINE_S))

        run()
        return sent

    print(f"\nfuzzed bodies: {await against_live_router(redis_prefix, work)} requests")


@LONG_RUN_TIMEOUT
async def test_fuzzed_headers(redis_prefix: str) -> None:
    def work(port: int) -> int:
        sent = 0

        @FUZZ_SETTINGS
        @given(
            headers=headers_lists, path=st.sampled_from([CHAT, COMPLETIONS]), gzipped=st.booleans()
        )
        def run(headers: list[tuple[str, str]], path: str, gzipped: bool) -> None:
            nonlocal sent
            sent += 1
            data = body(path)
            extra: list[tuple[str | bytes, str | bytes]] = list(headers)
            if gzipped:
                data = gzip.compress(data)
                extra.append(GZIP_HEADER)
            check_answer(
                send_raw(port, build_request("POST", path, extra, data), timeout=DEADLINE_S)
            )

        run()
        return sent

    print(f"\nfuzzed headers: {await against_live_router(redis_prefix, work)} requests")


path_text = st.lists(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters="#?")
    | st.sampled_from(["%00", "%ff", "%2F", "%7B", "%7D", "..", "//", "%", "%zz", "p0", "d0"]),
    max_size=12,
).map("".join)


@LONG_RUN_TIMEOUT
async def test_fuzzed_paths_and_methods(redis_prefix: str) -> None:
    def work(port: int) -> int:
        sent = 0

        @FUZZ_SETTINGS
        @given(
            method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"]),
            prefix=st.sampled_from(
                [
                    "/v1/",
                    "/admin/workers/",
                    "/admin/",
                    "/",
                    "/v1/models/",
                    "/admin/tenants/",
                    "/admin/tenants/default/keys/",
                ]
            ),
            rest=path_text,
            query=st.text(
                st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters="#"),
                max_size=40,
            ),
            auth=st.booleans(),
        )
        def run(method: str, prefix: str, rest: str, query: str, auth: bool) -> None:
            nonlocal sent
            sent += 1
            target = prefix + rest + ("?" + query if query else "")
            resp = send_raw(
                port,
                build_request(method, target, [AUTH] if auth else [], b"{}"),
                timeout=DEADLINE_S,
            )
            if method == "HEAD":  # the status and headers of a GET, no body
                assert resp.status < 500, resp
            else:
                check_answer(resp)

        run()
        return sent

    print(f"\nfuzzed paths: {await against_live_router(redis_prefix, work)} requests")


# -- credentials: hostile Authorization and API-key headers on every kind of route ------------
# A closed router: client keys (`api_keys` and a tenant's), the admin token, the read-only token,
# /metrics and /openapi.json not public. Whatever the headers, an answer below 500 with an
# OpenAI body, and no route served (2xx) unless a credential that allows it was sent.

TENANT_KEY = "fuzz-tenant-key"
READ_TOKEN = "fuzz-read-token"
CLOSED: dict[str, Any] = {
    "auth": {
        "api_keys": [API_KEY],
        "admin_read_token": READ_TOKEN,
        "public_metrics": False,
        "public_openapi": False,
    },
    "tenants": [{"name": "t1", "keys": [{"id": "t1-key", "key": TENANT_KEY}]}],
}
# (method, path, body, who may call it: the credentials that serve it; None: anyone)
CLIENT = (API_KEY, TENANT_KEY)
ROUTES: list[tuple[str, str, bytes, tuple[str, ...] | None]] = [
    ("POST", CHAT, OK, CLIENT),
    ("POST", COMPLETIONS, body(COMPLETIONS), CLIENT),
    ("POST", "/tokenize", body(COMPLETIONS), CLIENT),  # a passthrough route
    ("GET", "/v1/models", b"", None),
    ("GET", "/metrics", b"", (*CLIENT, READ_TOKEN, ADMIN_TOKEN)),
    ("GET", "/openapi.json", b"", (*CLIENT, READ_TOKEN, ADMIN_TOKEN)),
    ("GET", "/admin/tenants", b"", (READ_TOKEN, ADMIN_TOKEN)),
    ("GET", "/admin/state", b"", (READ_TOKEN, ADMIN_TOKEN)),
    ("POST", "/admin/tenants/t1/keys", b"", (ADMIN_TOKEN,)),
    ("POST", "/admin/tenants/t1/keys/t1-key/rotate", b"", (ADMIN_TOKEN,)),
    ("DELETE", "/admin/tenants/t1/keys/t1-key", b"", (ADMIN_TOKEN,)),
    ("POST", "/admin/workers/p0/drain", b"", (ADMIN_TOKEN,)),
]
Header = tuple[str | bytes, str | bytes]


def _as_bytes(v: str | bytes) -> bytes:
    return v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass")


def credentials_request(method: str, path: str, data: bytes, headers: list[Header]) -> bytes:
    return build_request(method, path, [JSON_CT, *headers] if data else list(headers), data)


def check_credentials(
    resp: RawResponse, headers: list[Header], allowed: tuple[str, ...] | None
) -> None:
    """`check_answer`, and: served only if an Authorization header held a credential that
    allows the route (held somewhere in it: a one-way check, no second parser to agree with)."""
    check_answer(resp)
    if allowed is None or resp.status >= 300:
        return
    sent = [_as_bytes(v) for n, v in headers if _as_bytes(n).lower() == b"authorization"]
    assert any(c.encode() in v for c in allowed for v in sent), f"served without one: {resp!r}"


# Headers a client may send: each answered below 500, served only with a credential it allows.
HOSTILE_CREDENTIALS: list[Any] = [
    pytest.param([("Authorization", b"Bearer \xff\xfe")], id="bearer-not-utf8"),
    pytest.param([("Authorization", b"Bearer caf\xe9")], id="bearer-latin-1"),
    pytest.param([("Authorization", b"Bearer \xed\xa0\x80")], id="bearer-utf8-surrogate"),
    pytest.param([("Authorization", b"Bearer \xc0\xaf")], id="bearer-overlong-utf8"),
    pytest.param([("Authorization", API_KEY.encode() + b"\xff")], id="no-scheme-not-utf8"),
    pytest.param([("Authorization", b"\xff\xfe " + API_KEY.encode())], id="scheme-not-utf8"),
    pytest.param([("Authorization", "Bearer " + API_KEY + "é")], id="key-and-non-ascii"),
    pytest.param([("Authorization", "Bearer 😀\u202e")], id="bearer-emoji-rtl"),
    pytest.param([("Authorization", "Bëarer " + API_KEY)], id="scheme-non-ascii"),
    pytest.param([("Authorization", "Bearer ")], id="bearer-empty"),
    pytest.param([("Authorization", "Bearer")], id="bearer-alone"),
    pytest.param([("Authorization", "Bearer " + " " * 200)], id="bearer-spaces"),
    pytest.param([("Authorization", "")], id="authorization-empty"),
    pytest.param([("Authorization", "Bearer\t" + API_KEY)], id="bearer-tab"),
    pytest.param([("Authorization", "Bearer a b c")], id="bearer-three-words"),
    pytest.param([("Authorization", b"Bearer a\x00b")], id="bearer-nul"),
    pytest.param([("Authorization", b"Bearer a\x01b")], id="bearer-control"),
    pytest.param([("Authorization", b"Bearer a\x7fb")], id="bearer-del"),
    pytest.param([("Authorization", "Bearer " + "a" * 8000)], id="bearer-8k"),
    pytest.param([("Authorization", "Bearer " + "a" * 65536)], id="bearer-64k"),
    pytest.param([("Authorization", "Bearer " + "é" * 4000)], id="bearer-8k-non-ascii"),
    pytest.param([("Authorization", f"Basic {API_KEY}")], id="basic-with-the-key"),
    pytest.param([("Authorization", f"Token {API_KEY}")], id="token-scheme"),
    pytest.param([("Authorization", f"Bearer {i}") for i in range(100)], id="100-authorizations"),
    pytest.param(
        [
            *[("Authorization", f"Bearer {i}") for i in range(50)],
            ("Authorization", f"Bearer {API_KEY}"),
        ],
        id="the-key-after-50-wrong",
    ),
    pytest.param([("X-Api-Key", API_KEY)], id="x-api-key"),
    pytest.param([("api-key", API_KEY)], id="azure-api-key"),
    pytest.param([("Proxy-Authorization", f"Bearer {API_KEY}")], id="proxy-authorization"),
    pytest.param([("X-Api-Key", b"\xff\xfe")], id="x-api-key-not-utf8"),
    pytest.param([("X-Api-Key", "k" * 8000)], id="x-api-key-8k"),
    pytest.param([("X-Api-Key", f"{i}") for i in range(100)], id="100-x-api-keys"),
    pytest.param(
        [("Authorization", b"Bearer \xff"), ("X-Api-Key", API_KEY), ("api-key", "é")],
        id="everything-at-once",
    ),
]


@pytest.mark.parametrize("headers", HOSTILE_CREDENTIALS)
async def test_hostile_credentials(redis_prefix: str, headers: list[Header]) -> None:
    """Each case on every kind of route (client, passthrough, open, scrape, admin read and
    write, the tenant key routes). Found: a bearer token that is not UTF-8 was a 500 on every
    one of them (router/edge/auth.py `bearer_token`)."""
    requests = [credentials_request(m, p, d, headers) for m, p, d, _ in ROUTES]
    answers = await exchange(redis_prefix, requests, **CLOSED)
    failures = []
    for (method, path, _, allowed), resp in zip(ROUTES, answers, strict=True):
        try:
            check_credentials(resp, headers, allowed)
        except AssertionError as exc:
            failures.append(f"{method} {path}: {exc}")
    assert not failures, "\n".join(failures)


credential_names = st.sampled_from(
    [
        "Authorization",
        "authorization",
        "AUTHORIZATION",
        "X-Api-Key",
        "api-key",
        "Proxy-Authorization",
        "X-Auth-Token",
    ]
)
# Never the admin token: the write routes (a rotation, a drain) would change what later
# examples see. The credentials the router takes are mixed in as they are, with junk around
# them, or not at all.
credential_bodies = (
    st.sampled_from([API_KEY, TENANT_KEY, READ_TOKEN]).map(str.encode)
    | st.tuples(
        st.sampled_from([API_KEY, TENANT_KEY, READ_TOKEN]).map(str.encode),
        st.binary(max_size=4).filter(lambda b: b"\r" not in b and b"\n" not in b),
    ).map(lambda t: t[0] + t[1])
    | st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
    | st.tuples(st.sampled_from([b"a", b"\xff", "é".encode(), b" "]), st.integers(0, 10_000)).map(
        lambda t: t[0] * t[1]
    )
)
credential_values = st.tuples(
    st.sampled_from([b"Bearer ", b"bearer ", b"BEARER ", b"Bearer", b"Bearer  ", b"Basic ", b""]),
    credential_bodies,
).map(lambda t: t[0] + t[1])


@LONG_RUN_TIMEOUT
async def test_fuzzed_credentials(redis_prefix: str) -> None:
    def work(port: int) -> int:
        sent = 0

        @FUZZ_SETTINGS
        @given(
            headers=st.lists(st.tuples(credential_names, credential_values), max_size=6),
            repeat=st.sampled_from([1, 1, 1, 2, 40]),
            route=st.sampled_from(ROUTES),
        )
        def run(
            headers: list[Header],
            repeat: int,
            route: tuple[str, str, bytes, tuple[str, ...] | None],
        ) -> None:
            nonlocal sent
            sent += 1
            method, path, data, allowed = route
            headers = headers * repeat
            request = credentials_request(method, path, data, headers)
            check_credentials(send_raw(port, request, timeout=DEADLINE_S), headers, allowed)

        run()
        return sent

    sent = await against_live_router(redis_prefix, work, **CLOSED)
    print(f"\nfuzzed credentials: {sent} requests")
