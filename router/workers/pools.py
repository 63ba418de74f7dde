"""The worker pools as a request's stages use them: three pieces behind one name.

    members      who is in the pools, which pool each is in (router/workers/membership.py)
    accounting   what this replica has put on them since the last refresh (accounting.py)
    placement    the snapshot placement policies decide on (placement_view.py)

Built from the three where the app is assembled (router/edge/app.py), never building anything
itself. A stage that needs only one piece may take that piece instead; the calls below pass
straight through to it.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.base import ClusterView
from router.config import Settings
from router.workers.accounting import LocalAccounting
from router.workers.membership import Membership
from router.workers.placement_view import PlacementView
from router.workers.worker_state import WorkerState

# WorkerState is named here too: the request path and the passthrough import it from here.
__all__ = ["Pools", "WorkerState"]


class Pools:
    __slots__ = ("members", "accounting", "placement")

    def __init__(
        self, members: Membership, accounting: LocalAccounting, placement: PlacementView
    ) -> None:
        self.members = members
        self.accounting = accounting
        self.placement = placement

    def __repr__(self) -> str:
        return f"Pools({list(self.members.workers.values())!r})"

    # -- members ------------------------------------------------------------------------------
    @property
    def settings(self) -> Settings:
        return self.members.settings

    @property
    def workers(self) -> dict[str, WorkerState]:
        return self.members.workers

    def worker(self, worker_id: str) -> WorkerState:
        return self.members.worker(worker_id)

    @property
    def prefill_workers(self) -> Iterable[WorkerState]:
        return self.members.prefill_workers

    @property
    def decode_workers(self) -> Iterable[WorkerState]:
        return self.members.decode_workers

    def can_prefill_locally(self, w: WorkerState) -> bool:
        return self.members.can_prefill_locally(w)

    # -- placement ----------------------------------------------------------------------------
    def snapshot(
        self,
        avoid: frozenset[str] = frozenset(),
        model: str = "",
        freeing: dict[str, int] | None = None,
    ) -> ClusterView:
        return self.placement.snapshot(avoid, model, freeing)

    # -- accounting ---------------------------------------------------------------------------
    def note_reserved(self, worker_id: str, blocks: int) -> None:
        self.accounting.note_reserved(worker_id, blocks)

    def note_pending(self, worker_id: str, blocks: int) -> None:
        self.accounting.note_pending(worker_id, blocks)

    def note_released(self, worker_id: str, blocks: int) -> None:
        self.accounting.note_released(worker_id, blocks)

    def note_stranded(self, worker_id: str, nbytes: int) -> None:
        self.accounting.note_stranded(worker_id, nbytes)
