"""One request's life (design.md §2):

    estimate → place (P and D together) → reserve on D → prefill on P → KV handoff
    → decode on D → relay the stream → release

Invariants kept here: a prefill is never sent without a decode reservation in hand; the
reservation and the stranded-KV entry are released exactly once, in `finally` under
`asyncio.shield`, whatever happens (success, worker error, deadline, client gone); when the client
goes away both upstream connections are closed (closing is vLLM's abort signal).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from policies.base import Candidate, RequestInfo, Rejection
from router.adapters import ProtocolViolation
from router.api import CHAT, ParsedRequest
from router.errors import (
    DeadlineExceeded,
    NoCapacity,
    RouterError,
    Unavailable,
    UpstreamError,
    UpstreamRejected,
    sse_error_frame,
)
from router.gateway import Gateway
from router.pools import WorkerState
from router.relay import RelayResult, relay_sse

__all__ = ["RequestFlow", "upstream_failure"]

log = logging.getLogger(__name__)


def _error_fields(data: bytes) -> tuple[str, str | None, str | None, Any]:
    """message, type, param, code from either vLLM error shape (nested or flat `object: error`)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:200].decode("utf-8", "replace") or "(empty body)", None, None, None
    if isinstance(obj, dict):
        err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
        msg = err.get("message") or err.get("detail") or str(obj)[:200]
        return str(msg), err.get("type"), err.get("param"), err.get("code")
    return str(obj)[:200], None, None, None


def upstream_failure(side: str, worker_id: str, status: int, data: bytes) -> RouterError:
    msg, type_, param, code = _error_fields(data)
    if 400 <= status < 500 and status not in (408, 429):
        # The worker judged the client's request bad: its verdict passes through unchanged.
        return UpstreamRejected(status, msg, type_=type_ or "invalid_request_error",
                                param=param, code=code)
    if status in (429, 503):
        return Unavailable(f"{side} worker {worker_id} is overloaded (HTTP {status}): {msg}",
                           retry_after_s=1.0)
    return UpstreamError(f"{side} worker {worker_id} failed with HTTP {status}: {msg}")


