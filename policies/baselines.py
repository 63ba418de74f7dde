"""The peers' placement policies, kept as baselines for comparison (docs/design.md §4, §6).

SGLang's and vLLM's routers pick a prefill and a decode worker independently. These baselines do
the same (random, round-robin, least-loaded, power-of-two choices on each side) but obey the
safety rules every policy here obeys, so that a benchmark compares *choices*, not over-commits
(like the peers, they ignore ITL SLOs, prefix affinity and transfer cost):

- only healthy workers;
- a prefill and a decode worker are paired only if their `layout.key` is identical;
- a decode worker must have `free_blocks` >= the reservation
  (`blocks_for(prompt + reserve_output_tokens, decode block_size)`);
- a prefill worker must be under its stranded-KV cap.

`screen()` applies those rules once and returns either the feasible workers or a `Rejection` with
a precise reason; `TwoSidedPolicy` uses it too, so both kinds of policy reject identically.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import (
    Candidate,
    ClusterView,
    Decision,
    DecodeView,
    KVLayout,
    Placement,
    PrefillView,
    Rejection,
    RequestInfo,
    blocks_for,
)

__all__ = [
    "Feasible",
    "LayoutKeys",
    "screen",
    "reserve_blocks_on",
    "room_rejection",
    "predict_remote",
    "RETRY_FLOOR_S",
    "RETRY_CEILING_S",
    "RandomPolicy",
    "RoundRobinPolicy",
    "LeastLoadedPolicy",
    "PowerOfTwoPolicy",
]

# A client told to come back sooner than this just adds load; later than this and a caller
# would rather fail over to another deployment.
RETRY_FLOOR_S = 0.5
RETRY_CEILING_S = 30.0
# Health is re-probed every few seconds; a pool with no healthy worker is worth that long a wait.
_RETRY_UNHEALTHY_S = 5.0
# Stranded KV clears when a decode worker accepts it, normally within a transfer or two.
_RETRY_STRANDED_S = 1.0
_DEFAULT_CANDIDATES = 4


def _clamp_retry(seconds: float) -> float:
    return min(RETRY_CEILING_S, max(RETRY_FLOOR_S, seconds))


def reserve_blocks_on(request: RequestInfo, d: DecodeView) -> int:
    """Blocks to reserve on `d`: the prompt plus the estimated output, in d's block size."""
    return blocks_for(request.prompt_tokens + request.reserve_output_tokens, d.layout.block_size)


class LayoutKeys:
    """`KVLayout.key` builds a string on every access and one placement asks for it O(P + D)
    times, so it is computed once per layout object for the duration of one call."""

    __slots__ = ("_by_id",)

    def __init__(self) -> None:
        self._by_id: dict[int, str] = {}

    def __call__(self, layout: KVLayout) -> str:
        key = self._by_id.get(id(layout))
        if key is None:
            key = self._by_id[id(layout)] = layout.key
        return key


@dataclass(frozen=True, slots=True)
class Feasible:
    """The workers a request may use once the safety rules have been applied.

    `prefill_by_key` maps a layout key to the healthy, under-cap prefill workers with it (view
    order). `decode` lists each healthy decode worker with room, with the blocks to reserve on
    it; every one has either a prefill worker in `prefill_by_key` under its layout key, or (when
    local prefill was allowed) `can_prefill`.
    """

    prefill_by_key: dict[str, list[PrefillView]]
    decode: list[tuple[DecodeView, int]]
    key_of: LayoutKeys

    def __repr__(self) -> str:
        n_p = sum(len(v) for v in self.prefill_by_key.values())
        layouts = len(self.prefill_by_key)
        return f"Feasible(prefill={n_p}, decode={len(self.decode)}, layouts={layouts})"


