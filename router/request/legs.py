"""The HTTP legs of one attempt: prefill, KV handoff, decode (docs/design.md §2).

Entry point: `open_legs(call, attempt, ask)` returns the decode worker's open answer (status 200,
body unread) or raises a `LegFailure`. Two shapes, by the prefill worker's adapter:
- vLLM NIXL pull mode: the prefill leg first; its `kv_transfer_params` go into the decode leg;
- SGLang rooms / vLLM Mooncake (`concurrent_legs`): both legs at once, the decode answer
  returned as soon as it starts, a leg that fails cancels the other.
Every leg's breaker and error accounting is one context, `leg_errors(side, worker)`. A leg is
judged by its answer, not by its status line: the prefill's is checked for its KV handle inside
that context, and the decode's verdict waits for the end of its answer (`decode_answered`,
`stream_failure`; `Attempt.decode_verdict`), so a worker that answers 200 and then garbage
opens its breaker like one that answers 500 (issue 20).

Invariant kept here: a prefill is never sent without a decode reservation in hand.

Round trips: the stranded-KV entry of a pulled prefill is written with the reservation, before
the prefill is sent (`strand_intent`, router/request/reserve.py), so nothing is awaited between the
prefill's answer and the decode leg; the entry is cleared when the decode shows it took the KV
(`kv_accepted`), as a background job (docs/benchmarks-overhead.md, "Round trips").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import aiohttp
import orjson

from policies.base import Candidate, RequestInfo
from router.adapters import ConcurrentAdapter, ProtocolViolation, WorkerAdapter, prefill_target
from router.errors import DeadlineExceeded, Unavailable, UpstreamError
from router.gateway import Gateway
from router.relay.aiohttp_relay import RelayResult
from router.relay.upstream_pool import SpliceResponse
from router.request.attempt import Ask, Attempt, Call, LegFailure, upstream_failure
from router.responses_pd import RESPONSES
from router.responses_pd import prefill_body as responses_prefill_body
from router.workers.breaker import Verdict
from router.workers.pools import WorkerState
from state.base import StrandIntent

__all__ = [
    "DecodeResponse",
    "READY_MARK_AFTER_S",
    "RESUMED_HEADER",
    "decode_answered",
    "hold_intent",
    "kv_accepted",
    "leg_errors",
    "open_legs",
    "strand_intent",
    "stream_failure",
]

RESUMED_HEADER = "X-Resumed-Output-Tokens"

# How long after the prefill's answer a stranded entry still pending is marked ready (its KV
# lease then counts from the answer, not from the latest the prefill could have answered). A
# decode usually shows it took the KV within milliseconds and the entry is cleared instead, so
# the mark costs no store call for most requests; it matters for KV that sits unaccepted.
READY_MARK_AFTER_S = 1.0

# The decode leg's answer: aiohttp's, or the splice client's (`settings.relay == "splice"`).
DecodeResponse = aiohttp.ClientResponse | SpliceResponse


async def open_legs(call: Call, attempt: Attempt, ask: Ask) -> DecodeResponse:
    """Prefill (when the pair has a prefill worker) and open the decode stream."""
    gw = call.gw
    prefill_id = attempt.candidate.prefill_id
    if prefill_id is not None and _whole_on_decode(gw, call.parsed.n, prefill_id):
        prefill_id = None  # the decode worker prefills it itself
    if prefill_id is not None and _concurrent(gw, prefill_id):
        return await _concurrent_legs(call, attempt, ask)
    body = ask.body
    if prefill_id is not None:
        kv = await _prefill(call, attempt, ask)
        decode = gw.pools.worker(attempt.candidate.decode_id)
        body = _pull_adapter(gw, decode).decode_body(ask.body, kv)
    return await _open_decode(call, attempt, body, ask.resumed)


def _whole_on_decode(gw: Gateway, n: int, prefill_id: str) -> bool:
    """An answer of n > 1 choices is served whole by its decode worker (no prefill leg, no KV
    handoff) in front of vLLM: its NIXL producer frees a prefill's blocks at the first
    reader's notification, and the decode fans n > 1 out into n requests that each pull
    the same handle, so all but the first race that free (docs/real-workers.md, "`n` > 1").
    SGLang's decode workers cannot prefill: there `n` goes to both legs unchanged."""
    if n <= 1:
        return False
    return gw.pools.worker(prefill_id).spec.adapter != "sglang"


