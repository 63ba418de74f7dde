"""How a placed (prefill, decode) pair serves a request, read off its workers' protocols:

- **pulled**: vLLM NIXL pull mode, the prefill leg first, its KV handle into the decode leg;
  the KV waits on the prefill worker between the legs (a stranded-KV entry);
- **concurrent**: SGLang rooms / vLLM Mooncake (`concurrent_legs`), both legs at once, the
  decode takes the KV as it is built;
- **decode alone**: no prefill worker, or an answer of n > 1 choices in front of vLLM, which
  its decode worker serves whole (`decode_alone`).

Reserve decides from it whether a stranded entry is written with the reservation; the legs,
which legs to open. One answer for both.
"""

from __future__ import annotations

from typing import cast

from router.adapters import ConcurrentAdapter, WorkerAdapter
from router.errors import UpstreamError
from router.request.attempt import LegFailure
from router.workers.membership import Membership
from router.workers.worker_state import WorkerState

__all__ = ["Pairing"]


class Pairing:
    __slots__ = ("members", "adapters")

    def __init__(
        self, members: Membership, adapters: dict[str, WorkerAdapter | ConcurrentAdapter]
    ) -> None:
        self.members, self.adapters = members, adapters

    def __repr__(self) -> str:
        return f"Pairing(adapters={sorted(self.adapters)})"

    def decode_alone(self, n: int, prefill_id: str) -> bool:
        """An answer of n > 1 choices is served whole by its decode worker (no prefill leg, no
        KV handoff) in front of vLLM: its NIXL producer frees a prefill's blocks at the first
        reader's notification, and the decode fans n > 1 out into n requests that each pull
        the same handle, so all but the first race that free (docs/real-workers.md, "`n` >
        1"). SGLang's decode workers cannot prefill, and its PD pairs do not serve n > 1 at
        all (`Legs.open` refuses it, docs/real-sglang.md)."""
        if n <= 1:
            return False
        return self.members.worker(prefill_id).spec.adapter != "sglang"

    def sglang(self, prefill_id: str) -> bool:
        return self.members.worker(prefill_id).spec.adapter == "sglang"

    def concurrent(self, prefill_id: str) -> bool:
        spec = self.members.worker(prefill_id).spec
        return bool(getattr(self.adapters[spec.adapter], "concurrent_legs", False))

    def kv_waits(self, n: int, prefill_id: str | None) -> bool:
        """Whether KV waits on the prefill worker between the legs (a pulled pair)."""
        return (
            prefill_id is not None
            and not self.decode_alone(n, prefill_id)
            and not self.concurrent(prefill_id)
        )

    def pull_adapter(self, worker: WorkerState) -> WorkerAdapter:
        """`worker`'s adapter in NIXL pull mode (prefill first, its KV handle to the decode)."""
        adapter = self.adapters[worker.spec.adapter]
        # The protocol's own flag, not isinstance: a runtime-checkable Protocol's isinstance
        # walks its members on every call (~1 % of the router's CPU at 256 streams, twice per
        # request).
        if getattr(adapter, "concurrent_legs", False):  # pragma: no cover - pairs share one
            err = UpstreamError(f"worker {worker.spec.id} cannot take part in a pulled KV handoff")
            raise LegFailure(worker.spec.role, worker.spec.id, err, False)
        return cast(WorkerAdapter, adapter)

    def concurrent_adapter(self, worker: WorkerState) -> ConcurrentAdapter | None:
        adapter = self.adapters[worker.spec.adapter]
        return adapter if isinstance(adapter, ConcurrentAdapter) else None
