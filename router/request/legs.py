"""The HTTP legs of one attempt: prefill, KV handoff, decode (docs/design.md §2).

Entry point: `Legs.open(call, attempt, ask)` returns the decode worker's open answer (status
200, body unread) as a `DecodeAnswer`, bound to the relay that moves it (the leg picks the
splice or the aiohttp relay, once), or raises a `LegFailure`. Two shapes, by the pair
(router/request/pairing.py):
- vLLM NIXL pull mode: the prefill leg first; its `kv_transfer_params` go into the decode leg;
- SGLang rooms / vLLM Mooncake (`concurrent_legs`): both legs at once, the decode answer
  returned as soon as it starts, a leg that fails cancels the other.
Every leg's breaker and error accounting is one context, `leg_errors(metrics, side, worker)`
(the passthrough routes' one-worker leg uses it too: router/request/one_worker.py). A leg is
judged by its answer, not by its status line: the prefill's is checked for its KV handle inside
that context, and the decode's verdict waits for the end of its answer (`decode_answered`,
`stream_failure`; `Attempt.decode_verdict`), so a worker that answers 200 and then garbage
opens its breaker like one that answers 500 (issue 20).

Invariant kept here: a prefill is never sent without a decode reservation in hand.

Round trips: the stranded-KV entry of a pulled prefill is written with the reservation, before
the prefill is sent (router/request/reserve.py), so nothing is awaited between the prefill's
answer and the decode leg; its owner (router/request/holdings.py `StrandedEntry`) is told the
prefill answered (`ready`) and, by the relay's first token, that the decode took the KV
(`accepted`) (docs/benchmarks-overhead.md, "Round trips").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from router.adapters import ProtocolViolation, prefill_target
from router.adapters.dp_rank import rank_body, rank_headers
from router.config import Settings
from router.errors import DeadlineExceeded, InvalidRequest, Unavailable, UpstreamError
from router.metrics import RouterMetrics
from router.openai.api import RESPONSES
from router.openai.responses_pd import prefill_body as responses_prefill_body
from router.relay.aiohttp_relay import relay_sse
from router.relay.contract import Relay, RelayResult
from router.relay.splice import relay_splice
from router.relay.upstream_pool import SplicePool
from router.request.attempt import Ask, Attempt, Call, LegFailure, upstream_failure
from router.request.pairing import Pairing
from router.upstream_headers import upstream_headers
from router.workers.breaker import Verdict
from router.workers.loras import LoraBook
from router.workers.membership import Membership
from router.workers.worker_state import WorkerState

__all__ = ["DecodeAnswer", "Legs", "RESUMED_HEADER", "leg_errors"]

RESUMED_HEADER = "X-Resumed-Output-Tokens"


@contextlib.asynccontextmanager
async def leg_errors(
    metrics: RouterMetrics,
    side: str,
    worker: WorkerState,
    timeout_s: float | None = None,
    deferred: bool = False,
) -> AsyncIterator[Verdict]:
    """One leg to `worker`: its breaker is charged by the outcome, its errors are counted, and a
    transport failure (or, with `timeout_s`, no answer in time) becomes a retryable LegFailure.
    Every leg's: the prefill's and decode's here, the one worker's of a passthrough route
    (router/request/one_worker.py).

    A worker's error answer (a LegFailure raised in the block) charges the breaker only when
    retrying can help and the worker is to blame: not for the client's bad request, and on the
    decode side not for a KV handle that expired (the worker is fine). A block that ends well
    is a success, unless `deferred`: then the yielded verdict is the caller's to give once the
    answer is read. The request's own deadline, or its cancellation, is no verdict on the
    worker (a half-open probe's place is given back)."""
    spec = worker.spec
    verdict = worker.breaker.dispatch()
    if verdict is None:  # its breaker opened, or took its probe, since this pair was placed
        metrics.upstream_errors.labels(side=side, kind="breaker_open").inc()
        refused = Unavailable(f"{side} worker {spec.id}'s circuit breaker is open", retry_after_s=1)
        raise LegFailure(side, spec.id, refused, True)
    try:
        async with asyncio.timeout(timeout_s):
            yield verdict
    except LegFailure as f:
        # The labels as they have always been: the decode's by HTTP status, the prefill's by
        # the error's class; an answer that is not one, "protocol".
        kind = f.kind or (str(f.status) if side == "decode" else type(f.error).__name__)
        metrics.upstream_errors.labels(side=side, kind=kind).inc()
        if f.retryable and not (side == "decode" and f.kv_handle):
            verdict.failed()
        else:
            verdict.ok()
        raise
    except aiohttp.ClientError as exc:  # before TimeoutError: some are TimeoutErrors too
        metrics.upstream_errors.labels(side=side, kind="connection").inc()
        verdict.failed()
        err = UpstreamError(f"{side} worker {spec.id} failed: {exc!r}")
        raise LegFailure(side, spec.id, err, True) from exc
    except TimeoutError as exc:
        if timeout_s is None:
            verdict.abandon()
            raise  # the request's own deadline, not this leg's
        metrics.upstream_errors.labels(side=side, kind="timeout").inc()
        verdict.failed()
        deadline = DeadlineExceeded(f"{side} worker {spec.id} did not answer within {timeout_s} s")
        raise LegFailure(side, spec.id, deadline, True) from exc
    except BaseException:
        verdict.abandon()  # cancelled: the client left, or the other leg failed
        raise
    if not deferred:
        verdict.ok()


@dataclass(slots=True)
class DecodeAnswer:
    """The decode leg's open answer, bound to its relay (`answer`), and the worker that gives
    it: the breaker verdict it is owed is given here once the answer is read."""

    answer: Relay[Any]
    worker: WorkerState
    attempt: Attempt
    metrics: RouterMetrics

    def answered(self) -> None:
        """The answer is whole: the success the worker's breaker was owed since the leg opened
        (a whole answer, a stream to its end, or the worker's verdict on the request)."""
        if self.attempt.decode_verdict is not None:
            self.attempt.decode_verdict.ok()

    def failure(self, result: RelayResult) -> LegFailure:
        """Whose fault a broken answer is: a failed concurrent prefill leg cut it, or the
        decode worker."""
        attempt, spec = self.attempt, self.worker.spec
        partner = attempt.partner
        if partner is not None and partner.done() and not partner.cancelled():
            exc = partner.exception()
            if isinstance(exc, LegFailure):
                if attempt.decode_verdict is not None:
                    attempt.decode_verdict.abandon()  # cut because of the prefill: not its fault
                return exc
        if attempt.decode_verdict is not None:
            attempt.decode_verdict.failed()
        else:  # pragma: no cover - every relayed answer comes from _open_decode
            self.worker.breaker.on_failure()
        kind = result.error_kind or "stream_cut"
        self.metrics.upstream_errors.labels(side="decode", kind=kind).inc()
        reason = f"decode worker {spec.id} ended the stream early: {result.upstream_error}"
        return LegFailure("decode", spec.id, UpstreamError(reason), True)


@dataclass(slots=True)
class Legs:
    """The legs stage: what it needs of the replica, handed to it once."""

    settings: Settings
    session: aiohttp.ClientSession
    splice: SplicePool | None  # the PD legs' raw client (http:// workers) when relay == "splice"
    members: Membership
    pairing: Pairing
    metrics: RouterMetrics
    clock: Callable[[], float]
    loras: LoraBook | None = None  # the adapters each side must hold first (docs/lora.md)

    def __repr__(self) -> str:
        return f"Legs(relay={self.settings.upstream.relay})"

    async def open(self, call: Call, attempt: Attempt, ask: Ask) -> DecodeAnswer:
        """Prefill (when the pair has a prefill worker) and open the decode stream."""
        prefill_id = attempt.candidate.prefill_id
        if prefill_id is not None and call.parsed.n > 1 and self.pairing.sglang(prefill_id):
            # SGLang 0.5.23 sends parallel samples and their prefix warm-up under one bootstrap
            # room (tokenizer_manager.py, `parallel_sample_num`): on a PD pair the decode
            # waits for KV that never comes, every time. A clear refusal, not a 3-minute hang.
            raise InvalidRequest(
                "'n' > 1 is not served by SGLang prefill/decode pairs (SGLang sends the "
                "samples under one bootstrap room and the decode never gets their KV); send "
                "n requests of one choice each",
                param="n",
            )
        if prefill_id is not None and self.pairing.decode_alone(call.parsed.n, prefill_id):
            prefill_id = None  # the decode worker prefills it itself
        concurrent = prefill_id is not None and self.pairing.concurrent(prefill_id)
        await self._adapters_loaded(call, prefill_id, attempt.candidate.decode_id)
        if concurrent:
            return await self._concurrent_legs(call, attempt, ask)
        body = ask.body
        if prefill_id is not None:
            kv = await self._prefill(call, attempt, ask)
            decode = self.members.worker(attempt.candidate.decode_id)
            body = self.pairing.pull_adapter(decode).decode_body(ask.body, kv)
        return await self._open_decode(call, attempt, body, ask.resumed)

    async def _adapters_loaded(self, call: Call, prefill_id: str | None, decode_id: str) -> None:
        """A LoRA request's adapter on both workers of its pair before the prefill leg: loaded
        where it is not held, both at once (router/workers/loras.py). A load that fails raises
        its 503 for this request alone: no breaker is charged, no retry spent."""
        loras, model = self.loras, call.parsed.model
        if loras is None or loras.known(model) is None:
            return
        ids = [decode_id] if prefill_id is None else [prefill_id, decode_id]
        specs = [self.members.worker(i).spec for i in ids]
        done = await asyncio.gather(
            *(loras.ensure(self.session, s, model) for s in specs), return_exceptions=True
        )
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome

    def leg_errors(
        self,
        side: str,
        worker: WorkerState,
        timeout_s: float | None = None,
        deferred: bool = False,
    ) -> contextlib.AbstractAsyncContextManager[Verdict]:
        """The module's `leg_errors`, with this stage's metrics."""
        return leg_errors(self.metrics, side, worker, timeout_s, deferred)

    def _headers(self, call: Call, worker: WorkerState, resumed_tokens: int = 0) -> dict[str, str]:
        """Every path's upstream headers (router/upstream_headers.py), and what only a leg
        knows: a resumed stream's token count, its tracing span."""
        headers = upstream_headers(self.settings, call.headers, call.request_id, worker.spec)
        # A data-parallel rank target's rank, over any the client sent (router/adapters/dp_rank.py)
        headers.update(rank_headers(worker.spec.adapter, worker.spec.dp_rank))
        if resumed_tokens:
            headers[RESUMED_HEADER] = str(resumed_tokens)
        call.trace.inject(headers, "prefill" if worker.spec.role == "prefill" else "decode")
        return headers

    async def _prefill_leg(
        self,
        call: Call,
        attempt: Attempt,
        wire_body: dict[str, Any],
        ask: Ask,
        answer: Callable[[bytes], Any] | None = None,
    ) -> Any:
        """POST the prefill leg; its answer on 200 (what `answer` makes of it, which raises
        LegFailure for an answer that is not one: the breaker is charged as for an error status),
        else a LegFailure charged to the prefill."""
        worker = self.members.worker(attempt.candidate.prefill_id or "")
        if attempt.decode_id is None:  # pragma: no cover - the invariant, checked loudly
            raise RuntimeError("refusing to prefill without a decode reservation")
        spec = worker.spec
        worker.queued_prompt_tokens += ask.prompt_tokens
        worker.inflight += 1
        worker.recent_prefixes.add(attempt.prefixes)  # as placement read them
        t0 = self.clock()
        call.trace.begin("prefill", worker=spec.id, prompt_tokens=ask.prompt_tokens)
        try:
            async with self.leg_errors("prefill", worker, self.settings.timeouts.prefill_s):
                headers = self._headers(call, worker, ask.resumed)
                status, data = await self._post_whole(
                    spec.url + call.parsed.path,
                    orjson.dumps(rank_body(spec.adapter, wire_body, spec.dp_rank)),
                    headers,
                )
                if status != 200:
                    raise upstream_failure("prefill", spec.id, status, data)
                if answer is not None:
                    return answer(data)
        finally:
            call.trace.finish("prefill")
            worker.queued_prompt_tokens -= ask.prompt_tokens
            worker.inflight -= 1
            self.metrics.prefill_seconds_by(spec.id).observe(self.clock() - t0)
        return data

    async def _post_whole(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """POST `body` and read the whole answer: (status, body). On the raw pool when the
        splice relay is on and the worker is http:// (aiohttp's client leg was the largest
        single item of the request path's profile; moving the prefill off it cut the router's
        CPU per request by ~4-10 %: docs/benchmarks-overhead.md, issue 36), else on aiohttp's
        session. The same deadlines either way: the leg's own (`leg_errors`) and the
        request's; no idle timeout (idle_s 0) and no connect timeout of its own (the session
        sets neither). Its errors are aiohttp.ClientConnectionErrors on both (the same
        retryable leg failures). Cancelled or failed before the answer is whole, the
        connection is dropped (vLLM's abort signal), as aiohttp's response does on leaving
        its block."""
        if self.splice is not None and self.splice.supports(url):
            raw = await self.splice.post(url, body, headers, connect_s=None, idle_s=0.0)
            try:
                return raw.status, await raw.read()
            finally:
                raw.close()  # whole: back to the pool; else dropped
        async with self.session.post(url, data=body, headers=headers) as resp:
            return resp.status, await resp.read()

    async def _prefill(self, call: Call, attempt: Attempt, ask: Ask) -> dict[str, Any]:
        """vLLM NIXL pull mode: prefill first, then hand its kv_transfer_params to decode."""
        worker = self.members.worker(attempt.candidate.prefill_id or "")
        adapter = self.pairing.pull_adapter(worker)
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

        params: dict[str, Any] = await self._prefill_leg(call, attempt, wire_body, ask, kv_handle)
        # The KV now lives on the prefill worker and no decode has it yet: its entry, written
        # pending with the reservation, is ready. No store call is awaited here (issue 12).
        loop = asyncio.get_running_loop()
        answered = loop.time()
        # The prefill worker holds this KV only for its lease: a decode that has not taken it by
        # then never will, so the attempt fails (and is retried) instead of waiting out the TTFT.
        attempt.handoff_by = answered + self.settings.leases.kv_s
        stranded = attempt.stranded
        call.trace.begin(
            "kv_handoff", prefill=worker.spec.id, kv_bytes=stranded.nbytes if stranded else 0
        )
        if stranded is not None:
            stranded.ready(answered)
        return params

    async def _concurrent_legs(self, call: Call, attempt: Attempt, ask: Ask) -> DecodeAnswer:
        """SGLang rooms / vLLM Mooncake: both legs at once. The decode stream is returned as soon
        as it starts (not after the prefill's answer); a leg that fails cancels the other."""
        worker = self.members.worker(attempt.candidate.prefill_id or "")
        adapter = self.pairing.concurrent_adapter(worker)
        spec = worker.spec  # a data-parallel prefill's rank: SGLang's rooms fall on it
        target = prefill_target(
            spec.url, spec.bootstrap_port, spec.engine_id, spec.dp_rank, spec.dp_size
        )
        try:
            if adapter is None:  # pragma: no cover - the pairing said it is concurrent
                raise ProtocolViolation(f"worker {worker.spec.id} has no concurrent legs")
            p_body, d_body = adapter.legs(ask.body, target, call.request_id)
        except ProtocolViolation as exc:
            raise LegFailure("prefill", worker.spec.id, UpstreamError(str(exc)), False) from exc
        loop = asyncio.get_running_loop()
        prefill = loop.create_task(self._prefill_leg(call, attempt, p_body, ask))
        attempt.partner = prefill
        decode = loop.create_task(self._open_decode(call, attempt, d_body, ask.resumed))
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
                decode.result().answer.close()
            raise

        def prefill_ended(task: asyncio.Task[bytes]) -> None:
            # The prefill leg failed while the decode streams: cut the decode (its KV will never
            # come), so the stream is resumed or ended instead of hanging.
            if not task.cancelled() and task.exception() is not None:
                resp.answer.close()

        prefill.add_done_callback(prefill_ended)
        return resp

    async def _open_decode(
        self, call: Call, attempt: Attempt, body: dict[str, Any], resumed: int
    ) -> DecodeAnswer:
        worker = self.members.worker(attempt.candidate.decode_id)
        spec, t = worker.spec, self.settings.timeouts
        call.trace.begin("decode", worker=spec.id)
        answer: Relay[Any]
        body = rank_body(spec.adapter, body, spec.dp_rank)  # an SGLang rank's, in the body
        async with self.leg_errors("decode", worker, deferred=True) as verdict:
            attempt.decode_verdict = verdict  # given when the answer is read (DecodeAnswer)
            headers = self._headers(call, worker, resumed)
            if not call.assembling and self.splice is not None and self.splice.supports(spec.url):
                # Its errors are aiohttp.ClientConnectionErrors: the same retryable failures.
                raw = await self.splice.post(
                    spec.url + call.parsed.path,
                    orjson.dumps(body),
                    headers,
                    connect_s=t.connect_s,
                    idle_s=t.idle_s,
                )
                if raw.status != 200:
                    data = await raw.read()
                    raw.close()
                    raise upstream_failure("decode", spec.id, raw.status, data)
                answer = Relay(raw, relay_splice)
            else:
                resp = await self.session.post(
                    spec.url + call.parsed.path,
                    data=orjson.dumps(body),
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=t.connect_s, sock_read=t.idle_s
                    ),
                )
                if resp.status != 200:
                    data = await resp.read()
                    resp.release()
                    raise upstream_failure("decode", spec.id, resp.status, data)
                answer = Relay(resp, relay_sse)
        return DecodeAnswer(answer, worker, attempt, self.metrics)
