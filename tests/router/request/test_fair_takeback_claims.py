"""Two replicas read the same starved waiter (router/request/fair_takeback.py): before either
preempts it claims the waiting request in the store, so one request costs one preemption in the
cluster, not one per replica holding the flooder's streams (issue 33's spread rows)."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.fair_share import ClusterWaiter, Occupancy
from router.admission import AdmissionSettings
from router.metrics import RouterMetrics
from router.request.fair_takeback import FairTakeBack
from router.request.preemption import LiveStream, Preemptor
from router.settings_groups import PreemptionSettings
from state import MemoryStore, StateStore


@dataclass
class _Share:
    """What the take-back reads of router/fair_share.py's ClusterShare after a sync."""

    replica: str
    store: StateStore
    waiters: tuple[ClusterWaiter, ...]
    occupancy: Occupancy
    left_for: list[str] = field(default_factory=list)

    def leave_for(self, replica: str, line: tuple[int, str], for_s: float) -> None:
        """The room taken back is left for a waiter of `line` on `replica`
        (ClusterShare.leave_for)."""
        self.left_for.append(replica)


def _replica(name: str, cut: list[str]) -> tuple[FairTakeBack, Preemptor]:
    metrics = RouterMetrics()
    preemptor = Preemptor(PreemptionSettings(), metrics)
    for i in range(3):  # the flooder's streams this replica relays
        rid = f"{name}-s{i}"
        stop = lambda rid=rid: cut.append(rid)  # noqa: E731 (the stream's cut)
        preemptor.register(LiveStream(rid, "d0", "flooder", float(i), 0, lambda: 20, stop))
    return FairTakeBack(AdmissionSettings(fairness="vtc"), preemptor, lambda: 100.0), preemptor


async def _round(count: int) -> tuple[list[str], list[str]]:
    """The streams cut, and the replicas the room was left for, by the two replicas."""
    store = MemoryStore()
    waiter = ClusterWaiter("r3", 0, "victim", 0.0, count, 1.0)  # waited 1 s on a third replica
    occupancy = Occupancy(120, {"flooder": 120}, {}, frozenset({"flooder", "victim"}))
    cut: list[str] = []
    left: list[str] = []
    for name in ("r1", "r2"):
        take_back, _ = _replica(name, cut)
        share = _Share(name, store, (waiter,), occupancy)
        await take_back(share)  # type: ignore[arg-type]
        left += share.left_for
    return cut, left


async def test_one_waiting_request_costs_one_preemption_across_replicas() -> None:
    cut, left = await _round(1)
    assert len(cut) == 1
    assert left == ["r3"]  # the room is left for the waiter's replica, which is nudged


async def test_two_waiting_requests_get_one_preemption_each() -> None:
    cut, left = await _round(2)
    # Two in all, whichever replica's burst makes them: the first replica claims both requests
    # (a burst of two), the second finds nothing left to claim and cuts nothing.
    assert left == ["r3", "r3"]
    assert len(cut) == 2 and {rid.split("-")[0] for rid in cut} == {"r1"}
