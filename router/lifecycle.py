"""One request's life (docs/design.md §2):

    admit → estimate → place (P and D together) → reserve on D → prefill on P → KV handoff
    → decode on D → relay the stream → release
       └─ a leg fails before the client got a byte: release, retry on another pair (budgeted)
       └─ decode dies mid-stream: resume — prefill prompt + tokens sent, continue the same stream

Invariants kept here: a prefill is never sent without a decode reservation in hand; each
attempt's reservation and stranded-KV entry are released exactly once, in `finally` under
`asyncio.shield`, whatever happens; when the client goes away both upstream connections are
closed (closing is vLLM's abort signal); a client never gets a token twice nor misses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from policies.base import Rejection, RequestInfo, blocks_for
from router.adapters import ProtocolViolation, prefill_target
from router.admission import QueueFull
from router.api import CHAT, ParsedRequest
from router.assemble import DISCARD, assemble, stream_upstream, streamable
from router.attempt import Attempt, LegFailure, upstream_failure
from router.errors import (
    DeadlineExceeded,
    NoCapacity,
    RouterError,
    Unavailable,
    UpstreamError,
    UpstreamRejected,
    as_router_error,
    sse_error_frame,
)
from router.gateway import Gateway
from router.pools import WorkerState
from router.prefixes import prefix_hashes
from router.relay import RelayResult, parse_sent_text, relay_sse
from router.resume import resume_body
from router.splice import SpliceResponse, relay_splice
from state.base import StoreError

__all__ = ["RequestFlow"]

log = logging.getLogger(__name__)

RESUMED_HEADER = "X-Resumed-Output-Tokens"

# The decode leg's answer: aiohttp's, or the splice client's (`settings.relay == "splice"`).
DecodeResponse = aiohttp.ClientResponse | SpliceResponse


def _client_request_id(value: str | None) -> str:
    """The client's X-Request-Id when it is a sane token (visible ASCII, at most 128
    characters: it goes into upstream headers, logs and the ledger), else one of ours."""
    if value and len(value) <= 128 and value.isascii() and value.isprintable() and " " not in value:
        return value
    return f"dr-{uuid.uuid4().hex}"


class RequestFlow:
    """Serves one validated request. `run()` returns the response; `cleanup()` runs after."""

    def __init__(self, gw: Gateway, parsed: ParsedRequest, http: web.Request) -> None:
        self.gw = gw
        self.parsed = parsed
        self.http = http
        self.request_id = _client_request_id(http.headers.get("X-Request-Id"))
        self.started = gw.clock()
        self.info: RequestInfo | None = None
        self.attempt: Attempt | None = None
        self.attempts = 0
        self.avoid: set[str] = set()
        self.output_tokens: int | None = None
        self.status = 200
        self.admitted = False
        self.ticket = gw.admission.ticket()
        self.prefixes = prefix_hashes(parsed.path, parsed.body)
        self._rng = random.Random(self.request_id)
        self.trace = gw.tracing.request(parsed.path, http.headers, self.request_id)
        self._deadline: Any = None
        self._first_token_seen = False
        self._client: web.StreamResponse | None = None  # once the client's stream has started
        self._settled = False  # released and recorded (settle)
        self._interrupted: RouterError | None = None  # the replica shuts down (interrupt)
        self._first_token_at: float | None = None
        # Asked for whole, streamed from the decode worker and assembled (router/assemble.py).
        self.assembling = (
            not parsed.stream and gw.settings.assemble_non_streaming and streamable(parsed.body)
        )

    def __repr__(self) -> str:
        return f"RequestFlow({self.request_id}, attempts={self.attempts}, {self.attempt!r})"

    # -- plumbing ----------------------------------------------------------------------------
    def _headers(self, worker: WorkerState, resumed_tokens: int = 0) -> dict[str, str]:
        s = self.gw.settings
        headers = {"Content-Type": "application/json", "X-Request-Id": self.request_id}
        for name in s.forward_headers:
            value = self.http.headers.get(name)
            if value is not None:
                headers[name] = value
        if resumed_tokens:
            headers[RESUMED_HEADER] = str(resumed_tokens)
        if worker.spec.api_key:
            headers["Authorization"] = f"Bearer {worker.spec.api_key}"
        elif s.forward_client_auth and "Authorization" in self.http.headers:
            headers["Authorization"] = self.http.headers["Authorization"]
        self.trace.inject(headers, "prefill" if worker.spec.role == "prefill" else "decode")
        return headers

    def _loop_deadline(self, flow_time: float) -> float:
        loop = asyncio.get_running_loop()
        return flow_time + (loop.time() - self.gw.clock())

    # -- admission, estimate, place, reserve --------------------------------------------------
    def _request_info(self, prompt_tokens: int, max_tokens: int) -> RequestInfo:
        hint = self.http.headers.get("X-Expected-Output-Tokens")
        priority = self.parsed.body.get("priority")
        return RequestInfo(
            request_id=self.request_id,
            model=self.parsed.model,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            arrival_s=self.started,
            priority=priority if isinstance(priority, int) else 0,
            prefix_hashes=self.prefixes,
            # A hint is advisory: one that is not a plain ASCII number (`²`, `①` pass isdigit()
            # but not int(); 5,000 digits pass neither) is ignored like a missing one, as
            # docs/policies.md says, rather than failing a request that is otherwise fine.
            hint_output_tokens=(
                int(hint) if hint and len(hint) <= 9 and hint.isascii() and hint.isdigit() else None
            ),
        )

    async def _estimate(self, info: RequestInfo) -> RequestInfo:
        gw = self.gw
        keys = gw.estimator.class_keys(info)
        estimate = gw.estimator.estimate(info, await gw.histograms.get(keys))
        return replace(info, estimate=estimate)

    def _forecast(self, info: RequestInfo) -> dict[str, int]:
        """Prediction-based admission (Mooncake): blocks forecast to free on each decode worker
        by the time this request's prefill would finish."""
        gw = self.gw
        speeds = [
            w.spec.perf.prefill_tokens_per_s()
            for w in gw.pools.prefill_workers
            if w.available and w.spec.perf is not None
        ] or [10_000.0]
        queued = min((w.queued_prompt_tokens for w in gw.pools.prefill_workers), default=0)
        horizon = (queued + info.prompt_tokens) / max(speeds)
        return gw.leases.freeing_by(gw.clock() + horizon)

    async def _try_reserve(self, info: RequestInfo) -> Attempt | Rejection:
        gw = self.gw
        decision = gw.policy.place(info, gw.pools.snapshot(frozenset(self.avoid), info.model))
        if isinstance(decision, Rejection) and self.avoid:
            # Avoiding the workers that failed this request left nowhere to go: a worker that
            # failed once may well serve the retry (its circuit breaker decides, not this).
            decision = gw.policy.place(info, gw.pools.snapshot(model=info.model))
        overbook: dict[str, int] = {}
        if isinstance(decision, Rejection) and gw.admission.settings.mode == "predictive":
            overbook = self._forecast(info)
            if overbook:
                view = gw.pools.snapshot(frozenset(self.avoid), info.model, freeing=overbook)
                decision = gw.policy.place(info, view)
        if isinstance(decision, Rejection):
            return decision
        for cand in decision.candidates:
            rid = uuid.uuid4().hex  # ours alone: clients reuse X-Request-Id values
            # Visible to placements made while the store call is under way (no await between
            # the decision and this line).
            gw.pools.note_pending(cand.decode_id, cand.reserve_blocks)
            try:
                reserved = await gw.store.reserve(
                    cand.decode_id,
                    rid,
                    cand.reserve_blocks,
                    gw.settings.reservation_lease_s,
                    overbook_blocks=overbook.get(cand.decode_id, 0),
                )
            except StoreError:
                # The answer was lost, not necessarily the reservation: release it later. No
                # prefill is sent without a reservation in hand, so the request ends in a 503.
                gw.leases.owe_release(cand.decode_id, rid)
                raise
            finally:
                gw.pools.note_pending(cand.decode_id, -cand.reserve_blocks)
            if reserved:
                if overbook:
                    gw.metrics.admitted_on_forecast.inc()
                gw.pools.note_reserved(cand.decode_id, cand.reserve_blocks)
                expected_end = (
                    gw.clock()
                    + cand.predicted_ttft_s
                    + info.reserve_output_tokens * cand.predicted_itl_s
                )
                gw.leases.hold(cand.decode_id, rid, cand.reserve_blocks, expected_end)
                gw.metrics.placements.labels(
                    prefill=cand.prefill_id or "local", decode=cand.decode_id
                ).inc()
                log.debug("placed on %s -> %s", cand.prefill_id or "local", cand.decode_id)
                return Attempt(cand, rid)
            gw.metrics.reserve_conflicts.inc()
        return Rejection(
            "every candidate decode worker filled up while reserving "
            "(other router replicas took the room)",
            1.0,
        )

    def _check_pools_alive(self) -> None:
        """No worker in rotation on one side: waiting for room is pointless, fail fast (503)."""
        pools = self.gw.pools
        decode = [w for w in pools.decode_workers if w.available]
        prefill = [w for w in pools.prefill_workers if w.available]
        if not decode or not (prefill or any(w.spec.role == "both" for w in decode)):
            side = "decode" if not decode else "prefill"
            cooldowns = [w.breaker.cooldown_s for w in pools.workers.values()]
            raise Unavailable(
                f"no {side} worker is in rotation (health probes failing or circuit breakers open)",
                retry_after_s=min(cooldowns, default=1.0),
            )

    def _never_fits(self, info: RequestInfo) -> bool:
        """Larger than any decode worker even when idle: waiting for room would be in vain."""
        need = info.prompt_tokens + info.reserve_output_tokens
        return all(
            need > w.capacity_blocks * w.spec.layout.block_size
            for w in self.gw.pools.decode_workers
        )

    async def admit_and_reserve(self, info: RequestInfo) -> Attempt:
        """Reserve decode room, waiting in the admission queue while there is none."""
        gw, adm = self.gw, self.gw.admission
        wait_until = self._loop_deadline(
            min(self.started + adm.settings.max_wait_s, self.started + gw.settings.timeouts.ttft_s)
        )
        while True:
            if not self.admitted and adm.has_slot():
                adm.enter()
                self.admitted = True
            outcome: Attempt | Rejection = (
                await self._try_reserve(info)
                if self.admitted
                else Rejection("the router is at its concurrency cap", 1.0)
            )
            if isinstance(outcome, Attempt):
                if adm.waiting:
                    adm.notify()  # there may be room for the next in line too
                return outcome
            self._check_pools_alive()
            if adm.settings.mode == "instant" or self._never_fits(info):
                gw.metrics.rejections.labels(reason="no_room").inc()
                raise NoCapacity(outcome.reason, retry_after_s=outcome.retry_after_s)
            try:
                gw.metrics.admission_waiting.inc()
                try:
                    woken = await adm.wait(info.priority, self.ticket, wait_until)
                finally:
                    gw.metrics.admission_waiting.dec()
            except QueueFull as exc:
                gw.metrics.rejections.labels(reason="queue_full").inc()
                raise NoCapacity(
                    f"{exc}; {outcome.reason}", retry_after_s=outcome.retry_after_s
                ) from exc
            if not woken:
                gw.metrics.rejections.labels(reason="deadline").inc()
                raise NoCapacity(
                    f"no decode room before the request's deadline: {outcome.reason}",
                    retry_after_s=outcome.retry_after_s,
                )

    # -- the prefill leg ---------------------------------------------------------------------
    async def _prefill_leg(
        self, attempt: Attempt, wire_body: dict[str, Any], prompt_tokens: int, resumed: int
    ) -> bytes:
        """POST the prefill leg; its answer on 200, else a LegFailure charged to the prefill."""
        gw = self.gw
        worker = gw.pools.workers[attempt.candidate.prefill_id or ""]
        if attempt.decode_id is None:  # pragma: no cover - the invariant, checked loudly
            raise RuntimeError("refusing to prefill without a decode reservation")
        spec = worker.spec
        probe = worker.breaker.on_dispatch()
        worker.queued_prompt_tokens += prompt_tokens
        worker.inflight += 1
        worker.recent_prefixes.add(self.prefixes)
        t0 = gw.clock()
        self.trace.begin("prefill", worker=spec.id, prompt_tokens=prompt_tokens)
        try:
            async with asyncio.timeout(gw.settings.timeouts.prefill_s):
                async with gw.session.post(
                    spec.url + self.parsed.path,
                    data=orjson.dumps(wire_body),
                    headers=self._headers(worker, resumed),
                ) as resp:
                    data = await resp.read()
            if resp.status != 200:
                raise upstream_failure("prefill", spec.id, resp.status, data)
        except LegFailure as f:
            gw.metrics.upstream_errors.labels(side="prefill", kind=type(f.error).__name__).inc()
            if f.retryable:
                worker.breaker.on_failure(probe)
            else:
                worker.breaker.on_success(probe)
            raise
        except aiohttp.ClientError as exc:  # before TimeoutError: some are TimeoutErrors too
            gw.metrics.upstream_errors.labels(side="prefill", kind="connection").inc()
            worker.breaker.on_failure(probe)
            err = UpstreamError(f"prefill worker {spec.id} failed: {exc!r}")
            raise LegFailure("prefill", spec.id, err, True) from exc
        except TimeoutError as exc:
            gw.metrics.upstream_errors.labels(side="prefill", kind="timeout").inc()
            worker.breaker.on_failure(probe)
            err = DeadlineExceeded(
                f"prefill worker {spec.id} did not answer within {gw.settings.timeouts.prefill_s} s"
            )
            raise LegFailure("prefill", spec.id, err, True) from exc
        finally:
            self.trace.finish("prefill")
            worker.queued_prompt_tokens -= prompt_tokens
            worker.inflight -= 1
            gw.metrics.prefill_seconds.labels(worker=spec.id).observe(gw.clock() - t0)
        worker.breaker.on_success(probe)
        return data

    async def prefill(
        self, attempt: Attempt, body: dict[str, Any], prompt_tokens: int, resumed: int
    ) -> dict[str, Any]:
        """vLLM NIXL pull mode: prefill first, then hand its kv_transfer_params to decode."""
        gw = self.gw
        worker = gw.pools.workers[attempt.candidate.prefill_id or ""]
        adapter = gw.adapters[worker.spec.adapter]
        wire_body = adapter.prefill_body(body)  # type: ignore[union-attr]
        data = await self._prefill_leg(attempt, wire_body, prompt_tokens, resumed)
        try:
            params = adapter.kv_params(orjson.loads(data))  # type: ignore[union-attr]
        except (orjson.JSONDecodeError, ProtocolViolation) as exc:
            gw.metrics.upstream_errors.labels(side="prefill", kind="protocol").inc()
            worker.breaker.on_failure()
            err = UpstreamError(f"prefill worker {worker.spec.id} answered badly: {exc}")
            raise LegFailure("prefill", worker.spec.id, err, True) from exc
        # The KV now lives on the prefill worker and no decode has it yet: it is stranded.
        nbytes = prompt_tokens * gw.settings.kv_bytes_per_token
        attempt.stranded_on, attempt.stranded_bytes = worker.spec.id, nbytes
        # The prefill worker holds this KV only for its lease: a decode that has not taken it by
        # then never will, so the attempt fails (and is retried) instead of waiting out the TTFT.
        attempt.handoff_by = asyncio.get_running_loop().time() + gw.settings.kv_lease_s
        gw.pools.note_stranded(worker.spec.id, nbytes)
        self.trace.begin("kv_handoff", prefill=worker.spec.id, kv_bytes=nbytes)
        await gw.leases.strand(worker.spec.id, self.request_id, nbytes)
        return params

    def _concurrent(self, prefill_id: str) -> bool:
        spec = self.gw.pools.workers[prefill_id].spec
        return bool(getattr(self.gw.adapters[spec.adapter], "concurrent_legs", False))

    async def concurrent_legs(
        self, attempt: Attempt, body: dict[str, Any], prompt_tokens: int, resumed: int
    ) -> DecodeResponse:
        """SGLang rooms / vLLM Mooncake: both legs at once. The decode stream is returned as soon
        as it starts (not after the prefill's answer); a leg that fails cancels the other."""
        gw = self.gw
        worker = gw.pools.workers[attempt.candidate.prefill_id or ""]
        adapter = gw.adapters[worker.spec.adapter]
        target = prefill_target(worker.spec.url, worker.spec.bootstrap_port, worker.spec.engine_id)
        try:
            p_body, d_body = adapter.legs(body, target, self.request_id)  # type: ignore[union-attr]
        except ProtocolViolation as exc:
            raise LegFailure("prefill", worker.spec.id, UpstreamError(str(exc)), False) from exc
        loop = asyncio.get_running_loop()
        prefill = loop.create_task(self._prefill_leg(attempt, p_body, prompt_tokens, resumed))
        attempt.partner = prefill
        decode = loop.create_task(self.open_decode(attempt, d_body, resumed))
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and prefill.exception() is not None:
                raise prefill.exception()  # type: ignore[misc]
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

    def _kv_accepted(self, attempt: Attempt) -> None:
        """The decode worker produced output, so it holds the KV: clear the stranded entry."""
        self.trace.finish("kv_handoff")
        if attempt.stranded_on is not None:
            prefill_id, attempt.stranded_on = attempt.stranded_on, None
            self.gw.pools.note_stranded(prefill_id, -attempt.stranded_bytes)
            self.gw.tasks.job(self.gw.leases.unstrand(prefill_id, self.request_id), "unstrand")

    # -- the decode leg ----------------------------------------------------------------------
    async def open_decode(
        self, attempt: Attempt, body: dict[str, Any], resumed: int
    ) -> DecodeResponse:
        gw = self.gw
        worker = gw.pools.workers[attempt.candidate.decode_id]
        spec, t = worker.spec, gw.settings.timeouts
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.idle_s)
        probe = worker.breaker.on_dispatch()
        self.trace.begin("decode", worker=spec.id)
        resp: DecodeResponse
        try:
            if not self.assembling and gw.splice is not None and gw.splice.supports(spec.url):
                # Its errors are aiohttp.ClientConnectionErrors: the same retryable failures.
                resp = await gw.splice.post(
                    spec.url + self.parsed.path,
                    orjson.dumps(body),
                    self._headers(worker, resumed),
                    connect_s=t.connect_s,
                    idle_s=t.idle_s,
                )
            else:
                resp = await gw.session.post(
                    spec.url + self.parsed.path,
                    data=orjson.dumps(body),
                    headers=self._headers(worker, resumed),
                    timeout=timeout,
                )
        except aiohttp.ClientError as exc:
            gw.metrics.upstream_errors.labels(side="decode", kind="connection").inc()
            worker.breaker.on_failure(probe)
            raise LegFailure(
                "decode", spec.id, UpstreamError(f"decode worker {spec.id} failed: {exc!r}"), True
            ) from exc
        if resp.status != 200:
            data = await resp.read()
            resp.release()
            failure = upstream_failure("decode", spec.id, resp.status, data)
            gw.metrics.upstream_errors.labels(side="decode", kind=str(resp.status)).inc()
            if failure.retryable and not failure.kv_handle:
                worker.breaker.on_failure(probe)
            else:  # the worker is fine: the client's request, or the KV handle, was the problem
                worker.breaker.on_success(probe)
            raise failure
        worker.breaker.on_success(probe)
        return resp

    async def serve_attempt(
        self, body: dict[str, Any], prompt_tokens: int, max_tokens: int, resumed: int = 0
    ) -> tuple[Attempt, DecodeResponse]:
        """Place, reserve, prefill and open the decode stream, retrying failed legs."""
        gw = self.gw
        info = await self._estimate(self._request_info(prompt_tokens, max_tokens))
        if self.info is None:
            self.info = info
            gw.metrics.predicted_output_tokens.observe(info.reserve_output_tokens)
        while True:
            self.attempts += 1
            with self.trace.span("admission"):
                attempt = self.attempt = await self.admit_and_reserve(info)
            attempt.grow_at_tokens = info.reserve_output_tokens
            try:
                leg_body = body
                prefill_id = attempt.candidate.prefill_id
                if prefill_id is not None and self._concurrent(prefill_id):
                    legs = await self.concurrent_legs(attempt, body, prompt_tokens, resumed)
                    return attempt, legs
                if prefill_id is not None:
                    kv = await self.prefill(attempt, body, prompt_tokens, resumed)
                    decode_spec = gw.pools.workers[attempt.candidate.decode_id].spec
                    leg_body = gw.adapters[decode_spec.adapter].decode_body(body, kv)
                return attempt, await self.open_decode(attempt, leg_body, resumed)
            except LegFailure as failure:
                await self.release_attempt()
                if not failure.retryable:
                    raise failure.error from failure
                await self._before_retry(failure)

    async def _before_retry(self, failure: LegFailure) -> None:
        """Spend a retry (or give up with 503) and back off with full jitter."""
        gw, r = self.gw, self.gw.settings.retry
        self.avoid.add(failure.worker_id)
        if self.attempts >= r.max_attempts:
            raise Unavailable(
                f"gave up after {self.attempts} attempts; last: {failure.error.message}",
                retry_after_s=1.0,
            ) from failure
        if not await gw.retry_budget.try_retry():
            gw.metrics.retry_budget_exhausted.inc()
            raise Unavailable(
                f"the cluster-wide retry budget is spent; not retrying: {failure.error.message}",
                retry_after_s=1.0,
            ) from failure
        gw.metrics.retries.labels(side=failure.side).inc()
        backoff = min(r.backoff_max_s, r.backoff_base_s * 2 ** (self.attempts - 1))
        await asyncio.sleep(self._rng.uniform(0, backoff))

    # -- the whole flow ---------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        gw, t = self.gw, self.gw.settings.timeouts
        first = self.started + t.ttft_s
        if t.total_s:
            first = min(first, self.started + t.total_s)
        gw.retry_budget.note_request()
        try:
            async with asyncio.timeout_at(self._loop_deadline(first)) as deadline:
                self._deadline = deadline
                if self._interrupted is not None:
                    deadline.reschedule(asyncio.get_running_loop().time())
                body = self.parsed.body
                if self.assembling:
                    body = stream_upstream(body)
                attempt, resp = await self.serve_attempt(
                    body, self.parsed.prompt_tokens, self.parsed.max_tokens
                )
                if self.assembling:
                    return await self._assembled(attempt, resp, body)
                if not self.parsed.stream:
                    return await self._whole(attempt, resp)
                return await self._stream(attempt, resp)
        except TimeoutError as exc:
            err = self._interrupted
            if err is None:
                gw.metrics.upstream_errors.labels(side="any", kind="deadline").inc()
                if self._first_token_seen:
                    message = f"the request missed its total deadline ({t.total_s} s)"
                else:
                    message = f"the request missed its deadline (time to first token {t.ttft_s} s)"
                err = DeadlineExceeded(message)
            if self._client is None:
                self.status = err.status
                raise err from exc
            # Mid-stream: the headers are gone, so the stream ends with a valid error frame.
            await self._write_error(self._client, err)
            return self._client
        except RouterError as err:
            self.status = err.status  # for the trace; the middleware answers it
            raise

    def interrupt(self, err: RouterError) -> None:
        """End the request now with `err` (router/shutdown.py), by the path of a missed
        deadline: a stream ends with an error frame and [DONE]; cleanup releases as always."""
        self._interrupted = err
        if self._deadline is not None:
            with contextlib.suppress(RuntimeError):  # the timeout block is over: nothing to cut
                self._deadline.reschedule(asyncio.get_running_loop().time())

    async def _assembled(
        self, attempt: Attempt, resp: DecodeResponse, body: dict[str, Any]
    ) -> web.Response:
        """Asked for whole, streamed from the decode worker: the first token clears the stranded
        KV and the TTFT deadline as in a stream. Nothing reaches the client before the answer is
        whole, so a broken stream is retried from the start, never resumed."""
        chat = self.parsed.path == CHAT
        prompt_tokens = self.parsed.prompt_tokens
        while True:
            # The relay keeps every whole event it passes on (`result.chunks`): the answer is
            # assembled from those, so the sink keeps nothing.
            worker, result = await self._relay_decode(attempt, resp, DISCARD, 0, prompt_tokens)
            whole = assemble(result.chunks, chat) if result.completed else None
            if isinstance(whole, dict) and not whole["choices"]:
                # A stream that ended well but spelled no answer (events that do not parse):
                # nothing reached the client, so it is retried like a broken one.
                result.completed, result.error_kind = False, "malformed"
                result.upstream_error = "the decode stream held no answer that parses"
            elif whole is not None:
                if not isinstance(whole, dict):  # a 4xx the worker reported in the stream
                    raise UpstreamRejected(
                        whole.status or 400,
                        whole.message,
                        type_=whole.type or "invalid_request_error",
                        param=whole.param,
                        code=whole.code,
                    )
                usage = whole.get("usage") or {}
                self.output_tokens = int(usage.get("completion_tokens") or result.tokens)
                return web.Response(
                    body=orjson.dumps(whole),
                    content_type="application/json",
                    headers={"X-Request-Id": self.request_id},
                )
            failure = self._stream_failure(attempt, worker, result)
            await self.release_attempt()
            await self._before_retry(failure)
            attempt, resp = await self.serve_attempt(body, prompt_tokens, self.parsed.max_tokens)

    async def _relay_decode(
        self, attempt: Attempt, resp: DecodeResponse, sink: Any, resumed: int, prompt_tokens: int
    ) -> tuple[WorkerState, RelayResult]:
        """One decode stream into `sink` (the client's stream, or DISCARD when assembling), with
        the first-token and reservation-growth hooks; the connection is closed afterwards
        (unfinished: dropping it is vLLM's abort signal)."""
        gw = self.gw
        worker = gw.pools.workers[attempt.candidate.decode_id]
        worker.resident_seqs += 1
        worker.open_streams.add(resp)  # a role drain past its deadline may cut it (router/roles.py)
        try:
            relay: Any = relay_splice if isinstance(resp, SpliceResponse) else relay_sse
            result: RelayResult = await relay(
                resp,
                sink,
                chat=self.parsed.path == CHAT,
                clock=gw.clock,
                on_first_token=lambda a=attempt: self._on_first_token(a),
                on_tokens=lambda n, a=attempt: self._on_tokens(a, resumed, prompt_tokens, n),
                first_event_by=attempt.handoff_by,
            )
        finally:
            worker.resident_seqs -= 1
            worker.open_streams.discard(resp)
            resp.close()
        return worker, result

    async def _whole(self, attempt: Attempt, resp: DecodeResponse) -> web.Response:
        """Non-streaming, answered whole by the decode worker (`assemble_non_streaming: false`,
        or a request vLLM cannot stream): nothing reaches the client until the answer is whole,
        so a broken answer is retried like a failed leg."""
        while True:
            try:
                try:
                    data = await resp.read()
                    answer = orjson.loads(data)
                    usage = answer.get("usage") or {}
                except (aiohttp.ClientError, orjson.JSONDecodeError, AttributeError) as exc:
                    raise LegFailure(
                        "decode",
                        attempt.candidate.decode_id,
                        UpstreamError(
                            f"decode worker {attempt.candidate.decode_id} answered badly: {exc!r}"
                        ),
                        True,
                    ) from exc
                finally:
                    resp.close()
            except LegFailure as failure:
                await self.release_attempt()
                await self._before_retry(failure)
                attempt, resp = await self.serve_attempt(
                    self.parsed.body, self.parsed.prompt_tokens, self.parsed.max_tokens
                )
                continue
            self._kv_accepted(attempt)
            self.output_tokens = int(usage.get("completion_tokens") or 0)
            self.gw.metrics.ttft.observe(self.gw.clock() - self.started)
            return web.Response(
                body=data,
                content_type="application/json",
                headers={"X-Request-Id": self.request_id},
            )

    def _on_first_token(self, attempt: Attempt) -> None:
        gw, t = self.gw, self.gw.settings.timeouts
        self._kv_accepted(attempt)
        if self._first_token_seen:  # a resumed stream: TTFT was the first attempt's
            return
        self._first_token_seen = True
        self._first_token_at = gw.clock()
        gw.metrics.ttft.observe(self._first_token_at - self.started)
        total = self._loop_deadline(self.started + t.total_s) if t.total_s else None
        self._deadline.reschedule(total)

    def _on_tokens(
        self, attempt: Attempt, base_tokens: int, prompt_tokens: int, tokens: int
    ) -> None:
        """Grow the reservation as the answer outgrows it (never silently smaller than use)."""
        if tokens <= attempt.grow_at_tokens or attempt.decode_id is None or attempt.growing:
            return
        gw = self.gw
        worker = gw.pools.workers.get(attempt.decode_id)
        if worker is None:  # removed from the pools mid-stream: its release goes by id
            return
        if not attempt.overran:
            attempt.overran = True
            gw.metrics.reservation_overruns.inc()
        # Grow by a quarter at a time, so a long overrun costs a few store calls, not one a block.
        grow_at = max(tokens + 1, int(attempt.grow_at_tokens * 1.25))
        block = worker.spec.layout.block_size
        new_blocks = blocks_for(prompt_tokens + base_tokens + grow_at, block)
        attempt.growing = True
        gw.tasks.job(self._grow(attempt, new_blocks, grow_at), "grow-reservation")

    async def _grow(self, attempt: Attempt, blocks: int, grow_at: int) -> None:
        """Grow into free room if there is some, else past capacity: the tokens exist on the
        worker whatever the count says, and a count below use would let placement overfill it.
        A store failure leaves `grow_at_tokens` where it was, so the next token tries again."""
        gw = self.gw
        try:
            decode_id = attempt.decode_id
            if decode_id is None or blocks <= attempt.blocks:
                return
            rid = attempt.reservation_id
            grown = await gw.store.resize(decode_id, rid, blocks)
            if not grown:
                grown = await gw.store.resize(decode_id, rid, blocks, force=True)
                if grown:
                    gw.metrics.reservation_forced_growth.inc()
                    log.info(
                        "request %s outgrew its reservation on %s, which has no free room: "
                        "grown past capacity to %d blocks (the tokens are there)",
                        self.request_id,
                        decode_id,
                        blocks,
                    )
            # The store answered: the next growth waits for the next threshold. Not grown even
            # when forced means the store lost the reservation; the lease keeper puts it back,
            # at this size.
            attempt.grow_at_tokens = grow_at
            if attempt.decode_id == decode_id:  # not released meanwhile
                gw.leases.resized(rid, blocks)
                if grown:
                    gw.pools.note_reserved(decode_id, blocks - attempt.blocks)
                attempt.blocks = blocks
        finally:
            attempt.growing = False

    async def _stream(self, attempt: Attempt, resp: DecodeResponse) -> web.StreamResponse:
        gw, chat = self.gw, self.parsed.path == CHAT
        client = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": self.request_id,
            }
        )
        try:
            await client.prepare(self.http)
        except BaseException as exc:
            # The client left while its decode leg was being opened: abort the leg now (closing
            # is vLLM's abort signal) instead of leaving it to stream into memory unread.
            resp.close()
            if not isinstance(exc, ConnectionError):
                raise
            gw.metrics.client_disconnects.inc()
            self.status = 499
            return client
        self._client = client
        sent: list[bytes] = []
        resumed = 0
        prompt_tokens = self.parsed.prompt_tokens
        while True:
            worker, result = await self._relay_decode(attempt, resp, client, resumed, prompt_tokens)
            sent.extend(result.chunks)
            gw.metrics.tokens_relayed.inc(result.tokens)
            if result.client_gone:
                gw.metrics.client_disconnects.inc()
                self.status = 499
                return client
            if result.completed:
                self.output_tokens = resumed + result.tokens
                # The decode worker is done with the sequence: give its room back now, not
                # once a slow client has taken the last bytes from our send buffer.
                await asyncio.shield(self.settle())
                try:
                    await client.write_eof()
                except (ConnectionError, RuntimeError):
                    gw.metrics.client_disconnects.inc()
                return client
            # The stream broke mid-way: resume on a new pair, same client stream.
            failure = self._stream_failure(attempt, worker, result)
            await self.release_attempt()
            try:
                text, resumed = parse_sent_text(sent, chat)
                resumed = max(resumed, await self._tokens_in(text))
                body, prompt_tokens, max_tokens = resume_body(
                    self.parsed, text, resumed, gw.settings.chars_per_token
                )
                await self._before_retry(failure)
                attempt, resp = await self.serve_attempt(body, prompt_tokens, max_tokens, resumed)
            except (RouterError, StoreError) as exc:
                await self._write_error(client, as_router_error(exc))
                return client
            gw.metrics.resumes.inc()

    async def _tokens_in(self, text: str) -> int:
        """How many tokens `text` is, by a real vLLM worker's own tokenizer (`POST /tokenize`);
        0 when no such worker answers.

        Counting chunks undercounts what was sent: vLLM merges several tokens into one chunk when
        its API server falls behind, and a resumed answer would then run past `max_tokens`. The
        simulated worker always sends one token per chunk (and its /tokenize only approximates),
        so it is not asked. Resuming is rare; one extra call then is cheap."""
        gw = self.gw
        if not text:
            return 0
        model = self.parsed.body.get("model")
        asked = 0
        for w in list(gw.pools.workers.values()):
            if w.spec.adapter not in ("vllm", "mooncake") or not w.healthy or asked >= 2:
                continue
            asked += 1
            try:
                async with asyncio.timeout(gw.settings.timeouts.connect_s + 5.0):
                    async with gw.session.post(
                        w.spec.url + "/tokenize",
                        data=orjson.dumps(
                            {"model": model, "prompt": text, "add_special_tokens": False}
                        ),
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        if resp.status != 200:
                            continue
                        count = orjson.loads(await resp.read()).get("count")
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(count, int) and count >= 0:
                return count
        return 0

    def _stream_failure(
        self, attempt: Attempt, worker: WorkerState, result: RelayResult
    ) -> LegFailure:
        """Whose fault a broken stream is: a failed concurrent prefill leg cut it, or the decode."""
        partner = attempt.partner
        if partner is not None and partner.done() and not partner.cancelled():
            exc = partner.exception()
            if isinstance(exc, LegFailure):
                return exc
        worker.breaker.on_failure()
        kind = result.error_kind or "stream_cut"
        self.gw.metrics.upstream_errors.labels(side="decode", kind=kind).inc()
        reason = f"decode worker {worker.spec.id} ended the stream early: {result.upstream_error}"
        return LegFailure("decode", worker.spec.id, UpstreamError(reason), True)

    async def _write_error(self, client: web.StreamResponse, err: RouterError) -> None:
        """Headers are gone: end the stream with a valid SSE error frame, never a silent cut."""
        self.status = err.status
        try:
            await client.write(sse_error_frame(err.message, err.type, err.code))
            await client.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    # -- the end ----------------------------------------------------------------------------
    async def release_attempt(self, record: tuple[list[str], int] | None = None) -> None:
        """Give back what the current attempt holds (and record the output length, at the
        end), in one store call; safe to call twice. Cannot half-fail: a step the store did not
        take is owed and retried by the lease keeper, never renewed."""
        attempt, self.attempt = self.attempt, None
        gw = self.gw
        release = unstrand = None
        if attempt is not None:
            if attempt.partner is not None and not attempt.partner.done():
                attempt.partner.cancel()  # closes the prefill leg's connection
            if attempt.stranded_on is not None:
                prefill_id, attempt.stranded_on = attempt.stranded_on, None
                gw.pools.note_stranded(prefill_id, -attempt.stranded_bytes)
                unstrand = (prefill_id, self.request_id)
            if attempt.decode_id is not None:
                decode_id, attempt.decode_id = attempt.decode_id, None
                release = (decode_id, attempt.reservation_id)
        if release is None and unstrand is None and record is None:
            return
        released = await gw.leases.finish(release, unstrand, record)
        if release is not None:
            gw.pools.note_released(release[0], released)
            if gw.admission.waiting:
                gw.admission.notify()

    async def settle(self) -> None:
        """Release what the request holds and record its output length: once (the stream does
        it as soon as the decode is over; `cleanup` for every other ending)."""
        if self._settled:
            return
        self._settled = True
        gw = self.gw
        try:
            record = None
            if self.output_tokens is not None and self.info is not None:
                gw.metrics.output_tokens.observe(self.output_tokens)
                if self._first_token_at is not None and self.output_tokens > 1:
                    gw.metrics.time_per_output_token.observe(
                        (gw.clock() - self._first_token_at) / (self.output_tokens - 1)
                    )
                if self.output_tokens > 0:
                    reserved = self.info.reserve_output_tokens
                    gw.metrics.estimate_relative_error.observe(
                        (reserved - self.output_tokens) / self.output_tokens
                    )
                keys = list(gw.estimator.class_keys(self.info))
                record = (keys, gw.estimator.bucket_of(self.output_tokens))
            await self.release_attempt(record)
        except Exception:  # a bug: the reservation's lease still frees it, but say so loudly
            log.exception("cleanup of %s failed (its lease will expire)", self.request_id)

    async def cleanup(self) -> None:
        gw = self.gw
        try:
            await self.settle()
        finally:
            if self.admitted:
                self.admitted = False
                gw.admission.leave()
            gw.metrics.duration.observe(gw.clock() - self.started)
            self.trace.close(self.status)
