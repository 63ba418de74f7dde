"""Two-sided placement: choose the prefill and the decode worker together (docs/design.md §6).

The peers choose each side alone. Here one cost ranks every feasible (P, D) pair: the request's
predicted time to first token,

    TTFT = P's queue wait + prefill (less the prefix-cache hit) + KV transfer P→D + D's first step,

subject to the safety rules of `policies.baselines.screen` (health, identical layouts, room on D
for prompt + an upper-quantile output estimate, P under its stranded-KV cap) and, when an ITL SLO
is set, D's predicted step time with the new sequence within it.

Why it is cheap: a pair's cost splits into a P-only part, a (P group, D group) transfer part and a
D-only part. Within one (layout, P group) bucket only the cheapest P can win for any D, so each D
looks at one P per P group instead of at every P. `place()` is O(P + D·G) for G prefill groups,
which is the O(P·D) pair search with the dominated pairs skipped, exact and fast at 1,000 workers.

Conditional disaggregation: a decode worker that `can_prefill` may prefill the prompt itself
(`Candidate.prefill_id = None`): no transfer and no P queue, but its running batch stalls while it
prefills. Decode steps are memory-bound, so a prompt that fits in the compute slack of one step
(about `step_time × prefill rate` tokens, the roofline's max(memory, compute)) rides along nearly
free; beyond that every resident sequence waits for the excess. That wait, summed over the
sequences (at least one: the next sequence admitted to D waits too), is added to the local
option's score, so short prompts stay local and long ones go remote, the crossover falling out of
the model. `disagg_threshold_tokens` overrides the model: prompts at or under it go local first
where a local-capable decode worker has room, longer ones only remote.

Placement on facts: a view whose `cached_prefix_tokens` is known (from the worker's own KV events)
is used exactly, by whole blocks: P computes only the uncached suffix, the link carries only the
blocks D does not hold (vLLM's NIXL consumer pulls only what its own cache misses, design.md §9),
and a local prefill on D computes only what D's cache misses, so a decode worker that holds
nearly all of a prompt serves it whole when that is cheaper. Unknown (None): the estimate from
`recent_prefixes` and `prefix_weight` stays.
"""

from __future__ import annotations

import heapq
import zlib
from dataclasses import dataclass

from policies.base import (
    Candidate,
    ClusterView,
    Decision,
    DecodeView,
    Placement,
    PrefillView,
    Rejection,
    RequestInfo,
)
from policies.baselines import (
    RETRY_CEILING_S,
    RETRY_FLOOR_S,
    Feasible,
    LayoutKeys,
    screen,
)

__all__ = ["TwoSidedPolicy", "prefix_hit_fraction", "uncached_tokens"]


def uncached_tokens(prompt_tokens: int, cached_prefix_tokens: int, block_size: int) -> int:
    """Prompt tokens a worker must compute (or receive) given the leading tokens it caches.

    The cache holds whole blocks only, so a partial count is floored to a block; at least one
    token is always computed, because the last prompt token yields the logits (vLLM recomputes it
    on a full hit).
    """
    held = min(max(0, cached_prefix_tokens), prompt_tokens)
    held -= held % max(1, block_size)
    return max(1, prompt_tokens - held)


def prefix_hit_fraction(prefix_hashes: tuple[int, ...], recent: frozenset[int]) -> float:
    """Fraction of the prompt's prefix blocks a worker likely still caches.

    Block hashes are chained, so a cache hit is a leading run: stop at the first miss (which is
    also what keeps this O(1) for the many workers that share nothing with the prompt).
    """
    if not prefix_hashes or not recent:
        return 0.0
    run = 0
    for h in prefix_hashes:
        if h not in recent:
            break
        run += 1
    return run / len(prefix_hashes)


@dataclass(frozen=True, slots=True)
class _PrefillOption:
    cost_s: float  # P's queue wait + prefill time, independent of the decode side
    tie: int
    worker: PrefillView


# One way to serve a request: ((tier, score, decode tie, prefill tie), prefill id or None for a
# local prefill, decode worker id, blocks, predicted TTFT, predicted ITL). Plain tuples, and a
# `Candidate` built only for the winners: this loop runs O(D·G) times per request.
_Ranked = tuple[tuple[int, float, int, int], str | None, str, int, float, float]


