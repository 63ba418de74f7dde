"""One request's life (docs/design.md §2), top to bottom:

    admit and reserve (router/request/reserve.py) → prefill leg, decode leg (router/request/legs.py)
    → relay the answer (router/request/respond.py) → release (router/request/release.py)
    (each stage an object built once per app with what it uses: `RequestStages`)
       └─ a leg fails before the client got a byte: release, retry on another pair (budgeted)
       └─ decode dies mid-stream: resume (router/request/resume.py) — the next try continues the
       stream
          (not a Responses stream: it ends with an error event, router/openai/responses_pd.py)
       └─ the router preempts the stream (its growth found no room: router/request/
          preemption.py): release, then the same resume, reserving the whole remaining cap,
          waiting for room — no retry spent, no worker blamed

The retry/resume loop is `_serve`, written once. Invariants kept here: each attempt's
reservation and stranded-KV entry are released exactly once, in `finally` under
`asyncio.shield`, whatever happens, and what the fairness policy charged for it is settled
there with its actual cost (router/admission.py); when the client goes away both upstream
connections are closed (closing is vLLM's abort signal); a client never gets a token twice nor
misses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from policies.base import AdmissionCost, RequestInfo
from policies.priority_classes import class_name
from router.admission import Admission
from router.config import Settings
from router.errors import (
    DeadlineExceeded,
    QuotaExceeded,
    RouterError,
    UpstreamError,
    as_router_error,
)
from router.metrics import RouterMetrics
from router.openai.api import RESPONSES, ParsedRequest
from router.openai.prompt_text import prefix_hashes
from router.request.assemble import stream_upstream, streamable, upstream_body
from router.request.attempt import Ask, Attempt, Call, LegFailure
from router.request.holdings import Record
from router.request.legs import Legs
from router.request.preemption import OVER_LIMIT, TAKEN_BACK
from router.request.priority_class import PRIORITY_HEADER, request_class
from router.request.quota import QuotaGate, over_limit_error, reserved_blocks
from router.request.release import Releaser
from router.request.reserve import Reserver, Seat
from router.request.respond import (
    Answering,
    Broken,
    ClientSide,
    Preempted,
    Progress,
    Responder,
    Served,
)
from router.request.resume import AnswerComplete, Resumer, end_frames
from router.request.retry_policy import RetryPolicy
from router.retry_budget import RetryBudget
from router.tenants import ANONYMOUS, TenantSpec
from router.tracing import Tracing
from state.base import StoreError

__all__ = ["ClientSide", "RequestFlow", "RequestStages"]

log = logging.getLogger(__name__)


def _no_resume(parsed: ParsedRequest, sent: list[bytes], failure: LegFailure) -> None:
    """Some streams are not resumed mid-stream: an n > 1 one (the continuation of one text
    cannot carry n choices) and a Responses one (it cannot go on under the same response id
    and sequence numbers). Once the client has events it ends with its error frame (raised
    here); before, the request is retried from the start."""
    if not sent:
        return
    what = (
        "a Responses stream" if parsed.path == RESPONSES else "an answer of several choices (n > 1)"
    )
    raise UpstreamError(
        f"the answer's stream broke and {what} cannot be resumed: {failure.error.message}"
    ) from failure


@dataclass(frozen=True, slots=True)
class RequestStages:
    """The request path's stages, each built once per app with what it uses
    (router/edge/request_stages.py assembles them), and what the orchestrator itself reads."""

    settings: Settings
    metrics: RouterMetrics
    tracing: Tracing
    admission: Admission
    retry_budget: RetryBudget
    clock: Callable[[], float]
    reserve: Reserver
    legs: Legs
    answering: Answering
    resume: Resumer
    release: Releaser
    quota: QuotaGate

    def __repr__(self) -> str:
        return f"RequestStages({self.reserve!r}, {self.legs!r})"


class RequestFlow:
    """Serves one validated request. `run()` returns the whole answer's body (None when it was
    streamed to the client); `cleanup()` runs after, whatever happened."""

    def __init__(
        self,
        stages: RequestStages,
        client: ClientSide,
        request_id: str,
        tenant: TenantSpec = ANONYMOUS,
    ) -> None:
        """`request_id`, `tenant`: the front door's (router/edge/front_door.py)."""
        parsed = client.parsed
        # Its class: its tenant's, or a less urgent one it asks for (a bad one: 400).
        priority = request_class(tenant, parsed.body, client.headers)
        self.stages = stages
        self.request_id = request_id
        assemble = stages.settings.upstream.assemble_non_streaming
        self.call = Call(
            parsed=parsed,
            headers=client.headers,
            request_id=self.request_id,
            started=stages.clock(),
            trace=stages.tracing.request(parsed.path, client.headers, self.request_id),
            prefixes=prefix_hashes(parsed.path, parsed.body),
            assembling=not parsed.stream and assemble and streamable(parsed.body),
            tenant=tenant.name,
            priority=priority,
        )
        self.progress = Progress(self.call, stages.answering)
        self.responder = Responder(self.call, client, self.progress)
        self.seat = Seat(stages.admission.ticket(), tenant)
        self.info: RequestInfo | None = None  # of the first try: its estimate gets the feedback
        self.attempt: Attempt | None = None  # the one being tried, until released
        # The tries: their cap, the cluster-wide budget, the backoff
        # (router/request/retry_policy.py);
        # `retries.tried` are the workers that failed this request.
        self.retries = RetryPolicy(
            stages.settings.retry, stages.retry_budget, stages.metrics, request_id
        )
        self.output_tokens: int | None = None
        self.status = 200
        self._settled = False  # released and recorded (settle)
        self._interrupted: RouterError | None = None  # the replica shuts down (interrupt)

    def __repr__(self) -> str:
        return f"RequestFlow({self.request_id}, {self.retries!r}, {self.attempt!r})"

    @property
    def answer_headers(self) -> dict[str, str]:
        """A whole answer's headers: its id, and the class it was served in (as a stream's)."""
        return {"X-Request-Id": self.request_id, PRIORITY_HEADER: class_name(self.call.priority)}

    @property
    def attempts(self) -> int:
        """The tries made so far (a resumed stream's continuation is one)."""
        return self.retries.attempts

    async def run(self) -> bytes | None:
        stages, t, started = self.stages, self.stages.settings.timeouts, self.call.started
        first = started + t.ttft_s
        if t.total_s:
            first = min(first, started + t.total_s)
        self.retries.begin()
        try:
            # `first` is on the router's clock; asyncio's deadlines are on the loop's.
            at = first + (asyncio.get_running_loop().time() - stages.clock())
            async with asyncio.timeout_at(at) as deadline:
                self.progress.deadline = deadline
                if self._interrupted is not None:
                    deadline.reschedule(asyncio.get_running_loop().time())
                return await self._serve()
        except TimeoutError as exc:
            err = self._interrupted
            if err is None:
                stages.metrics.upstream_errors.labels(side="any", kind="deadline").inc()
                if self.progress.first_token_at is not None:
                    message = f"the request missed its total deadline ({t.total_s} s)"
                else:
                    message = f"the request missed its deadline (time to first token {t.ttft_s} s)"
                err = DeadlineExceeded(message)
            self.status = err.status
            if self.responder.stream is None:
                raise err from exc
            # Mid-stream: the headers are gone, so the stream ends with a valid error frame.
            await self.responder.write_error(err)
            return None
        except RouterError as err:
            self.status = err.status  # for the trace; the middleware answers it
            raise

    async def _serve(self) -> bytes | None:
        """Reserve → legs → respond, once per try; a failed try is released, then retried (the
        same ask) or resumed (the ask that continues the stream the client has)."""
        call, responder, parsed = self.call, self.responder, self.call.parsed
        body = parsed.body
        if call.assembling:
            responses = parsed.path == RESPONSES
            body = upstream_body(body) if responses else stream_upstream(body)
        ask = Ask(body, parsed.prompt_tokens, parsed.max_tokens)
        info: RequestInfo | None = None
        # Set after a preemption: when the continuation stops waiting for room (flow clock).
        resume_by: float | None = None
        while True:
            try:
                if info is None:
                    info = await self.stages.reserve.estimate(call, ask, self.seat)
                    if self.info is None:
                        self.info = info
                        predicted = self.stages.metrics.predicted_output_tokens
                        predicted.observe(info.reserve_output_tokens)
                        # The tenant's quota, once per request (router/request/quota.py).
                        self.seat.quota = await self.stages.quota.take(self.seat.tenant, info)
                ended = await self._try(ask, info, resume_by)
                if isinstance(ended, Served):
                    return await self._served(ended)
                await self.release_attempt()
                if isinstance(ended, Preempted):
                    if ended.reason == OVER_LIMIT:
                        raise self._over_limit(ended, ask)
                    ask, info, resume_by = await self._after_preemption(ended, info)
                    continue
                if (
                    isinstance(ended, LegFailure)
                    and resume_by is not None
                    and ended.status in (429, 503)
                    and self.stages.clock() < resume_by
                ):
                    # A preempted stream's continuation found its worker full after all (room
                    # the ledger counted free went to answers longer than reserved): it goes on
                    # waiting for room, as for its reservation, until `resume_by`; no retry.
                    await self.retries.wait_for_room()
                    continue
                resume_by = None
                failure = ended.failure if isinstance(ended, Broken) else ended
                if isinstance(ended, LegFailure) and not failure.retryable:
                    raise failure.error from failure  # the worker's verdict on the request
                if isinstance(ended, Broken) and responder.stream is not None:
                    if parsed.n > 1 or parsed.path == RESPONSES:
                        _no_resume(parsed, responder.sent, failure)  # else retried as a leg
                    else:
                        # Continue it: the next try asks for the rest.
                        ask, info = await self.stages.resume.ask(call, responder.sent), None
                await self.retries.before_retry(failure)
            except AnswerComplete:
                # Cut or preempted after its last token: end it as the worker would have.
                prompt_tokens = await self.stages.resume.prompt_tokens(call)
                await responder.write_end(end_frames(parsed, responder.sent, prompt_tokens))
                return None
            except (RouterError, StoreError) as exc:
                if responder.stream is None:
                    raise
                err = as_router_error(exc)
                self.status = err.status
                await responder.write_error(err)
                return None

    def _over_limit(self, ended: Preempted, ask: Ask) -> QuotaExceeded:
        """The answer alone outgrew its tenant's whole block limit: it ends with the limit's
        error (mid-stream: an error frame after the tokens it had)."""
        hold, tenant = self.seat.quota, self.seat.tenant
        limit = tenant.limits.max_reserved_blocks or 0
        sent = ask.resumed + ended.tokens
        self.stages.metrics.tenant_rejections.labels(
            tenant=tenant.name, reason="max_reserved_blocks"
        ).inc()
        return over_limit_error(tenant.name, limit, hold.blocks if hold else limit, sent)

    async def _after_preemption(
        self, preempted: Preempted, before: RequestInfo
    ) -> tuple[Ask, RequestInfo, float]:
        """The try that continues a preempted stream: the text the client has, re-prefilled;
        its whole remaining cap reserved where its estimate proved short (a growth's
        preemption), else the rest of the try `before`'s estimate; its tenant's hold made that
        size first, waiting for the tenant's room; and when it stops waiting for room."""
        stages, call, progress = self.stages, self.call, self.progress
        progress.preempted += 1
        stages.metrics.preempted_tokens.inc(preempted.tokens)
        stages.metrics.tenant_preemptions_by(self.seat.tenant.name, preempted.reason).inc()
        call.trace.event("preempted", reason=preempted.reason, tokens=preempted.tokens)
        settings = stages.settings.preemption
        # Its room is back on the worker: its hold gives it back to its tenant too, now (the
        # growth it was preempted for waits for exactly that).
        await stages.quota.follow(self.seat.quota, 0, True)
        ask = await stages.resume.ask(call, self.responder.sent)
        # Taken back for others, it had not outgrown its estimate: its whole cap would make
        # its tenant look over its share again and be taken again (in the simulator the
        # shares of two backlogged tenants went 40 % off so), and hold room nobody uses.
        if preempted.reason in TAKEN_BACK:
            rest_of = (before, preempted.tokens)
            info = await stages.reserve.estimate(call, ask, self.seat, rest_of=rest_of)
        else:
            info = await stages.reserve.estimate(call, ask, self.seat, whole_cap=True)
        blocks = reserved_blocks(info)
        await stages.quota.wait_to_follow(self.seat.quota, blocks, settings.resume_wait_s)
        return ask, info, stages.clock() + settings.resume_wait_s

    async def _try(
        self, ask: Ask, info: RequestInfo, resume_by: float | None = None
    ) -> Served | Broken | Preempted | LegFailure:
        """One try: a LegFailure when a leg failed before the answer began, Broken when the
        answer did and broke, Preempted when the router stopped it for room (`resume_by`: the
        continuation of a preempted stream waits for room until then)."""
        stages = self.stages
        self.retries.attempt(counted=resume_by is None)
        with self.call.trace.span("admission", tenant=self.seat.tenant.name):
            avoid = self.retries.tried
            attempt = await stages.reserve.admit_and_reserve(
                self.call, info, self.seat, avoid, resume_by
            )
            self.attempt = attempt
        # The tenant's hold is what this try really reserves (router/request/quota.py).
        reservation, hold, quota = attempt.reservation, self.seat.quota, stages.quota
        reservation.tenant = self.seat.tenant.name
        if hold is not None and hold.limited:
            await quota.follow(hold, reservation.blocks, True)
            reservation.follow_hold = lambda blocks, force: quota.follow(hold, blocks, force)
            reservation.block_limit = hold.tenant.limits.max_reserved_blocks
        try:
            decode = await stages.legs.open(self.call, attempt, ask)
        except LegFailure as failure:
            return failure
        if ask.resume and resume_by is None:  # a preemption's continuation is counted there
            stages.metrics.resumes.inc()
        return await self.responder.respond(attempt, decode, ask)

    async def _served(self, served: Served) -> bytes | None:
        self.status, self.output_tokens = served.status, served.output_tokens
        if served.body is None and served.status == 200:
            # The decode worker is done with the sequence: give its room back now, not once a
            # slow client has taken the last bytes from our send buffer.
            await asyncio.shield(self.settle())
            await self.responder.finish()
        return served.body

    def interrupt(self, err: RouterError) -> None:
        """End the request now with `err` (router/edge/shutdown.py), by the path of a missed
        deadline: a stream ends with an error frame and [DONE]; cleanup releases as always."""
        self._interrupted = err
        if self.progress.deadline is not None:
            with contextlib.suppress(RuntimeError):  # the timeout block is over: nothing to cut
                self.progress.deadline.reschedule(asyncio.get_running_loop().time())

    async def release_attempt(self, record: Record | None = None) -> None:
        """Give back what the current attempt holds, and settle what the fairness policy
        charged for it with its actual cost; safe to call twice."""
        attempt, self.attempt = self.attempt, None
        seat, charge = self.seat, self.seat.charge
        seat.charge = None
        try:
            if charge is not None:
                # Settled before the release, whose wake-up lets the queue pick the next one:
                # that pick then sees what this reservation actually cost, not its estimate —
                # its blocks (as grown) for the time it was held, and its prompt to prefill.
                stages = self.stages
                held_s = max(0.0, stages.clock() - seat.reserved_at)
                blocks = attempt.reservation.blocks if attempt is not None else 0
                actual = AdmissionCost(
                    decode_block_s=blocks * held_s, prefill_tokens=self.call.parsed.prompt_tokens
                )
                stages.admission.settle(charge, actual)
                stages.metrics.tenant_block_seconds_by(charge.tenant).inc(actual.decode_block_s)
        finally:
            await self.stages.release.release(attempt, record)

    async def settle(self) -> None:
        """Release what the request holds and record its output length: once (a stream does
        it as soon as the decode is over; `cleanup` for every other ending)."""
        if self._settled:
            return
        self._settled = True
        try:
            first, info, release = self.progress.first_token_at, self.info, self.stages.release
            classes = None if info is None else self.seat.class_keys(release.estimator, info)
            record = release.outcome(
                self.call, info, self.output_tokens, first, classes, self.seat.tenant.name
            )
            await self.release_attempt(record)
        except Exception:  # a bug: the reservation's lease still frees it, but say so loudly
            log.exception("cleanup of %s failed (its lease will expire)", self.request_id)
        hold, self.seat.quota = self.seat.quota, None
        if hold is not None:
            await self.stages.quota.settle(hold, self._billed_tokens(), self._refused_by_cluster())

    def _billed_tokens(self) -> int:
        """What the request cost its tenant's tokens-per-minute: its prompt and its answer, or
        nothing when it produced no token (refused, failed, or left before its first)."""
        if self.output_tokens is None and self.progress.first_token_at is None:
            return 0
        return self.call.parsed.prompt_tokens + (self.output_tokens or 0)

    def _refused_by_cluster(self) -> bool:
        """No token, and the cluster's refusal (a 429 for lack of room, a 5xx: no worker in
        rotation, workers failing): the tenant's request is given back."""
        if self.output_tokens is not None or self.progress.first_token_at is not None:
            return False
        return self.status == 429 or self.status >= 500

    def _count_for_tenant(self) -> None:
        """The request in its tenant's metrics: its tokens when it was answered, its time to
        first token (its count by status: router/edge/front_door.py `RequestCount`)."""
        metrics, tenant = self.stages.metrics, self.seat.tenant.name
        if self.output_tokens is not None:
            metrics.tenant_prompt_tokens_by(tenant).inc(self.call.parsed.prompt_tokens)
            metrics.tenant_output_tokens_by(tenant).inc(self.output_tokens)
        first = self.progress.first_token_at
        if first is not None:
            metrics.tenant_ttft_by(tenant).observe(first - self.call.started)

    @property
    def settled(self) -> bool:
        """`settle` has run (or runs): what `cleanup` has left awaits nothing (`close`)."""
        return self._settled

    async def cleanup(self) -> None:
        try:
            await self.settle()
        finally:
            self.close()

    def close(self) -> None:
        """The end of the request once settled: its admission slot, its metrics, its trace."""
        stages = self.stages
        if self.seat.admitted:
            self.seat.admitted = False
            stages.admission.leave()
        stages.metrics.duration.observe(stages.clock() - self.call.started)
        self._count_for_tenant()
        self.call.trace.close(self.status)