def _pull_adapter(gw: Gateway, worker: WorkerState) -> WorkerAdapter:
    """`worker`'s adapter in NIXL pull mode (prefill first, its KV handle to the decode)."""
    adapter = gw.adapters[worker.spec.adapter]
    # The protocol's own flag, not isinstance: a runtime-checkable Protocol's isinstance walks
    # its members on every call (~1 % of the router's CPU at 256 streams, twice per request).
    if getattr(adapter, "concurrent_legs", False):  # pragma: no cover - pairs share one protocol
        err = UpstreamError(f"worker {worker.spec.id} cannot take part in a pulled KV handoff")
        raise LegFailure(worker.spec.role, worker.spec.id, err, False)
    return cast(WorkerAdapter, adapter)


@contextlib.asynccontextmanager
async def leg_errors(
    gw: Gateway,
    side: str,
    worker: WorkerState,
    timeout_s: float | None = None,
    deferred: bool = False,
) -> AsyncIterator[Verdict]:
    """One leg to `worker`: its breaker is charged by the outcome, its errors are counted, and a
    transport failure (or, with `timeout_s`, no answer in time) becomes a retryable LegFailure.

    A worker's error answer (a LegFailure raised in the block) charges the breaker only when
    retrying can help and the worker is to blame: not for the client's bad request, and on the
    decode side not for a KV handle that expired (the worker is fine). A block that ends well
    is a success, unless `deferred`: then the yielded verdict is the caller's to give once the
    answer is read. The request's own deadline, or its cancellation, is no verdict on the
    worker (a half-open probe's place is given back)."""
    spec = worker.spec
    verdict = worker.breaker.dispatch()
    if verdict is None:  # its breaker opened, or took its probe, since this pair was placed
        gw.metrics.upstream_errors.labels(side=side, kind="breaker_open").inc()
        refused = Unavailable(f"{side} worker {spec.id}'s circuit breaker is open", retry_after_s=1)
        raise LegFailure(side, spec.id, refused, True)
    try:
        async with asyncio.timeout(timeout_s):
            yield verdict
    except LegFailure as f:
        # The labels as they have always been: the decode's by HTTP status, the prefill's by
        # the error's class; an answer that is not one, "protocol".
        kind = f.kind or (str(f.status) if side == "decode" else type(f.error).__name__)
        gw.metrics.upstream_errors.labels(side=side, kind=kind).inc()
        if f.retryable and not (side == "decode" and f.kv_handle):
            verdict.failed()
        else:
            verdict.ok()
        raise
    except aiohttp.ClientError as exc:  # before TimeoutError: some are TimeoutErrors too
        gw.metrics.upstream_errors.labels(side=side, kind="connection").inc()
        verdict.failed()
        err = UpstreamError(f"{side} worker {spec.id} failed: {exc!r}")
        raise LegFailure(side, spec.id, err, True) from exc
    except TimeoutError as exc:
        if timeout_s is None:
            verdict.abandon()
            raise  # the request's own deadline, not this leg's
        gw.metrics.upstream_errors.labels(side=side, kind="timeout").inc()
        verdict.failed()
        deadline = DeadlineExceeded(f"{side} worker {spec.id} did not answer within {timeout_s} s")
        raise LegFailure(side, spec.id, deadline, True) from exc
    except BaseException:
        verdict.abandon()  # cancelled: the client left, or the other leg failed
        raise
    if not deferred:
        verdict.ok()