def screen(
    request: RequestInfo, view: ClusterView, allow_local: bool = False
) -> Feasible | Rejection:
    """Apply the safety rules; the reason of a rejection names the first rule nothing passed.

    With `allow_local`, a decode worker that `can_prefill` is feasible without any prefill worker
    (conditional disaggregation), so a missing prefill pool is not by itself a rejection.
    """
    key_of = LayoutKeys()
    keys = key_of._by_id  # id(layout) -> key; a C-level dict.get per worker in the loops below
    healthy_d = [d for d in view.decode if d.healthy]
    if not healthy_d:
        return Rejection("no healthy decode worker", _RETRY_UNHEALTHY_S)
    local_ok = allow_local and any(d.can_prefill for d in healthy_d)

    healthy_p = [p for p in view.prefill if p.healthy]
    if not healthy_p and not local_ok:
        return Rejection("no healthy prefill worker", _RETRY_UNHEALTHY_S)
    # Workers of one pool usually share a layout object: the key is built once per object.
    last_layout: KVLayout | None = None
    d_keys: set[str] = set()
    for d in healthy_d:
        if d.layout is not last_layout:
            last_layout = d.layout
            d_keys.add(keys.get(id(last_layout)) or key_of(last_layout))
    prefill_by_key: dict[str, list[PrefillView]] = {}
    any_compatible = False
    for p in healthy_p:
        key = keys.get(id(p.layout)) or key_of(p.layout)
        if key not in d_keys:
            continue
        any_compatible = True
        if p.under_stranded_cap:
            group = prefill_by_key.get(key)
            if group is None:
                prefill_by_key[key] = [p]
            else:
                group.append(p)
    if not any_compatible and not local_ok:
        return Rejection(
            "no decode worker with a compatible KV layout "
            f"({len(healthy_p)} healthy prefill, {len(healthy_d)} healthy decode workers, "
            "no layout in common)",
            RETRY_CEILING_S,  # a configuration problem: it will not fix itself soon
        )
    if not prefill_by_key and not local_ok:
        return Rejection("no prefill worker under its stranded-KV cap", _RETRY_STRANDED_S)

    # The room check, inlined: `reserve_blocks_on(request, d) <= d.free_blocks` per worker, with
    # the token count computed once and the blocks once per block size.
    tokens = request.prompt_tokens + request.reserve_output_tokens
    need_by_bs: dict[int, int] = {}
    pairable: list[DecodeView] = []
    decode: list[tuple[DecodeView, int]] = []
    last_layout, pairs = None, False
    for d in healthy_d:
        layout = d.layout
        if layout is not last_layout:
            last_layout = layout
            pairs = (keys.get(id(layout)) or key_of(layout)) in prefill_by_key
        if not pairs and not (allow_local and d.can_prefill):
            continue
        pairable.append(d)
        bs = layout.block_size
        need = need_by_bs.get(bs)
        if need is None:
            need = need_by_bs[bs] = blocks_for(tokens, bs)
        r, u = d.reserved_blocks, d.used_blocks
        if d.capacity_blocks - (r if r > u else u) >= need:
            decode.append((d, need))
    if not decode:
        if not pairable:
            # Only reachable with allow_local: local-capable workers exist but none is pairable.
            return Rejection("no decode worker with a compatible KV layout", RETRY_CEILING_S)
        return room_rejection(request, pairable)
    return Feasible(prefill_by_key, decode, key_of)


def room_rejection(request: RequestInfo, decodes: Sequence[DecodeView]) -> Rejection:
    """No decode worker has room: say how far off the best one is and when room may appear.

    The wait is the time for the fastest-freeing worker to close its deficit, taking the batch's
    token rate (resident sequences / step time) as the rate its KV turns over: in steady state KV
    is freed at least as fast as decode tokens are produced, so this errs on the long side.
    """
    needs = [(d, reserve_blocks_on(request, d)) for d in decodes]
    need_min = min(n for _, n in needs)
    largest_free = max(d.free_blocks for d in decodes)
    fits = [(d, n) for d, n in needs if d.capacity_blocks >= n]
    if not fits:
        largest_cap = max(d.capacity_blocks for d in decodes)
        return Rejection(
            f"request needs {need_min} KV blocks, more than any decode worker holds "
            f"(largest capacity: {largest_cap})",
            RETRY_CEILING_S,
        )
    wait = min(
        max(0, n - d.free_blocks) * d.layout.block_size * d.step_time_s() / max(1, d.resident_seqs)
        for d, n in fits
    )
    return Rejection(
        f"no decode worker has {need_min} free blocks for this request "
        f"(largest free: {max(0, largest_free)})",
        _clamp_retry(wait),
    )


def predict_remote(
    request: RequestInfo,
    p: PrefillView,
    d: DecodeView,
    view: ClusterView,
    reserve_blocks: int,
    cached_fraction: float = 0.0,
) -> float:
    """Predicted TTFT of prefill on `p` and decode on `d`: queue + prefill + transfer + 1st step."""
    rate = max(p.prefill_tokens_per_s, 1e-9)
    prompt = request.prompt_tokens
    return (
        p.queued_prompt_tokens / rate
        + prompt * (1.0 - cached_fraction) / rate
        + view.transfer_s(prompt, p.group, d.group)
        + d.step_time_s(reserve_blocks)
    )


def _candidate(
    request: RequestInfo, p: PrefillView, d: DecodeView, need: int, view: ClusterView
) -> Candidate:
    return Candidate(
        prefill_id=p.worker_id,
        decode_id=d.worker_id,
        reserve_blocks=need,
        predicted_ttft_s=predict_remote(request, p, d, view, need),
        predicted_itl_s=d.step_time_s(need),
    )


def _decode_load(d: DecodeView) -> tuple[float, int, str]:
    occupied = max(d.reserved_blocks, d.used_blocks)
    return (occupied / max(1, d.capacity_blocks), d.resident_seqs, d.worker_id)


