"""Who is preempted when a live answer must grow and there is no room (issue 31): the rule,
pure and deterministic, so the live router (router/request/preemption.py) and a simulator run
the same code.

The rule: only streams of the GROWING stream's own tenant — on the same decode worker when the
worker is full (`decode_id`), on any worker when the tenant is at its block limit (None) — newest
dispatch first (the least work to redo), the growing stream included; reaching the growing
stream stops the search (preempting it alone frees its whole need). A stream already preempted
`bound` times is not a candidate. Streams that keep within their reservations are never taken
for another tenant's overrun: a tenant whose answers outrun their estimates — an honest miss or
a poisoned estimate alike — pays for it itself. Empty: nothing may be preempted (the caller
then forces the growth, as before preemption existed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["StreamFacts", "Victims", "choose_victims"]


@dataclass(frozen=True, slots=True)
class StreamFacts:
    """What the rule reads of one live stream that could be preempted."""

    stream_id: str
    tenant: str
    decode_id: str
    dispatched: float  # when its decode was sent (any clock: only the order matters)
    blocks: int  # what its reservation holds now
    preempted: int  # times its request was preempted before
    priority: int = 0  # its request's class (lower: more urgent; policies/priority_classes.py)


@dataclass(frozen=True, slots=True)
class Victims:
    """The streams to preempt, and whether the growing one is among them (then its growth is
    moot: it gives all its room back)."""

    stream_ids: tuple[str, ...]
    includes_grower: bool

    def __bool__(self) -> bool:
        return bool(self.stream_ids)


NONE = Victims((), False)


def choose_victims(
    streams: Iterable[StreamFacts],
    grower_id: str,
    tenant: str,
    need_blocks: int,
    decode_id: str | None,
    bound: int,
) -> Victims:
    """The streams to preempt so that the growth of `grower_id` (of `tenant`) finds
    `need_blocks` blocks (the module docstring has the rule)."""
    candidates = sorted(
        (
            s
            for s in streams
            if s.tenant == tenant
            and s.preempted < bound
            and (decode_id is None or s.decode_id == decode_id)
        ),
        key=lambda s: (s.dispatched, s.stream_id),
        reverse=True,
    )
    chosen: list[str] = []
    freed = 0
    for stream in candidates:
        if stream.stream_id == grower_id:
            return Victims((stream.stream_id,), True)
        chosen.append(stream.stream_id)
        freed += stream.blocks
        if freed >= need_blocks:
            return Victims(tuple(chosen), False)
    return NONE  # not enough without the grower, and the grower may not be preempted again
