"""Give back what an attempt holds, and feed the answer's length back to the estimator.

Entry point: `release(call, attempt, record)`: the decode reservation and the stranded-KV entry
in one store call (router/leases.py `finish`), with the output statistic (`outcome`) at the
end of the request. It cannot half-fail: a step the store did not take is owed and retried by
the lease keeper, never renewed.
"""

from __future__ import annotations

from policies.base import RequestInfo
from router.request.attempt import Attempt, Call

__all__ = ["Record", "outcome", "release"]

# The estimator's feedback: (class keys, output-length bucket), recorded with the last release.
Record = tuple[list[str], int]


async def release(call: Call, attempt: Attempt | None, record: Record | None = None) -> None:
    gw = call.gw
    freed = unstrand = None
    if attempt is not None:
        if attempt.partner is not None and not attempt.partner.done():
            attempt.partner.cancel()  # closes the prefill leg's connection
        if attempt.ready_mark is not None:
            attempt.ready_mark.cancel()
            attempt.ready_mark = None
        if attempt.stranded_on is not None:
            # Written with the reservation, so a prefill that failed (or never answered, or
            # was not sent: the client left) has an entry too, pending: cleared here.
            prefill_id, attempt.stranded_on = attempt.stranded_on, None
            gw.pools.note_stranded(prefill_id, -attempt.stranded_bytes)
            unstrand = (prefill_id, attempt.stranded_id)
        if attempt.decode_id is not None:
            decode_id, attempt.decode_id = attempt.decode_id, None
            freed = (decode_id, attempt.reservation_id)
            if attempt.overran:
                gw.overruns.ended(attempt.reservation_id)  # its length is now the record's
    if freed is None and unstrand is None and record is None:
        return
    released = await gw.leases.finish(freed, unstrand, record)
    if freed is not None:
        gw.pools.note_released(freed[0], released)
        if gw.admission.waiting:
            gw.admission.notify()


def outcome(
    call: Call, info: RequestInfo | None, output_tokens: int | None, first_token_at: float | None
) -> Record | None:
    """The answer's length, observed (metrics) and as the estimator's record; None when the
    request produced no answer."""
    gw = call.gw
    if output_tokens is None or info is None:
        return None
    gw.metrics.output_tokens.observe(output_tokens)
    if first_token_at is not None and output_tokens > 1:
        gw.metrics.time_per_output_token.observe(
            (gw.clock() - first_token_at) / (output_tokens - 1)
        )
    if output_tokens > 0:
        reserved = info.reserve_output_tokens
        gw.metrics.estimate_relative_error.observe((reserved - output_tokens) / output_tokens)
    # The estimator learns the length of one choice (what it estimates): an n-choice
    # answer's tokens are shared by its n choices.
    per_choice = -(-output_tokens // max(1, call.parsed.n))
    return list(gw.estimator.class_keys(info)), gw.estimator.bucket_of(per_choice)
