"""Issue 31's first reproduction as a bench scenario: a tenant poisons its output-length
estimate, then streams long answers beside another tenant's wide requests.

    python -m disagg_tools.loadgen.hostile poison   [--decode-workers 2] [--time-scale 1] ...

Two router replicas on a private, password-protected redis-server; one prefill worker, one or
two simulated decode workers of 3,000 blocks; tenants `qc` (max_reserved_blocks 100) and `v`,
each with its key. `qc` sends requests with max_tokens 2,000 whose answers stop after 4
tokens (X-Sim-Output-Tokens: 4), one at a time, until its own estimator classes hold 25 of
them, then one per replica after a pause (so that each replica's cached statistics hold
them: `_poison`);
then, all at once, `qc`'s 10 streams of 2,000-token answers (max_tokens 2,000) and `v`'s 4
requests of n = 16 x 2,000 tokens (non-streaming), spread over both replicas.

Measured outside the routers: every decode worker's reserved blocks vs capacity (the store,
every ~100 ms: hostile_cluster.StoreSampler), each tenant's hold (the store's `:hsum`, every
~50 ms), the workers' own engine preemptions (/sim/state), every text against the simulated
worker's deterministic answer, and what the store still holds once the traffic is over; the
routers' preemptions and forced growth from their /metrics. Targets: peak reserved <= capacity
on every decode worker, 0 engine preemptions, `qc`'s hold never above its limit, every text
exact, nothing left reserved.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from disagg_tools.loadgen.hostile_cluster import MODEL, HostileCluster, StoreSampler
from disagg_tools.loadgen.hostile_holds import AttackerPeak, AttackerSampler
from disagg_tools.loadgen.hostile_report import clients, reservations
from disagg_tools.loadgen.hostile_run import bounded, peak_targets, sim_states, target
from disagg_tools.loadgen.hostile_tenants import (
    WideResult,
    keyed,
    send_wide,
    settle,
    tenant_cluster,
)
from disagg_tools.loadgen.loadclient import Result, make_request, send

__all__ = ["PoisonSpec", "run_poison"]

ATTACKER, VICTIM = "qc", "v"
PROMPT_TOKENS = 100
# 2.5 x the routers' histogram_refresh_s (1 s): a refresh started is done by then.
_REFRESH_PAUSE_S = 2.5
_POISON_TRIES = 50

# The error an answer that alone outgrew its tenant's block limit ends with (router/request/
# quota.py `over_limit_error`).
_LIMIT_ERROR = "reserved decode blocks at once"


@dataclass(frozen=True, slots=True)
class PoisonSpec:
    limit_blocks: int = 100  # qc's max_reserved_blocks
    poison_requests: int = 25
    poison_tokens: int = 4  # where qc's poisoning answers stop
    max_tokens: int = 2000  # of every request of both tenants
    streams: int = 10  # qc's concurrent long streams
    stream_tokens: int = 2000
    wide_requests: int = 4  # v's
    wide_n: int = 16
    wide_tokens: int = 2000
    decode_workers: int = 2
    decode_blocks: int = 3000
    # Long enough that nothing is refused for waiting: v's wide requests fit one or two at a
    # time, the others wait for them to end (the scenario is about room, not deadlines).
    wait_s: float = 600.0
    time_scale: float = 1.0
    log_level: str = "WARNING"


def _request(index: int, answer: int, max_tokens: int) -> Any:
    req = make_request(
        index,
        model=MODEL,
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=answer,
        max_tokens=max_tokens,
        stream=True,
    )
    return keyed(req, ATTACKER)


async def _poison(
    spec: PoisonSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> tuple[list[Result], int]:
    """qc's short answers, and how many of its tries were refused (429) and tried again.

    Sent one at a time over both replicas until the store holds `poison_requests` of them in
    qc's own classes (a few more may be needed: an answer whose client closed at its last
    event is not always recorded), each try refused for qc's limit sent again after a short
    pause (while qc's estimate is cold a request reserves its whole max_tokens, over the
    limit, which the store grants only to a tenant holding nothing, and the hold of the one
    before is given back a moment after its client saw its end).

    A replica's estimator statistics are a cache refreshed in the background while the stale
    copy answers (router/histograms.py): the first request after a pause is estimated on what
    was there a moment before. So one more request per replica comes after a pause of a few
    refresh periods, as an attacker checking that the poison took would."""
    urls = cluster.router_urls
    refused = 0

    async def one(i: int) -> Result:
        nonlocal refused
        req = _request(7_000_000 + i, spec.poison_tokens, spec.max_tokens)
        for _ in range(_POISON_TRIES):
            res = await send(session, urls[i % len(urls)], req, deadline_s=spec.wait_s)
            if res.status != 429:
                break
            refused += 1
            await asyncio.sleep(0.2)
        return res

    results: list[Result] = []
    while len(results) < 2 * spec.poison_requests:
        results.append(await one(len(results)))
        if (
            len(results) >= spec.poison_requests
            and min(
                (c.get(spec.poison_tokens, 0) for c in (await _own_classes(cluster)).values()),
                default=0,
            )
            >= spec.poison_requests
        ):
            break
    await asyncio.sleep(_REFRESH_PAUSE_S)
    for _ in urls:
        results.append(await one(len(results)))
    await asyncio.sleep(_REFRESH_PAUSE_S)
    return results, refused


async def _attack(
    spec: PoisonSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> tuple[list[Result], list[WideResult]]:
    urls = cluster.router_urls
    streams = [
        send(
            session,
            urls[i % len(urls)],
            _request(8_000_000 + i, spec.stream_tokens, spec.max_tokens),
            deadline_s=spec.wait_s,
        )
        for i in range(spec.streams)
    ]
    wide = [
        send_wide(
            session,
            urls[(i + 1) % len(urls)],
            VICTIM,
            f"wide request {i}: tell me sixteen long stories",
            n=spec.wide_n,
            output_tokens=spec.wide_tokens,
            max_tokens=spec.max_tokens,
            deadline_s=spec.wait_s,
        )
        for i in range(spec.wide_requests)
    ]
    got_streams, got_wide = await asyncio.gather(asyncio.gather(*streams), asyncio.gather(*wide))
    return list(got_streams), list(got_wide)


async def _own_classes(cluster: HostileCluster) -> dict[str, dict[int, int]]:
    """qc's own estimator classes as the store holds them (state/keys.py `output_stats`:
    `{os:t=qc|<class>}`, output-length bucket -> answers): what the poison taught."""
    client = aioredis.from_url(cluster.redis_url)
    try:
        keys = [k async for k in client.scan_iter(f"{cluster.key_prefix}{{os:t={ATTACKER}|*")]
        return {
            k.decode().split("{os:", 1)[1].rstrip("}"): {
                int(b): int(n) for b, n in (await client.hgetall(k)).items()
            }
            for k in keys
        }
    finally:
        await client.aclose()


def _plain(peaks: dict[str, dict[str, AttackerPeak]]) -> dict[str, Any]:
    return {phase: {t: asdict(p) for t, p in by.items()} for phase, by in peaks.items()}


def _wide_report(results: list[WideResult]) -> dict[str, Any]:
    return {
        "requests": len(results),
        "ok": sum(1 for r in results if r.status == 200 and r.exact == r.choices > 0),
        "choices_exact": sum(r.exact for r in results),
        "choices": sum(r.choices for r in results),
        "statuses": [r.status for r in results],
        "seconds": [round(r.seconds, 1) for r in results],
        "details": [r.detail for r in results if r.detail][:4],
    }


async def _scenario(
    spec: PoisonSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> dict[str, Any]:
    decode = cluster.shape.decode_ids
    store = StoreSampler(cluster.redis_url, cluster.key_prefix, decode)
    holds = AttackerSampler(cluster.redis_url, cluster.key_prefix, ATTACKER, [VICTIM], decode)
    store.start()
    holds.start()
    t0 = time.perf_counter()
    try:
        holds.phase = "poison"
        poison, poison_refused = await _poison(spec, cluster, session)
        taught = await _own_classes(cluster)
        holds.phase = "attack"
        t1 = time.perf_counter()
        streams, wide = await _attack(spec, cluster, session)
    finally:
        await store.stop()
        await holds.stop()
    left = await settle(cluster, [ATTACKER, VICTIM])
    engine = {wid: s["preemptions"] for wid, s in (await sim_states(session, cluster)).items()}
    res = reservations(store.samples)
    hold, shared_hold = holds.highest("hold"), holds.highest("hold, shared")
    real, shared_real = holds.highest("reserved"), holds.highest("reserved, shared")
    wide_rep = _wide_report(wide)
    poison_ok = sum(r.outcome == "ok" for r in poison)
    streams_ok = sum(r.outcome == "ok" for r in streams)
    # An answer that alone outgrows qc's whole block limit ends with the limit's error frame
    # (issue 31: the hold never above the limit): exact if what it sent was an exact prefix.
    at_limit = sum(
        r.outcome == "stream_error" and bool(r.prefix_exact) and _LIMIT_ERROR in r.detail
        for r in streams
    )
    return {
        "scenario": "poison",
        "time_scale": spec.time_scale,
        "spec": asdict(spec),
        "reservations": {"run": res},
        "clients": {
            "qc poison": clients(poison, t0),
            "qc streams": clients(streams, t1),
        },
        "extra": {
            "qc poison 429s": f"{poison_refused} tries refused and sent again",
            "qc's classes": taught,  # before the attack
            "v wide": wide_rep,
            "qc peaks": _plain(holds.peaks),
            "qc samples": {
                "samples": holds.samples,
                "with no other tenant holding": holds.alone,
                "errors": holds.errors,
            },
            "left in store": left,
        },
        "targets": {
            "peak reserved <= capacity on every decode worker": peak_targets(res, 1.0),
            "0 engine preemptions": target(
                set(engine) == set(decode) and not any(engine.values()),
                f"per decode worker {engine}",
            ),
            "qc's hold never above its limit": target(
                holds.samples > 0 and hold.hold <= spec.limit_blocks,
                f"peak hold {hold.hold} of {spec.limit_blocks} blocks (its largest request "
                f"{hold.largest}, {hold.holding} holding); with more than one holding: "
                f"{shared_hold.hold} ({holds.samples} samples)",
            ),
            "qc's real reservation never above its limit": target(
                holds.alone > 0 and real.reserved <= spec.limit_blocks,
                f"peak {real.reserved} blocks in {real.reservations} reservations (its hold "
                f"then {real.hold}); with more than one: {shared_real.reserved} in "
                f"{shared_real.reservations} ({holds.alone} samples with v holding nothing)",
            ),
            "every text exact": target(
                poison_ok == len(poison)
                and streams_ok + at_limit == len(streams)
                and wide_rep["ok"] == len(wide),
                f"poison {poison_ok}/{len(poison)}, streams {streams_ok}/{len(streams)} whole "
                f"+ {at_limit} ended at qc's limit after an exact prefix, "
                f"wide {wide_rep['ok']}/{len(wide)} "
                f"({wide_rep['choices_exact']}/{wide_rep['choices']} choices)",
            ),
            "nothing left reserved": target(left["empty"], f"{left}"),
        },
    }


async def run_poison(spec: PoisonSpec, *, workdir: Path | None = None) -> dict[str, Any]:
    decode = tuple((f"d{i}", "decode") for i in range(spec.decode_workers))
    shape = tenant_cluster(
        (("p0", "prefill"), *decode),
        [
            {"name": ATTACKER, "max_reserved_blocks": spec.limit_blocks},
            # A limit that never binds: v's holds are then in the store, and qc's real
            # reservation is what is reserved minus them (hostile_holds).
            {"name": VICTIM, "max_reserved_blocks": 100 * spec.decode_blocks},
        ],
        decode_blocks=spec.decode_blocks,
        time_scale=spec.time_scale,
        log_level=spec.log_level,
        router={
            "admission": {"max_wait_s": spec.wait_s},
            "timeouts": {"ttft_s": spec.wait_s, "prefill_s": spec.wait_s},
            "preemption": {"resume_wait_s": spec.wait_s},
        },
    )
    return await bounded(
        shape,
        lambda cluster, session: _scenario(spec, cluster, session),
        budget_s=2 * spec.wait_s + 120.0,
        sessions=spec.streams + spec.wide_requests + 16,
        workdir=workdir,
    )