def decode_answered(attempt: Attempt) -> None:
    """The decode worker's answer is whole: the success its breaker was owed since the leg
    opened (a whole answer, a stream to its end, or the worker's verdict on the request)."""
    if attempt.decode_verdict is not None:
        attempt.decode_verdict.ok()


def _headers(call: Call, worker: WorkerState, resumed_tokens: int = 0) -> dict[str, str]:
    s = call.gw.settings
    headers = {"Content-Type": "application/json", "X-Request-Id": call.request_id}
    for name in s.forward_headers:
        value = call.headers.get(name)
        if value is not None:
            headers[name] = value
    if resumed_tokens:
        headers[RESUMED_HEADER] = str(resumed_tokens)
    if worker.spec.api_key:
        headers["Authorization"] = "Bearer " + worker.spec.api_key.reveal()
    elif s.forward_client_auth and "Authorization" in call.headers:
        headers["Authorization"] = call.headers["Authorization"]
    call.trace.inject(headers, "prefill" if worker.spec.role == "prefill" else "decode")
    return headers


async def _prefill_leg(
    call: Call,
    attempt: Attempt,
    wire_body: dict[str, Any],
    ask: Ask,
    answer: Callable[[bytes], Any] | None = None,
) -> Any:
    """POST the prefill leg; its answer on 200 (what `answer` makes of it, which raises
    LegFailure for an answer that is not one: the breaker is charged as for an error status),
    else a LegFailure charged to the prefill."""
    gw = call.gw
    worker = gw.pools.worker(attempt.candidate.prefill_id or "")
    if attempt.decode_id is None:  # pragma: no cover - the invariant, checked loudly
        raise RuntimeError("refusing to prefill without a decode reservation")
    spec = worker.spec
    worker.queued_prompt_tokens += ask.prompt_tokens
    worker.inflight += 1
    worker.recent_prefixes.add(call.prefixes)
    t0 = gw.clock()
    call.trace.begin("prefill", worker=spec.id, prompt_tokens=ask.prompt_tokens)
    try:
        async with leg_errors(gw, "prefill", worker, gw.settings.timeouts.prefill_s):
            async with gw.session.post(
                spec.url + call.parsed.path,
                data=orjson.dumps(wire_body),
                headers=_headers(call, worker, ask.resumed),
            ) as resp:
                data = await resp.read()
            if resp.status != 200:
                raise upstream_failure("prefill", spec.id, resp.status, data)
            if answer is not None:
                return answer(data)
    finally:
        call.trace.finish("prefill")
        worker.queued_prompt_tokens -= ask.prompt_tokens
        worker.inflight -= 1
        gw.metrics.prefill_seconds.labels(worker=spec.id).observe(gw.clock() - t0)
    return data


async def _prefill(call: Call, attempt: Attempt, ask: Ask) -> dict[str, Any]:
    """vLLM NIXL pull mode: prefill first, then hand its kv_transfer_params to decode."""
    gw = call.gw
    worker = gw.pools.worker(attempt.candidate.prefill_id or "")
    adapter = _pull_adapter(gw, worker)
    wire_body = adapter.prefill_body(ask.body)
    if call.parsed.path == RESPONSES:
        wire_body = responses_prefill_body(wire_body)  # its cap is `max_output_tokens`

    def kv_handle(data: bytes) -> dict[str, Any]:
        try:
            return adapter.kv_params(orjson.loads(data))
        except (orjson.JSONDecodeError, ProtocolViolation) as exc:
            err = UpstreamError(f"prefill worker {worker.spec.id} answered badly: {exc}")
            failure = LegFailure("prefill", worker.spec.id, err, True)
            failure.kind = "protocol"
            raise failure from exc

    params: dict[str, Any] = await _prefill_leg(call, attempt, wire_body, ask, kv_handle)
    # The KV now lives on the prefill worker and no decode has it yet: its entry, written
    # pending with the reservation, is ready. No store call is awaited here (issue 12).
    loop = asyncio.get_running_loop()
    answered = loop.time()
    # The prefill worker holds this KV only for its lease: a decode that has not taken it by
    # then never will, so the attempt fails (and is retried) instead of waiting out the TTFT.
    attempt.handoff_by = answered + gw.settings.kv_lease_s
    call.trace.begin("kv_handoff", prefill=worker.spec.id, kv_bytes=attempt.stranded_bytes)
    if attempt.stranded_on is not None:
        attempt.ready_mark = loop.call_later(READY_MARK_AFTER_S, _mark_ready, gw, attempt, answered)
    return params


