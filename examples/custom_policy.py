"""How to write your own placement policy: a worked example.

`TightestFitPolicy` packs answers onto decode workers tightest-fit (the worker with the least
free KV room that still fits the request), keeping big holes free for the long requests that
need them, and sends each prompt to the prefill worker with the shortest queue.

Use it with the router by naming it in the configuration:

    policy: "examples.custom_policy:TightestFitPolicy"
    policy_args: {max_candidates: 3}

(the module must be importable by the router process: install your package, or put its
directory on PYTHONPATH). The router builds it once at startup, calls `place()` once on a tiny
synthetic cluster to check it works, and refuses to start if anything goes wrong.

What a policy is (see `policies.base.PlacementPolicy`):

- an object with a `name` (a short string, used in metrics and logs) and a method
  `place(request: RequestInfo, view: ClusterView) -> Placement | Rejection`;
- `place` is a PURE function of its arguments and the object's own state: no I/O, no clocks, no
  asyncio, no global random numbers (use a `random.Random(seed)` of your own). The same object
  runs in the live router and in the discrete-event cluster simulator, and it is called for
  every request, so keep it fast: one pass over the workers is the budget;
- it must never put a request where it cannot go. The router trusts your candidates: it
  reserves decode room on them in order and dispatches the prefill to the first that succeeds.
  The rules (every built-in policy follows them too):
    1. only workers with `healthy` set;
    2. a prefill and a decode worker only if `p.layout.key == d.layout.key` (the KV cache moves
       from one to the other and must have the same shape);
    3. a decode worker only if `free_blocks` covers the reservation:
       `blocks_for(prompt_tokens + request.reserve_output_tokens, d.layout.block_size)`;
    4. a prefill worker only if `under_stranded_cap` (its KV still waiting for decode workers
       to pick up is under its byte cap: backpressure);
- return several ranked `Candidate`s (distinct decode workers are best): another router replica
  may take the room between the snapshot and the reservation, and the router then tries the next;
- when nothing fits, return a `Rejection` whose `reason` a person can act on and whose
  `retry_after_s` is an honest guess at when to come back (the client gets it as Retry-After).

This file imports only `policies.base`, as a third-party policy would.
"""

from __future__ import annotations

from policies.base import (
    Candidate,
    ClusterView,
    Decision,
    DecodeView,
    Placement,
    PrefillView,
    Rejection,
    RequestInfo,
    blocks_for,
)

__all__ = ["TightestFitPolicy"]


class TightestFitPolicy:
    """Decode: tightest fit (best-fit bin packing). Prefill: fewest queued prompt tokens.

    Best fit leaves the largest free regions intact, so a long request arriving later still finds
    a worker with room; the price is that busy workers get busier, which raises their step time
    (ITL). The built-in `two_sided` policy weighs that; this one deliberately does not.
    """

    # The router and the metrics know a policy by this name.
    name = "tightest_fit"

    def __init__(self, max_candidates: int = 4) -> None:
        # Validate arguments here: the router loads the policy at startup, so a bad value in the
        # configuration fails the deploy with this message instead of failing requests later.
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        self.max_candidates = max_candidates

    def place(self, request: RequestInfo, view: ClusterView) -> Decision:
        # Rules 1 and 4 on the prefill side, grouped by layout for rule 2.
        prefill_by_layout: dict[str, list[PrefillView]] = {}
        for p in view.prefill:
            if p.healthy and p.under_stranded_cap:
                prefill_by_layout.setdefault(p.layout.key, []).append(p)
        if not prefill_by_layout:
            return Rejection("no healthy prefill worker under its stranded-KV cap", 1.0)

        # Rules 1, 2 and 3 on the decode side. The reservation depends on each worker's block
        # size, so it is computed per worker.
        fitting: list[tuple[int, str, DecodeView, int]] = []
        largest_free = 0
        for d in view.decode:
            if not d.healthy or d.layout.key not in prefill_by_layout:
                continue
            need = blocks_for(
                request.prompt_tokens + request.reserve_output_tokens, d.layout.block_size
            )
            largest_free = max(largest_free, d.free_blocks)
            if d.free_blocks >= need:
                # Sort key: room left after placing (tightest first), then the worker id so
                # that equal workers are ranked the same way on every router replica.
                fitting.append((d.free_blocks - need, d.worker_id, d, need))
        if not fitting:
            return Rejection(
                "no healthy decode worker with a compatible layout has room for "
                f"{request.prompt_tokens} prompt + {request.reserve_output_tokens} output tokens "
                f"(largest free: {largest_free} blocks)",
                retry_after_s=2.0,
            )
        fitting.sort(key=lambda entry: (entry[0], entry[1]))

        candidates = []
        for _, _, d, need in fitting[: self.max_candidates]:
            p = min(
                prefill_by_layout[d.layout.key],
                key=lambda w: (w.queued_prompt_tokens, w.worker_id),
            )
            candidates.append(
                Candidate(
                    prefill_id=p.worker_id,
                    decode_id=d.worker_id,
                    reserve_blocks=need,
                    # The predictions are optional, but the router's metrics compare them with
                    # what happened, so a rough figure is better than none.
                    predicted_ttft_s=_predicted_ttft(request, p, d, view, need),
                    predicted_itl_s=d.step_time_s(need),
                )
            )
        return Placement(tuple(candidates))

    def __repr__(self) -> str:
        return f"TightestFitPolicy(max_candidates={self.max_candidates})"


def _predicted_ttft(
    request: RequestInfo, p: PrefillView, d: DecodeView, view: ClusterView, need: int
) -> float:
    """Queue wait + prefill on P, moving the KV to D, and D's first decode step."""
    rate = max(p.prefill_tokens_per_s, 1e-9)
    return (
        (p.queued_prompt_tokens + request.prompt_tokens) / rate
        + view.transfer_s(request.prompt_tokens, p.group, d.group)
        + d.step_time_s(need)
    )