# A decode worker's best option before its decode tie is known:
# (tier, score, prefill tie, prefill id or None, decode worker, blocks, predicted TTFT, ITL).
_Entry = tuple[int, float, int, str | None, DecodeView, int, float, float]


def _rank(option: _Ranked) -> tuple[int, float, int, int]:
    return option[0]


def _to_candidate(option: _Ranked) -> Candidate:
    _, prefill_id, decode_id, blocks, ttft, itl = option
    return Candidate(prefill_id, decode_id, blocks, ttft, itl)


class TwoSidedPolicy:
    """Jointly picks (P, D) minimising predicted TTFT; see the module docstring."""

    name = "two_sided"

    def __init__(
        self,
        itl_slo_s: float | None = None,
        prefix_weight: float = 0.5,
        max_candidates: int = 4,
        disagg_threshold_tokens: int | None = None,
        seed: int = 0,
    ) -> None:
        if itl_slo_s is not None and itl_slo_s <= 0:
            raise ValueError(f"itl_slo_s must be > 0 or None, got {itl_slo_s}")
        if not 0.0 <= prefix_weight <= 1.0:
            raise ValueError(f"prefix_weight must be within [0, 1], got {prefix_weight}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        if disagg_threshold_tokens is not None and disagg_threshold_tokens < 0:
            raise ValueError(
                f"disagg_threshold_tokens must be >= 0 or None, got {disagg_threshold_tokens}"
            )
        self.itl_slo_s = itl_slo_s
        # Below 1 because `recent_prefixes` is a hint: the worker may have evicted them since.
        self.prefix_weight = prefix_weight
        self.max_candidates = max_candidates
        self.disagg_threshold_tokens = disagg_threshold_tokens
        # Exact ties (an idle, uniform cluster) are broken by a hash of (seed, request, worker):
        # deterministic, yet replicas do not all pile onto the lowest worker id.
        self.seed = seed

    def __repr__(self) -> str:
        return (
            f"TwoSidedPolicy(itl_slo_s={self.itl_slo_s}, prefix_weight={self.prefix_weight}, "
            f"max_candidates={self.max_candidates}, "
            f"disagg_threshold_tokens={self.disagg_threshold_tokens}, seed={self.seed})"
        )

    # -- the decision -------------------------------------------------------------------------

    def place(self, request: RequestInfo, view: ClusterView) -> Decision:
        threshold = self.disagg_threshold_tokens
        allow_local = threshold is None or request.prompt_tokens <= threshold
        local_first = threshold is not None and allow_local
        feasible = screen(request, view, allow_local=allow_local)
        if isinstance(feasible, Rejection):
            return feasible

        slo = request.slo_itl_s if request.slo_itl_s is not None else self.itl_slo_s
        decodes = feasible.decode
        if slo is not None:
            decodes = [(d, n) for d, n in decodes if d.step_time_s(n) <= slo]
            if not decodes:
                return _itl_rejection(feasible, slo)

        groups = self._prefill_groups(request, feasible)
        ctx = _Context(self, request, view, groups, slo, local_first, feasible.key_of)
        best = self._best_per_decode(ctx, decodes, allow_local)
        if not best:
            return Rejection(
                f"no decode worker can prefill this {request.prompt_tokens}-token prompt locally "
                "within the ITL SLO, and none has a compatible prefill worker",
                RETRY_FLOOR_S * 2,
            )
        chosen = heapq.nsmallest(self.max_candidates, best, key=_rank)
        if len(chosen) < self.max_candidates:
            chosen = self._fill(ctx, chosen, decodes, allow_local)
        return Placement(tuple(_to_candidate(o) for o in chosen))

    def _best_per_decode(
        self, ctx: _Context, decodes: list[tuple[DecodeView, int]], allow_local: bool
    ) -> list[_Ranked]:
        """Each decode worker's best option (as `min(ctx.options(..., top_only=True))`), kept
        only if it can be among the `max_candidates` best overall.

        The hot loop of a placement, O(D·G). It computes no tie-breaker hash per worker: within
        one decode worker the decode tie is a constant, so its best option is the least
        (tier, score, prefill tie); across workers the decode tie is needed only where the
        (tier, score) reaches the k-th smallest, so it is hashed for those workers alone.
        """
        key_of = ctx.key_of
        keys = key_of._by_id
        groups = ctx.groups
        transfer_s = ctx.transfer_s
        tier = 1 if ctx.local_first else 0
        entries: list[_Entry] = []
        append = entries.append
        only = next(iter(groups.values())) if len(groups) == 1 else ()
        if len(only) == 1 and not (allow_local and any(d.can_prefill for d, _ in decodes)):
            # The common shape: one layout, one prefill group, no local prefill. Every feasible
            # decode worker pairs with the same best P (`screen` guarantees the layout).
            group, prefills = only[0]
            po = prefills[0]
            cost, ptie, pid = po.cost_s, po.tie, po.worker.worker_id
            plora = po.worker.lora_load_s
            transfers: dict[str, float] = {}
            for d, n in decodes:
                r, u = d.reserved_blocks, d.used_blocks
                step = d.step_base_s + d.step_s_per_block * ((r if r > u else u) + n)
                known = transfers.get(d.group) if d.cached_prefix_tokens is None else None
                if known is not None:
                    t = known
                elif d.cached_prefix_tokens is not None:
                    t = ctx.transfer_to(group, d)
                else:
                    t = transfers[d.group] = transfer_s(group, d.group)
                wait = d.lora_load_s - plora  # D's adapter load beyond P's (both at once)
                ttft = cost + t + step + (wait if wait > 0 else 0.0)
                append((tier, ttft, ptie, pid, d, n, ttft, step))
        else:
            for d, n in decodes:
                r, u = d.reserved_blocks, d.used_blocks
                step = d.step_base_s + d.step_s_per_block * ((r if r > u else u) + n)
                layout = d.layout
                top: _Entry | None = None
                for group, prefills in groups.get(keys.get(id(layout)) or key_of(layout), ()):
                    po = prefills[0]
                    wait = d.lora_load_s - po.worker.lora_load_s
                    ttft = (
                        po.cost_s + ctx.transfer_to(group, d) + step + (wait if wait > 0 else 0.0)
                    )
                    if top is None or (ttft, po.tie) < (top[1], top[2]):
                        top = (tier, ttft, po.tie, po.worker.worker_id, d, n, ttft, step)
                if allow_local and d.can_prefill:
                    local = ctx._local(d, n, step, 0)
                    if local is not None:
                        (ltier, score, _, ltie), _, _, _, lttft, _ = local
                        if top is None or (ltier, score, ltie) < top[:3]:
                            top = (ltier, score, ltie, None, d, n, lttft, step)
                if top is not None:
                    append(top)
        k = self.max_candidates
        if len(entries) > k:
            if all(e[0] == tier for e in entries):
                score_cut = heapq.nsmallest(k, [e[1] for e in entries])[-1]
                entries = [e for e in entries if e[1] <= score_cut]
            else:
                cut = heapq.nsmallest(k, [e[:2] for e in entries])[-1]
                entries = [e for e in entries if e[:2] <= cut]
        # Exact ties (an idle, uniform pool) leave every worker in: `_tie` inlined.
        base = _tie_base(self.seed, ctx.request.request_id)
        crc, wbytes = zlib.crc32, _worker_bytes
        return [
            (
                (t, score, crc(wbytes.get(d.worker_id) or _bytes_of(d.worker_id), base), ptie),
                pid, d.worker_id, n, ttft, step,
            )
            for t, score, ptie, pid, d, n, ttft, step in entries
        ]  # fmt: skip

    def _fill(
        self,
        ctx: _Context,
        chosen: list[_Ranked],
        decodes: list[tuple[DecodeView, int]],
        allow_local: bool,
    ) -> list[_Ranked]:
        """Fewer feasible decode workers than candidates wanted: add alternative prefill workers
        (or local/remote alternatives) for them, so a failed prefill has somewhere to retry."""
        taken = {(o[1], o[2]) for o in chosen}
        extra = [
            option
            for d, n in decodes
            for option in ctx.options(d, n, allow_local, top_only=False)
            if (option[1], option[2]) not in taken
        ]
        extra.sort(key=_rank)
        return chosen + extra[: self.max_candidates - len(chosen)]

    # -- the prefill side ---------------------------------------------------------------------

    def _prefill_groups(
        self, request: RequestInfo, feasible: Feasible
    ) -> dict[str, list[tuple[str, list[_PrefillOption]]]]:
        """layout key -> [(P group, its cheapest prefill options, best first)].

        Only the best `max_candidates` per group are kept: no other P can appear in a ranking.
        """
        # (cost, worker) per (layout key, P group); ties are hashed only for the workers whose
        # cost reaches the k-th smallest of their bucket, the only ones a ranking can use.
        buckets: dict[tuple[str, str], list[tuple[float, PrefillView]]] = {}
        prompt = request.prompt_tokens
        hashes = request.prefix_hashes
        weight = self.prefix_weight
        for key, workers in feasible.prefill_by_key.items():
            for p in workers:
                rate = max(p.prefill_tokens_per_s, 1e-9)
                cached = p.cached_prefix_tokens
                if cached is not None:  # a fact: only the uncached suffix is computed
                    compute = float(uncached_tokens(prompt, cached, p.layout.block_size))
                else:  # a hint, discounted by `prefix_weight`
                    hit = prefix_hit_fraction(hashes, p.recent_prefixes) if hashes else 0.0
                    compute = prompt * (1.0 - weight * hit)
                # An adapter to load first delays the prefill (both sides load at once).
                cost = (p.queued_prompt_tokens + compute) / rate + p.lora_load_s
                bucket = buckets.get((key, p.group))
                if bucket is None:
                    buckets[(key, p.group)] = [(cost, p)]
                else:
                    bucket.append((cost, p))
        k = self.max_candidates
        seed, rid = self.seed, request.request_id
        groups: dict[str, list[tuple[str, list[_PrefillOption]]]] = {}
        for (key, group), costs in buckets.items():
            if len(costs) > k:
                cut = heapq.nsmallest(k, [c for c, _ in costs])[-1]
                costs = [c for c in costs if c[0] <= cut]
            base, crc, wbytes = _tie_base(seed, rid), zlib.crc32, _worker_bytes
            options = [
                _PrefillOption(c, crc(wbytes.get(p.worker_id) or _bytes_of(p.worker_id), base), p)
                for c, p in costs
            ]
            top = heapq.nsmallest(k, options, key=lambda o: (o.cost_s, o.tie))
            groups.setdefault(key, []).append((group, top))
        return groups


class _Context:
    """Per-request state shared by the option generator (the transfer-time cache above all)."""

    __slots__ = (
        "policy",
        "request",
        "view",
        "groups",
        "local_slo",
        "local_first",
        "key_of",
        "_transfer",
    )

    def __init__(
        self,
        policy: TwoSidedPolicy,
        request: RequestInfo,
        view: ClusterView,
        groups: dict[str, list[tuple[str, list[_PrefillOption]]]],
        local_slo: float | None,
        local_first: bool,
        key_of: LayoutKeys,
    ) -> None:
        self.policy = policy
        self.request = request
        self.view = view
        self.groups = groups
        self.local_slo = local_slo
        self.local_first = local_first
        self.key_of = key_of
        self._transfer: dict[tuple[str, str], float] = {}

    def transfer_s(self, p_group: str, d_group: str) -> float:
        pair = (p_group, d_group)
        t = self._transfer.get(pair)
        if t is None:
            t = self.view.transfer_s(self.request.prompt_tokens, p_group, d_group)
            self._transfer[pair] = t
        return t

    def transfer_to(self, p_group: str, d: DecodeView) -> float:
        """KV transfer time into `d`: only the blocks its own cache misses cross the link."""
        cached = d.cached_prefix_tokens
        if cached is None:
            return self.transfer_s(p_group, d.group)
        prompt = self.request.prompt_tokens
        moved = uncached_tokens(prompt, cached, d.layout.block_size)
        return self.view.transfer_s(moved, p_group, d.group)

    def options(self, d: DecodeView, need: int, allow_local: bool, top_only: bool) -> list[_Ranked]:
        """Every way to serve the request with decode on `d` (only each group's best P if
        `top_only`), ranked by (tier, score, ties)."""
        step = d.step_time_s(need)
        tie_d = _tie(self.policy.seed, self.request.request_id, d.worker_id)
        tier = 1 if self.local_first else 0
        out: list[_Ranked] = []
        for group, prefills in self.groups.get(self.key_of(d.layout), ()):
            transfer = self.transfer_to(group, d)
            for po in prefills[:1] if top_only else prefills:
                # The decode side's adapter load runs beside the prefill's: only what it
                # takes beyond it delays the first token.
                wait = d.lora_load_s - po.worker.lora_load_s
                ttft = po.cost_s + transfer + step + (wait if wait > 0 else 0.0)
                rank = (tier, ttft, tie_d, po.tie)
                out.append((rank, po.worker.worker_id, d.worker_id, need, ttft, step))
        if allow_local and d.can_prefill:
            local = self._local(d, need, step, tie_d)
            if local is not None:
                out.append(local)
        return out

    def _local(self, d: DecodeView, need: int, step: float, tie_d: int) -> _Ranked | None:
        rate = max(d.prefill_tokens_per_s, 1e-9)
        prompt = self.request.prompt_tokens
        cached = d.cached_prefix_tokens
        # Known: D computes only what its own cache misses (a held conversation stays local).
        compute = prompt if cached is None else uncached_tokens(prompt, cached, d.layout.block_size)
        prefill_s = compute / rate
        # The part of the prefill that does not hide in one memory-bound step stalls the batch.
        stall = max(0.0, prefill_s - d.step_time_s())
        if self.local_slo is not None and step + stall > self.local_slo:
            return None  # the resident sequences would see a token gap beyond the SLO
        ttft = d.queued_prompt_tokens / rate + prefill_s + step + d.lora_load_s
        score = ttft + stall * max(1, d.resident_seqs)
        return ((0, score, tie_d, -1), None, d.worker_id, need, ttft, step)


def _tie(seed: int, request_id: str, worker_id: str) -> int:
    # crc32, not hash(): str hashes are salted per process, and replicas must agree. The value
    # is crc32(f"{seed}|{request_id}|{worker_id}"), computed as a running crc over the request's
    # part (cached for the current request) and the worker id's bytes (cached per worker).
    return zlib.crc32(_worker_bytes.get(worker_id) or _bytes_of(worker_id),
                      _tie_base(seed, request_id))  # fmt: skip


def _tie_base(seed: int, request_id: str) -> int:
    global _tie_prefix
    prefix = _tie_prefix
    if prefix[0] != seed or prefix[1] != request_id:
        prefix = _tie_prefix = (seed, request_id, zlib.crc32(f"{seed}|{request_id}|".encode()))
    return prefix[2]


def _bytes_of(worker_id: str) -> bytes:
    if len(_worker_bytes) > 65_536:
        _worker_bytes.clear()
    b = _worker_bytes[worker_id] = worker_id.encode()
    return b


_tie_prefix: tuple[int, str, int] = (0, "", zlib.crc32(b"0||"))
_worker_bytes: dict[str, bytes] = {}


def _itl_rejection(feasible: Feasible, slo: float) -> Rejection:
    """Every decode worker with room would break the ITL SLO: wait for the lightest batch to
    shed the blocks that put it over, at its current token rate."""
    best_step, best_d, best_n = min(
        ((d.step_time_s(n), d, n) for d, n in feasible.decode), key=lambda t: (t[0], t[1].worker_id)
    )
    wait = RETRY_CEILING_S
    if best_d.step_s_per_block > 0 and best_d.step_base_s < slo:
        excess_blocks = (best_step - slo) / best_d.step_s_per_block
        token_rate = max(1, best_d.resident_seqs) / max(best_d.step_time_s(), 1e-9)
        wait = excess_blocks * best_d.layout.block_size / token_rate
    return Rejection(
        f"no decode worker keeps the ITL SLO of {slo * 1e3:.1f} ms with this request "
        f"(best predicted {best_step * 1e3:.1f} ms on {best_d.worker_id}, {best_n} blocks)",
        min(RETRY_CEILING_S, max(RETRY_FLOOR_S, wait)),
    )
