"""LoRA adapters in the simulator (issue 35; docs/lora.md): each request under one adapter drawn
from a Zipf popularity, each worker holding at most `max_loras` adapters in LRU order, and the
router's view of them in one of three placements.

    aware        the router's: both sides' `lora_load_s` in the views (0 held, `load_s` to load),
                 so two-sided placement weighs a load on either side in its TTFT
    decode_only  an llm-d-style affinity on the decode side alone: the decode views carry the
                 load, the prefill views do not (the prefill side is chosen blind)
    blind        no adapter in the views at all (loads still happen where the request lands)

Every worker may load every adapter (runtime loading everywhere), so each mode places on pairs
that can serve the request; the modes differ in how often they make the engines load. A load is
what the router does before the prefill leg: it loads on both sides at once, and the request's
prefill starts when the slower load is done (`ready_in`). A load also takes its engine's time,
as vLLM's does (the engine core runs it between two steps): a prefill worker starts no prefill
until its load is done (`busy_for`), and a decode worker's running batch waits one load longer
for its next step (the engine folds it into that step's time).
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from policies.base import DecodeView, PrefillView

__all__ = ["LoraMode", "LoraSimConfig", "SimLoras", "zipf_adapters"]

LoraMode = Literal["aware", "decode_only", "blind"]
MODES: tuple[LoraMode, ...] = ("aware", "decode_only", "blind")


@dataclass(frozen=True, slots=True)
class LoraSimConfig:
    adapters: int = 100
    zipf_s: float = 1.1
    max_loras: int = 8
    load_s: float = 0.5
    mode: LoraMode = "aware"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.adapters < 1 or self.max_loras < 1 or self.load_s < 0 or self.zipf_s <= 0:
            raise ValueError("adapters, max_loras >= 1; load_s >= 0; zipf_s > 0")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")


def zipf_adapters(n: int, adapters: int, s: float, seed: int) -> list[str]:
    """`n` adapter names, rank k drawn with probability ~ 1 / k**s (deterministic by seed)."""
    weights = [1.0 / (k**s) for k in range(1, adapters + 1)]
    total = sum(weights)
    cumulative: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w / total
        cumulative.append(acc)
    rng = random.Random(seed)
    last = adapters - 1
    return [f"lora-{min(bisect.bisect_left(cumulative, rng.random()), last)}" for _ in range(n)]


class SimLoras:
    """The adapters of every worker of one run, and the loads they took."""

    def __init__(self, config: LoraSimConfig, n_requests: int) -> None:
        self.config = config
        self.adapter_of = zipf_adapters(n_requests, config.adapters, config.zipf_s, config.seed)
        self._held: dict[str, OrderedDict[str, None]] = {}
        self._waiting: set[int] = set()  # jobs whose loads are under way
        self._busy_until: dict[str, float] = {}  # a worker's engine is loading until then
        self.loading: list[str] = []  # the workers the last `ready_in` made load
        self.loads = 0
        self.evictions = 0

    def __repr__(self) -> str:
        return f"SimLoras({self.config.mode}, {self.loads} loads)"

    def holds(self, wid: str, adapter: str) -> bool:
        return adapter in self._held.get(wid, ())

    def _cost(self, wid: str, adapter: str) -> float:
        return 0.0 if self.holds(wid, adapter) else self.config.load_s

    def decorate(
        self, prefill: Sequence[PrefillView], decode: Sequence[DecodeView], job_idx: int
    ) -> tuple[tuple[PrefillView, ...], tuple[DecodeView, ...]]:
        """The views as the mode's router sees them for this request."""
        mode, adapter = self.config.mode, self.adapter_of[job_idx]
        if mode == "aware":
            prefill = [replace(p, lora_load_s=self._cost(p.worker_id, adapter)) for p in prefill]
        if mode in ("aware", "decode_only"):
            decode = [replace(d, lora_load_s=self._cost(d.worker_id, adapter)) for d in decode]
        return tuple(prefill), tuple(decode)

    def _use(self, wid: str, adapter: str) -> float:
        held = self._held.setdefault(wid, OrderedDict())
        if adapter in held:
            held.move_to_end(adapter)
            return 0.0
        held[adapter] = None
        self.loads += 1
        while len(held) > self.config.max_loras:
            held.popitem(last=False)
            self.evictions += 1
        return self.config.load_s

    def ready_in(self, job_idx: int, wids: Sequence[str]) -> float:
        """The job is dispatched to `wids` (its pair, or the decode worker alone): seconds until
        its adapter is on all of them (both loads at once); `loading` names the workers that
        load it. A job already waiting for its loads is ready now (its second dispatch)."""
        self.loading = []
        if job_idx in self._waiting:
            self._waiting.discard(job_idx)
            return 0.0
        adapter = self.adapter_of[job_idx]
        self.loading = [w for w in wids if self._use(w, adapter) > 0]
        if not self.loading:
            return 0.0
        self._waiting.add(job_idx)
        return self.config.load_s

    def occupy(self, wid: str, now: float) -> None:
        """A prefill worker's engine loads for `load_s` from now (after a load under way)."""
        self._busy_until[wid] = max(now, self._busy_until.get(wid, now)) + self.config.load_s

    def busy_for(self, wid: str, now: float) -> float:
        """Seconds the worker's engine is still loading: a prefill starting now waits them."""
        return max(0.0, self._busy_until.get(wid, now) - now)