def _prefill_load(p: PrefillView) -> tuple[int, int, str]:
    return (p.queued_prompt_tokens, p.inflight, p.worker_id)


class _IndependentPolicy:
    """Shared frame: screen, rank decode workers, then pick a prefill worker for each one."""

    name = "independent"

    def __init__(self, max_candidates: int = _DEFAULT_CANDIDATES) -> None:
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        self.max_candidates = max_candidates

    def place(self, request: RequestInfo, view: ClusterView) -> Decision:
        feasible = screen(request, view)
        if isinstance(feasible, Rejection):
            return feasible
        chosen = self._pick_decodes(feasible.decode)
        candidates = [
            _candidate(
                request,
                self._pick_prefill(feasible.prefill_by_key[feasible.key_of(d.layout)]),
                d,
                n,
                view,
            )
            for d, n in chosen
        ]
        return Placement(tuple(candidates))

    def _pick_decodes(self, decodes: list[tuple[DecodeView, int]]) -> list[tuple[DecodeView, int]]:
        raise NotImplementedError

    def _pick_prefill(self, prefills: list[PrefillView]) -> PrefillView:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_candidates={self.max_candidates})"


class RandomPolicy(_IndependentPolicy):
    """Uniformly random on each side, with a private seeded RNG (deterministic per seed)."""

    name = "random"

    def __init__(self, seed: int = 0, max_candidates: int = _DEFAULT_CANDIDATES) -> None:
        super().__init__(max_candidates)
        self.seed = seed
        self._rng = random.Random(seed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed}, max_candidates={self.max_candidates})"

    def _pick_decodes(self, decodes: list[tuple[DecodeView, int]]) -> list[tuple[DecodeView, int]]:
        return self._rng.sample(decodes, min(self.max_candidates, len(decodes)))

    def _pick_prefill(self, prefills: list[PrefillView]) -> PrefillView:
        return self._rng.choice(prefills)


class RoundRobinPolicy(_IndependentPolicy):
    """A rotating counter per side over the feasible workers in worker-id order.

    As in the peers' routers the counter runs over whatever set is feasible right now, so a
    worker dropping out shifts the rotation; that is the baseline's behaviour, kept on purpose.
    """

    name = "round_robin"

    def __init__(self, max_candidates: int = _DEFAULT_CANDIDATES) -> None:
        super().__init__(max_candidates)
        self._next_decode = 0
        self._next_prefill = 0

    def _pick_decodes(self, decodes: list[tuple[DecodeView, int]]) -> list[tuple[DecodeView, int]]:
        ordered = sorted(decodes, key=lambda dn: dn[0].worker_id)
        start = self._next_decode % len(ordered)
        self._next_decode += 1
        rotated = ordered[start:] + ordered[:start]
        return rotated[: self.max_candidates]

    def _pick_prefill(self, prefills: list[PrefillView]) -> PrefillView:
        ordered = sorted(prefills, key=lambda p: p.worker_id)
        chosen = ordered[self._next_prefill % len(ordered)]
        self._next_prefill += 1
        return chosen


class LeastLoadedPolicy(_IndependentPolicy):
    """Prefill: fewest queued prompt tokens. Decode: lowest KV occupancy, then fewest sequences."""

    name = "least_loaded"

    def _pick_decodes(self, decodes: list[tuple[DecodeView, int]]) -> list[tuple[DecodeView, int]]:
        return heapq.nsmallest(self.max_candidates, decodes, key=lambda dn: _decode_load(dn[0]))

    def _pick_prefill(self, prefills: list[PrefillView]) -> PrefillView:
        return min(prefills, key=_prefill_load)


class PowerOfTwoPolicy(_IndependentPolicy):
    """Sample two workers on each side, keep the less loaded one (Mitzenmacher's two choices)."""

    name = "power_of_two"

    def __init__(self, seed: int = 0, max_candidates: int = _DEFAULT_CANDIDATES) -> None:
        super().__init__(max_candidates)
        self.seed = seed
        self._rng = random.Random(seed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed}, max_candidates={self.max_candidates})"

    def _pick_decodes(self, decodes: list[tuple[DecodeView, int]]) -> list[tuple[DecodeView, int]]:
        remaining = list(decodes)
        chosen: list[tuple[DecodeView, int]] = []
        while remaining and len(chosen) < self.max_candidates:
            if len(remaining) == 1:
                chosen.append(remaining.pop())
                break
            i, j = self._rng.sample(range(len(remaining)), 2)
            if _decode_load(remaining[j][0]) < _decode_load(remaining[i][0]):
                i = j
            chosen.append(remaining.pop(i))
        return chosen

    def _pick_prefill(self, prefills: list[PrefillView]) -> PrefillView:
        if len(prefills) == 1:
            return prefills[0]
        a, b = self._rng.sample(prefills, 2)
        return b if _prefill_load(b) < _prefill_load(a) else a