class RequestFlow:
    """Serves one validated request; `cleanup()` must run exactly once afterwards."""

    def __init__(self, gw: Gateway, parsed: ParsedRequest, http: web.Request) -> None:
        self.gw = gw
        self.parsed = parsed
        self.http = http
        self.request_id = http.headers.get("X-Request-Id") or f"dr-{uuid.uuid4().hex}"
        # Reservation ids are ours alone: clients reuse X-Request-Id values.
        self.reservation_id = uuid.uuid4().hex
        self.started = gw.clock()
        self.info: RequestInfo | None = None
        self.reservation: tuple[str, int] | None = None  # (decode worker, blocks)
        self.stranded_on: str | None = None
        self.output_tokens: int | None = None
        self.status = 200

    def __repr__(self) -> str:
        return (f"RequestFlow({self.request_id}, reservation={self.reservation}, "
                f"stranded_on={self.stranded_on})")

    # -- upstream plumbing -------------------------------------------------------------------
    def _headers(self, worker: WorkerState) -> dict[str, str]:
        s = self.gw.settings
        headers = {"Content-Type": "application/json", "X-Request-Id": self.request_id}
        for name in s.forward_headers:
            value = self.http.headers.get(name)
            if value is not None:
                headers[name] = value
        if worker.spec.api_key:
            headers["Authorization"] = f"Bearer {worker.spec.api_key}"
        elif s.forward_client_auth and "Authorization" in self.http.headers:
            headers["Authorization"] = self.http.headers["Authorization"]
        return headers

    # -- estimate, place, reserve ----------------------------------------------------------
    async def place_and_reserve(self) -> Candidate:
        gw, p = self.gw, self.parsed
        hint = self.http.headers.get("X-Expected-Output-Tokens")
        info = RequestInfo(
            request_id=self.request_id,
            model=p.model,
            prompt_tokens=p.prompt_tokens,
            max_tokens=p.max_tokens,
            arrival_s=self.started,
            hint_output_tokens=int(hint) if hint and hint.isdigit() else None,
        )
        keys = gw.estimator.class_keys(info)
        estimate = gw.estimator.estimate(info, await gw.histograms.get(keys))
        self.info = info = replace(info, estimate=estimate)
        gw.metrics.predicted_output_tokens.observe(info.reserve_output_tokens)

        decision = gw.policy.place(info, gw.pools.snapshot())
        if isinstance(decision, Rejection):
            gw.metrics.rejections.labels(reason="no_room").inc()
            raise NoCapacity(decision.reason, retry_after_s=decision.retry_after_s)
        for cand in decision.candidates:
            ok = await gw.store.reserve(cand.decode_id, self.reservation_id, cand.reserve_blocks,
                                        gw.settings.reservation_lease_s)
            if ok:
                self.reservation = (cand.decode_id, cand.reserve_blocks)
                gw.pools.note_reserved(cand.decode_id, cand.reserve_blocks)
                gw.leases.hold(cand.decode_id, self.reservation_id)
                gw.metrics.placements.labels(prefill=cand.prefill_id or "local",
                                             decode=cand.decode_id).inc()
                return cand
            gw.metrics.reserve_conflicts.inc()
        gw.metrics.rejections.labels(reason="reserve_conflict").inc()
        raise NoCapacity("every candidate decode worker filled up while reserving "
                         "(other router replicas took the room)", retry_after_s=1.0)

    # -- the prefill leg ---------------------------------------------------------------------
    async def prefill(self, worker: WorkerState) -> dict[str, Any]:
        gw, spec = self.gw, worker.spec
        adapter = gw.adapters[spec.adapter]
        body = adapter.prefill_body(self.parsed.body)
        n = self.parsed.prompt_tokens
        worker.queued_prompt_tokens += n
        worker.inflight += 1
        t0 = gw.clock()
        try:
            async with asyncio.timeout(gw.settings.timeouts.prefill_s):
                async with gw.session.post(spec.url + self.parsed.path, data=orjson.dumps(body),
                                           headers=self._headers(worker)) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        gw.metrics.upstream_errors.labels(side="prefill", kind=str(resp.status)).inc()
                        raise upstream_failure("prefill", spec.id, resp.status, data)
        except TimeoutError as exc:
            gw.metrics.upstream_errors.labels(side="prefill", kind="timeout").inc()
            raise DeadlineExceeded(f"prefill worker {spec.id} did not answer within "
                                   f"{gw.settings.timeouts.prefill_s} s") from exc
        except aiohttp.ClientError as exc:
            gw.metrics.upstream_errors.labels(side="prefill", kind="connection").inc()
            raise UpstreamError(f"prefill worker {spec.id} failed: {exc}") from exc
        finally:
            worker.queued_prompt_tokens -= n
            worker.inflight -= 1
            gw.metrics.prefill_seconds.labels(worker=spec.id).observe(gw.clock() - t0)
        try:
            params = adapter.kv_params(orjson.loads(data))
        except (orjson.JSONDecodeError, ProtocolViolation) as exc:
            gw.metrics.upstream_errors.labels(side="prefill", kind="protocol").inc()
            raise UpstreamError(f"prefill worker {spec.id} answered badly: {exc}") from exc
        # The KV now lives on the prefill worker and no decode has it yet: it is stranded.
        await gw.store.strand(spec.id, self.request_id, n * gw.settings.kv_bytes_per_token)
        self.stranded_on = spec.id
        return params

    def _kv_accepted(self) -> None:
        """The decode worker produced output, so it holds the KV: clear the stranded entry."""
        if self.stranded_on is not None:
            prefill_id, self.stranded_on = self.stranded_on, None
            asyncio.get_running_loop().create_task(
                self.gw.store.unstrand(prefill_id, self.request_id))

    # -- the whole flow ---------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        gw, parsed = self.gw, self.parsed
        cand = await self.place_and_reserve()
        body = parsed.body
        if cand.prefill_id is not None:
            kv = await self.prefill(gw.pools.workers[cand.prefill_id])
            decode_worker = gw.pools.workers[cand.decode_id]
            body = gw.adapters[decode_worker.spec.adapter].decode_body(parsed.body, kv)
        return await self.decode(gw.pools.workers[cand.decode_id], body)

    async def decode(self, worker: WorkerState, body: dict[str, Any]) -> web.StreamResponse:
        gw, spec, t = self.gw, worker.spec, self.gw.settings.timeouts
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.idle_s)
        total_deadline = self.started + t.total_s if t.total_s else None
        first_deadline = self.started + t.ttft_s
        if total_deadline is not None:
            first_deadline = min(first_deadline, total_deadline)
        loop = asyncio.get_running_loop()
        # Clocks: the flow's clock is monotonic like the loop's, but not necessarily the same.
        to_loop = loop.time() - gw.clock()
        client: web.StreamResponse | None = None
        worker.resident_seqs += 1
        try:
            async with asyncio.timeout_at(first_deadline + to_loop) as deadline:
                try:
                    resp = await gw.session.post(spec.url + self.parsed.path, data=orjson.dumps(body),
                                                 headers=self._headers(worker), timeout=timeout)
                except aiohttp.ClientError as exc:
                    gw.metrics.upstream_errors.labels(side="decode", kind="connection").inc()
                    raise UpstreamError(f"decode worker {spec.id} failed: {exc}") from exc
                try:
                    if resp.status != 200:
                        data = await resp.read()
                        gw.metrics.upstream_errors.labels(side="decode", kind=str(resp.status)).inc()
                        raise upstream_failure("decode", spec.id, resp.status, data)
                    if not self.parsed.stream:
                        return await self._decode_whole(resp, spec.id)

                    def first_token() -> None:
                        self._kv_accepted()
                        gw.metrics.ttft.observe(gw.clock() - self.started)
                        deadline.reschedule(None if total_deadline is None
                                            else total_deadline + to_loop)

                    client = web.StreamResponse(headers={
                        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                        "X-Request-Id": self.request_id})
                    await client.prepare(self.http)
                    result = await relay_sse(resp, client, chat=self.parsed.path == CHAT,
                                             clock=gw.clock, on_first_token=first_token)
                    await self._finish_stream(client, result, spec.id)
                    return client
                finally:
                    # Closing (not releasing) drops the connection when the answer is unfinished:
                    # that is vLLM's abort signal.
                    resp.close()
        except TimeoutError as exc:
            gw.metrics.upstream_errors.labels(side="decode", kind="timeout").inc()
            err = DeadlineExceeded(f"decode worker {spec.id} missed the deadline")
            if client is None:
                raise err from exc
            await self._write_error(client, err)
            return client
        finally:
            worker.resident_seqs -= 1

    async def _decode_whole(self, resp: aiohttp.ClientResponse, worker_id: str) -> web.Response:
        data = await resp.read()
        try:
            answer = orjson.loads(data)
            usage = answer.get("usage") or {}
        except (orjson.JSONDecodeError, AttributeError) as exc:
            self.gw.metrics.upstream_errors.labels(side="decode", kind="protocol").inc()
            raise UpstreamError(f"decode worker {worker_id} answered malformed JSON") from exc
        self._kv_accepted()
        self.output_tokens = int(usage.get("completion_tokens") or 0)
        self.gw.metrics.ttft.observe(self.gw.clock() - self.started)
        return web.Response(body=data, content_type="application/json",
                            headers={"X-Request-Id": self.request_id})

    async def _finish_stream(self, client: web.StreamResponse, result: RelayResult,
                             worker_id: str) -> None:
        gw = self.gw
        gw.metrics.tokens_relayed.inc(result.tokens)
        if result.client_gone:
            gw.metrics.client_disconnects.inc()
            self.status = 499
            return
        if not result.completed:
            gw.metrics.upstream_errors.labels(side="decode", kind="stream_cut").inc()
            await self._write_error(client, UpstreamError(
                f"decode worker {worker_id} ended the stream early: {result.upstream_error}"))
            return
        self.output_tokens = result.tokens
        try:
            await client.write_eof()
        except (ConnectionError, RuntimeError):
            gw.metrics.client_disconnects.inc()

    async def _write_error(self, client: web.StreamResponse, err: RouterError) -> None:
        """Headers are gone: end the stream with a valid SSE error frame, never a silent cut."""
        self.status = err.status
        try:
            await client.write(sse_error_frame(err.message, err.type, err.code))
            await client.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    # -- the end ----------------------------------------------------------------------------
    async def cleanup(self) -> None:
        gw = self.gw
        try:
            if self.stranded_on is not None:
                prefill_id, self.stranded_on = self.stranded_on, None
                await gw.store.unstrand(prefill_id, self.request_id)
            if self.reservation is not None:
                decode_id, _ = self.reservation
                self.reservation = None
                gw.leases.drop(self.reservation_id)
                released = await gw.store.release(decode_id, self.reservation_id)
                gw.pools.note_released(decode_id, released)
            if self.output_tokens is not None and self.info is not None:
                gw.metrics.output_tokens.observe(self.output_tokens)
                await gw.store.record_output(gw.estimator.class_keys(self.info),
                                             gw.estimator.bucket_of(self.output_tokens))
        except Exception as exc:  # the store is down: leases and the reaper clean up later
            log.warning("cleanup of %s failed (leases will expire): %s", self.request_id, exc)
        finally:
            gw.metrics.duration.observe(gw.clock() - self.started)
