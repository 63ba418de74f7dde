"""What the estimate got wrong while the answers are still streaming, and the room kept for it.

Completed answers teach the estimator (policies/estimators.py) only when they end, and long
answers end last: when answers shift from short to long, every request admitted meanwhile is
sized on the short ones. Two corrections close that gap, pure and deterministic so the live
router and the cluster simulator run the same code:

- `LiveOverruns`: a live request that has outgrown its reservation is a *censored* sample of its
  class — its answer is at least as long as what it has written. `with_live(histograms)` counts
  each such request at its length so far, so a class whose live requests overrun raises its
  quantile at once (and again at each growth), before any of them completes. A named tenant's
  overruns count in its own classes only (policies/tenant_classes.py `own_classes`): the shared
  classes are a prior every tenant reads, and one tenant's live requests must not move it.
- `OverrunMargin`: room admission keeps back on a decode worker for the growth it has seen
  there. When a reservation had to be grown past capacity (forced growth), the excess over
  capacity is how much the live sequences outgrew what admission counted on; holding that much
  back from new placements lets the next such growth land in free room. The margin decays with
  a half-life, so a past shift stops costing room once the answers are predictable again.

    grow past the reservation ──> LiveOverruns.overran(id, classes, tokens)  ──> estimates rise
    reservation released      ──> LiveOverruns.ended(id)
    forced growth / over cap  ──> OverrunMargin.observe(worker, excess, now) ──> margin(worker)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from policies.base import DecodeView
from policies.tenant_classes import own_classes

__all__ = ["LiveOverruns", "OverrunMargin"]


@dataclass(slots=True)
class _Live:
    classes: tuple[str, ...]
    bucket: int  # the bucket of the answer's length so far (one choice's)


class LiveOverruns:
    """Live requests past their reservation, per statistics class (censored samples)."""

    def __init__(self, bucket_of: Callable[[int], int]) -> None:
        self._bucket_of = bucket_of
        self._live: dict[str, _Live] = {}
        # class key -> {bucket: live requests counted there}
        self._by_class: dict[str, dict[int, int]] = {}
        # Bumped on every change, so a waiting request re-estimates only when it moved.
        self.version = 0

    def __len__(self) -> int:
        return len(self._live)

    def __repr__(self) -> str:
        return f"LiveOverruns({len(self._live)} live, {len(self._by_class)} classes)"

    def overran(self, key: str, classes: Sequence[str], tokens: int) -> None:
        """Request `key` (one attempt) of `classes` has written `tokens` (one choice's), past
        its reservation. Called again as it grows; only a new bucket changes anything.
        Of a named tenant's classes, only its own count it (`own_classes`)."""
        bucket = self._bucket_of(tokens)
        old = self._live.get(key)
        if old is not None:
            if old.bucket >= bucket:
                return
            self._count(old, -1)
        entry = _Live(own_classes(classes), bucket)
        self._live[key] = entry
        self._count(entry, 1)
        self.version += 1

    def ended(self, key: str) -> None:
        """The request's reservation is released: from now on its completion (if any) is what
        the histograms learn."""
        old = self._live.pop(key, None)
        if old is not None:
            self._count(old, -1)
            self.version += 1

    def _count(self, entry: _Live, delta: int) -> None:
        for cls in entry.classes:
            hist = self._by_class.setdefault(cls, {})
            n = hist.get(entry.bucket, 0) + delta
            if n > 0:
                hist[entry.bucket] = n
            else:
                hist.pop(entry.bucket, None)
                if not hist:
                    del self._by_class[cls]

    def with_live(
        self, histograms: Mapping[str, Mapping[int, int]]
    ) -> dict[str, Mapping[int, int]]:
        """`histograms` with every live overrun of each class counted at its length so far.

        Classes with no live overrun are passed through as they are (no copy: the common case
        costs a dict lookup per class)."""
        out: dict[str, Mapping[int, int]] = dict(histograms)
        if not self._by_class:
            return out
        for cls, completed in histograms.items():
            live = self._by_class.get(cls)
            if not live:
                continue
            merged = {int(k): int(v) for k, v in completed.items()}
            for bucket, n in live.items():
                merged[bucket] = merged.get(bucket, 0) + n
            out[cls] = merged
        return out


class OverrunMargin:
    """Decode room held back from admission per worker, learned from forced growth.

    `observe(worker, excess_blocks, now)` after a reservation was grown `excess_blocks` past the
    worker's capacity (or when the shared view shows the worker reserved that far over it); the
    margin jumps to the largest excess seen and halves every `half_life_s` after that. Capped at
    `max_share` of the worker's capacity, so a burst of overruns never closes a worker to new
    requests: it only slows admission there until the growth has room.
    """

    def __init__(self, half_life_s: float = 60.0, max_share: float = 0.25) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        if not 0.0 <= max_share < 1.0:
            raise ValueError(f"max_share must be within [0, 1), got {max_share}")
        self.half_life_s = half_life_s
        self.max_share = max_share
        self._seen: dict[str, tuple[float, float]] = {}  # worker -> (blocks, when observed)

    def __repr__(self) -> str:
        return f"OverrunMargin({len(self._seen)} workers, half-life {self.half_life_s}s)"

    def _decayed(self, worker_id: str, now: float) -> float:
        seen = self._seen.get(worker_id)
        if seen is None:
            return 0.0
        blocks, at = seen
        return blocks * math.pow(0.5, max(0.0, now - at) / self.half_life_s)

    def observe(self, worker_id: str, excess_blocks: int, now: float) -> None:
        if excess_blocks <= 0:
            return
        current = self._decayed(worker_id, now)
        if excess_blocks > current:
            self._seen[worker_id] = (float(excess_blocks), now)

    def margin(self, worker_id: str, capacity_blocks: int, now: float) -> int:
        """Blocks to keep back from new placements on `worker_id` at `now`."""
        blocks = self._decayed(worker_id, now)
        if blocks < 1.0:
            self._seen.pop(worker_id, None)
            return 0
        return min(int(blocks), int(capacity_blocks * self.max_share))

    def margins(self, capacities: Mapping[str, int], now: float) -> dict[str, int]:
        """The non-zero margins of the workers in `capacities` (worker -> capacity blocks)."""
        out: dict[str, int] = {}
        for worker_id in list(self._seen):
            if worker_id in capacities:
                m = self.margin(worker_id, capacities[worker_id], now)
                if m:
                    out[worker_id] = m
        return out

    def held(self, views: tuple[DecodeView, ...], now: float) -> tuple[DecodeView, ...]:
        """`views` as placement should see them: each worker's margin counted as reserved
        (the same tuple when no worker has one)."""
        margins = self.margins({v.worker_id: v.capacity_blocks for v in views}, now)
        if not margins:
            return views
        return tuple(
            replace(v, reserved_blocks=v.reserved_blocks + margins[v.worker_id])
            if v.worker_id in margins
            else v
            for v in views
        )
