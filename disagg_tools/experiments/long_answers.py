"""A decode-heavy phase for the mix shift (docs/elastic-roles.md, issue 26): the shared traces'
arrivals and prompts with the answers of a reasoning model.

Every shared trace is prefill-bound on H100 (outputs: conv median 129, code 13, Mooncake 69
tokens), so a mix of them moves the best P:D split by one or two workers at most. Reasoning
models (DeepSeek-R1, the o1/o3 family, QwQ) think before they answer and emit thousands of
tokens per request; a service that moves from chat to such a model, or routes both, sees the
decode load per request grow ten- to twenty-fold while arrivals and prompts stay what they were.

The phase keeps each row's arrival time, prompt length and index, and replaces its output length
by a draw from a log-normal distribution (`LongAnswers`): median 2,048 tokens, sigma 0.8
(p10 ≈ 730, p90 ≈ 5,700, mean ≈ 2,800 before the cut), cut to [256, 8,192] (the phase's client
`max_tokens`). Chosen, not measured: a long right tail like the traces' own outputs (their
log-normal sigmas are 0.9-1.3), a median an order of magnitude above conv's, and a cap at the
8 K answers reasoning models are commonly served with. The draws are seeded per row index, so
the same rows give the same answers whatever slice is taken.

**Calibration** (the `conv-long` mix, `elastic_roles.MIXES`: `LONG_RATE`, 3,000 rows). Alone, on
8 H100 serving 8B (conv rows 14,000-16,999, 5.35 req/s at the trace's rate, the first 600 rows
not counted), the phase's goodput per fixed split is 9.81 req/s at 1P:7D, 8.25 at 2P:6D, 6.64 at
3P:5D, 5.35 at 4P:4D, 3.78 at 5P:3D, 2.56 at 6P:2D: ~1.4 req/s per decode worker, whatever the
prefill count (decode KV binds: ~400 K tokens per GPU against answers of ~2,700 tokens living
~50-100 s each), so its best split is the opposite end from conv's 5P:3D. The rate is set
as the other mixes' are: the phase alone saturates its best split (1P:7D) at conv's own
saturation scale (×21.67 at 5P:3D), 9.81 / (5.35 × 21.67) = 0.085 of the rows' own rate. At
that rate no fixed split serves both: per split, the lower of the two phases' goodputs (in
rate-scale units) peaks at 3P:5D, ×12.9, against ×21.7 for a split that followed the phases
(an ideal of 1.68 × with no switch cost). 3,000 rows last ~470-790 s at the scales the mix is
measured at (×8-14), five or more answer lifetimes, so the decode load is at its steady state
for most of the phase (1,200 rows ended within the first one or two lifetimes).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from disagg_tools.traces import TraceRequest

__all__ = ["LongAnswers", "long_answer_phase"]


@dataclass(frozen=True, slots=True)
class LongAnswers:
    """The output-length distribution of the decode-heavy phase: log-normal, cut to [lo, hi]."""

    median: float = 2048.0
    sigma: float = 0.8
    lo: int = 256
    hi: int = 8192

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or not 1 <= self.lo <= self.hi:
            raise ValueError("median > 0, sigma >= 0, 1 <= lo <= hi")

    def draw(self, rng: random.Random) -> int:
        x = math.exp(rng.gauss(math.log(self.median), self.sigma))
        return max(self.lo, min(self.hi, round(x)))


def long_answer_phase(
    rows: Sequence[TraceRequest], *, seed: int = 0, answers: LongAnswers | None = None
) -> list[TraceRequest]:
    """`rows` with their arrivals and prompts kept and their outputs drawn from `answers`
    (default `LongAnswers()`), deterministically from `seed` and each row's index; each asks
    `max_tokens` = the distribution's cut (its clients' cap, which the estimator's classes name:
    the phase's answers are not learnt as conv's)."""
    dist = answers or LongAnswers()
    return [
        replace(r, output_tokens=dist.draw(random.Random(f"{seed}|{r.index}")), max_tokens=dist.hi)
        for r in rows
    ]