def strand_intent(
    gw: Gateway, info: RequestInfo, reservation_id: str, cand: Candidate
) -> StrandIntent | None:
    """The stranded-KV entry the prefill of `cand` will leave, to be written with its
    reservation; None when no KV waits between the legs: a local pair, concurrent legs (their
    decode takes the KV as it is built), an answer of n > 1 choices the decode prefills
    itself (`_whole_on_decode`). Its id is the request's and the reservation's:
    a client may reuse X-Request-Id values, and a retry's entry must not be the same as the
    one an owed unstrand of the failed try is still to clear."""
    prefill_id = cand.prefill_id
    if (
        prefill_id is None
        or _whole_on_decode(gw, info.n, prefill_id)
        or _concurrent(gw, prefill_id)
    ):
        return None
    t = gw.settings.timeouts
    return StrandIntent(
        prefill_id,
        f"{info.request_id}/{reservation_id}",
        info.prompt_tokens * gw.settings.kv_bytes_per_token,
        # The prefill answers (or is given up on) within its leg's timeout and the request's
        # time to first token: until then the reaper must not count its KV lease.
        min(t.prefill_s, t.ttft_s),
    )


def hold_intent(gw: Gateway, attempt: Attempt, intent: StrandIntent, written: bool) -> None:
    """The reservation holds: its attempt owns the entry (released with it,
    router/request/release.py),
    which counts on the prefill worker from now on (placement's stranded-KV cap, a role drain
    waiting for the KV to leave)."""
    attempt.stranded_on, attempt.stranded_id = intent.prefill_id, intent.request_id
    attempt.stranded_bytes = intent.nbytes
    gw.pools.note_stranded(intent.prefill_id, intent.nbytes)
    gw.leases.stranded(intent, written)


def _mark_ready(gw: Gateway, attempt: Attempt, answered: float) -> None:
    attempt.ready_mark = None
    if attempt.stranded_on is None:  # pragma: no cover - the timer is cancelled with the entry
        return
    age = asyncio.get_running_loop().time() - answered
    gw.tasks.job(gw.leases.kv_ready(attempt.stranded_on, attempt.stranded_id, age), "kv-ready")


def _concurrent(gw: Gateway, prefill_id: str) -> bool:
    spec = gw.pools.worker(prefill_id).spec
    return bool(getattr(gw.adapters[spec.adapter], "concurrent_legs", False))


async def _concurrent_legs(call: Call, attempt: Attempt, ask: Ask) -> DecodeResponse:
    """SGLang rooms / vLLM Mooncake: both legs at once. The decode stream is returned as soon
    as it starts (not after the prefill's answer); a leg that fails cancels the other."""
    gw = call.gw
    worker = gw.pools.worker(attempt.candidate.prefill_id or "")
    adapter = gw.adapters[worker.spec.adapter]
    target = prefill_target(worker.spec.url, worker.spec.bootstrap_port, worker.spec.engine_id)
    try:
        if not isinstance(adapter, ConcurrentAdapter):  # pragma: no cover - `_concurrent` said so
            raise ProtocolViolation(f"worker {worker.spec.id} has no concurrent legs")
        p_body, d_body = adapter.legs(ask.body, target, call.request_id)
    except ProtocolViolation as exc:
        raise LegFailure("prefill", worker.spec.id, UpstreamError(str(exc)), False) from exc
    loop = asyncio.get_running_loop()
    prefill = loop.create_task(_prefill_leg(call, attempt, p_body, ask))
    attempt.partner = prefill
    decode = loop.create_task(_open_decode(call, attempt, d_body, ask.resumed))
    try:
        await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
        failed = prefill.exception() if prefill.done() else None
        if failed is not None:
            raise failed
        resp = await decode
    except BaseException:
        for task in (prefill, decode):
            task.cancel()
        done, _ = await asyncio.wait({prefill, decode})
        if decode in done and not decode.cancelled() and decode.exception() is None:
            decode.result().close()
        raise

    def prefill_ended(task: asyncio.Task[bytes]) -> None:
        # The prefill leg failed while the decode streams: cut the decode (its KV will never
        # come), so the stream is resumed or ended instead of hanging.
        if not task.cancelled() and task.exception() is not None:
            resp.close()

    prefill.add_done_callback(prefill_ended)
    return resp


async def _open_decode(
    call: Call, attempt: Attempt, body: dict[str, Any], resumed: int
) -> DecodeResponse:
    gw = call.gw
    worker = gw.pools.worker(attempt.candidate.decode_id)
    spec, t = worker.spec, gw.settings.timeouts
    call.trace.begin("decode", worker=spec.id)
    resp: DecodeResponse
    async with leg_errors(gw, "decode", worker, deferred=True) as verdict:
        attempt.decode_verdict = (
            verdict  # given when the answer is read (router/request/respond.py)
        )
        if not call.assembling and gw.splice is not None and gw.splice.supports(spec.url):
            # Its errors are aiohttp.ClientConnectionErrors: the same retryable failures.
            resp = await gw.splice.post(
                spec.url + call.parsed.path,
                orjson.dumps(body),
                _headers(call, worker, resumed),
                connect_s=t.connect_s,
                idle_s=t.idle_s,
            )
        else:
            resp = await gw.session.post(
                spec.url + call.parsed.path,
                data=orjson.dumps(body),
                headers=_headers(call, worker, resumed),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=t.connect_s, sock_read=t.idle_s
                ),
            )
        if resp.status != 200:
            data = await resp.read()
            resp.release()
            raise upstream_failure("decode", spec.id, resp.status, data)
    return resp


def kv_accepted(call: Call, attempt: Attempt) -> None:
    """The decode worker produced output, so it holds the KV: clear the stranded entry."""
    gw = call.gw
    call.trace.finish("kv_handoff")
    if attempt.ready_mark is not None:
        attempt.ready_mark.cancel()
        attempt.ready_mark = None
    if attempt.stranded_on is not None:
        prefill_id, attempt.stranded_on = attempt.stranded_on, None
        gw.pools.note_stranded(prefill_id, -attempt.stranded_bytes)
        gw.tasks.job(gw.leases.unstrand(prefill_id, attempt.stranded_id), "unstrand")


def stream_failure(
    gw: Gateway, attempt: Attempt, worker: WorkerState, result: RelayResult
) -> LegFailure:
    """Whose fault a broken stream is: a failed concurrent prefill leg cut it, or the decode."""
    partner = attempt.partner
    if partner is not None and partner.done() and not partner.cancelled():
        exc = partner.exception()
        if isinstance(exc, LegFailure):
            if attempt.decode_verdict is not None:
                attempt.decode_verdict.abandon()  # cut because of the prefill, not its fault
            return exc
    if attempt.decode_verdict is not None:
        attempt.decode_verdict.failed()
    else:  # pragma: no cover - every relayed answer comes from _open_decode
        worker.breaker.on_failure()
    kind = result.error_kind or "stream_cut"
    gw.metrics.upstream_errors.labels(side="decode", kind=kind).inc()
    reason = f"decode worker {worker.spec.id} ended the stream early: {result.upstream_error}"
    return LegFailure("decode", worker.spec.id, UpstreamError(reason), True)
