"""Sustained rate (issue 36): the requests per second one router core sustains with TTFT p99
at most 50 ms above the baseline's, for each answer length, ours against vllm-router.

    python -m disagg_tools.overhead.saturation [--targets ours_redis,ours_dropin,vllm]
                                               [--tokens 16,128] [--tries 3]
                                               [--json F] [--markdown F]

One pair of stand-in workers (`fixed_worker`, a token every `--interval-ms`, no limit on
concurrent streams), every target started once as `python -m disagg_tools.overhead` starts it
(`targets.start_router`: pinned to `--router-core`; the workers and this process on
`--load-core`). For each answer length and target, OPEN-LOOP arrivals (`run_arrivals`: Poisson
or evenly spaced with jitter, seeded by rate, so a target and the baseline at one rate get the
same arrival times), each a streaming chat completion. One try of a step at a rate:
`--warmup-s` of arrivals not measured, then max(`--step-requests`, rate x `--step-s`) measured
ones. The same without a router (the client makes the two PD calls itself: the `baseline`
target) gives the baseline's TTFT at that rate. A try passes when every measured answer is
complete, the achieved rate (sends and first tokens per second) is at least `--min-achieved`
of its arrivals' own, and the target's TTFT p99 minus the baseline's is at most
`--added-p99-ms`.

The search (`find_sustained`): a ladder of rates from `--start-rps`, times `--factor` while
steps pass (down, divided, while the first fails), then `--bisect` geometric bisections between
the last passing and the first failing rate. Rates are rounded to three significant digits, so
that the targets' bisections meet on the same rates and share the baseline's steps. A step's
verdict is the majority of up to `--tries` tries (`majority`): it passes once more than half
pass, fails once they cannot (with 3: two agreeing tries decide, else a third). With one try,
a single TTFT spike failed a step and so ended the whole search (two runs ten minutes apart:
0.92x and <= 0.50x the peer); a majority makes the verdict a property of the rate, not of one
run. A step reports its median try among those that voted for its verdict, and every try's
vote; the router CPU per request at the sustained rate (steadier than the rate) is the median
over its tries. The baseline runs once per answer length and rate, not per try: every try of
every target is held to the same reference (a spike in it moves them all alike instead of
deciding one try), at one step's cost.

The load generator must not be what fails: a try is "client" (not the target's verdict) when
the baseline cannot do the rate (errors, achieved below `--min-achieved`, or the client's send
lag p99 above `--max-lag-ms`), or when the target's try would pass but the client sent late.
(A target's failing try with lag is the target's: the baseline showed the client can offer
the rate.) A "client" try is its step's verdict at once: more tries say nothing of the target.
The search stops there and the rate found is reported as a lower bound, limited by the load
generator, not as the router's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg_tools import uvrun
from disagg_tools.overhead.ladder import machine_notes
from disagg_tools.overhead.measure import Segment, measure
from disagg_tools.overhead.overhead_cli import add_common_arguments, parse, pinned
from disagg_tools.overhead.overhead_client import LoadSpec, StreamRecord, run_arrivals
from disagg_tools.overhead.overhead_report import percentile, replace_between_markers, summarize
from disagg_tools.overhead.private_redis import redis_for_run
from disagg_tools.overhead.targets import StartedRouter, Workers, start_router, start_workers
from disagg_tools.procs import HOST
from disagg_tools.progress import note

__all__ = [
    "Step",
    "arrival_offsets",
    "build_parser",
    "find_sustained",
    "grid",
    "main",
    "majority",
    "markdown",
    "run",
    "vote_text",
]

PASS, FAIL, CLIENT = "pass", "fail", "client"


def grid(rate: float) -> float:
    """`rate` to three significant digits: the same rates from every target's bisection."""
    return float(f"{rate:.3g}")


@dataclass(slots=True)
class Step:
    """One rate tried: its verdict (PASS, FAIL: the target's, CLIENT: the load generator's)
    and what was measured."""

    rate: float
    verdict: str
    detail: dict[str, Any] = field(default_factory=dict)


async def find_sustained(
    probe: Callable[[float], Awaitable[Step]],
    *,
    start: float,
    factor: float = 2.0,
    bisect: int = 3,
    min_rate: float = 1.0,
    max_rate: float = 100_000.0,
) -> dict[str, Any]:
    """The highest rate whose step passes: a geometric ladder then bisection (module doc).

    Returns {"sustained": the highest passing rate (None: none passed), "step": its Step,
    "limited_by": "router" (a higher rate failed), "load generator" (a higher rate could not be
    offered: `sustained` is a lower bound), "max rate" (`max_rate` reached) or "min rate"
    (nothing passed down to `min_rate`), "steps": every Step in the order tried}."""
    steps: list[Step] = []

    async def at(rate: float) -> Step:
        step = await probe(rate)
        steps.append(step)
        return step

    lo: Step | None = None
    hi: Step | None = None
    first = await at(grid(start))
    if first.verdict == PASS:
        lo = first
        while (rate := grid(lo.rate * factor)) <= max_rate:
            step = await at(rate)
            if step.verdict != PASS:
                hi = step
                break
            lo = step
    else:
        hi = first
        while hi.verdict == FAIL and (rate := grid(hi.rate / factor)) >= min_rate:
            step = await at(rate)
            if step.verdict == PASS:
                lo = step
                break
            hi = step
    if lo is not None and hi is not None:
        for _ in range(bisect):
            rate = grid(math.sqrt(lo.rate * hi.rate))
            if rate in (lo.rate, hi.rate):
                break
            step = await at(rate)
            if step.verdict == PASS:
                lo = step
            else:
                hi = step
    if lo is None:
        limited = "load generator" if hi is not None and hi.verdict == CLIENT else "min rate"
    elif hi is None:
        limited = "max rate"
    else:
        limited = "router" if hi.verdict == FAIL else "load generator"
    return {
        "sustained": lo.rate if lo else None,
        "step": lo,
        "limited_by": limited,
        "steps": steps,
    }


async def majority(try_once: Callable[[], Awaitable[Step]], tries: int) -> Step:
    """One step from up to `tries` calls of `try_once` (module doc): PASS once more than half
    of `tries` pass, FAIL once they cannot, CLIENT at once on a CLIENT try. Its detail is the
    median try's of those for its verdict, plus "tries" (each try's verdict and detail, in
    order) and "votes" (tries by verdict)."""
    if tries < 1:
        raise ValueError(f"tries={tries}: a step needs at least one try")
    need = tries // 2 + 1
    done: list[Step] = []
    verdict: str | None = None
    while verdict is None:
        done.append(await try_once())
        passes = sum(s.verdict == PASS for s in done)
        if done[-1].verdict == CLIENT:
            verdict = CLIENT
        elif passes >= need:
            verdict = PASS
        elif len(done) - passes > tries - need:  # too many fails for `need` passes
            verdict = FAIL

    def added_p99(s: Step) -> float:  # an unmeasured one (errors) ranks as the worst
        p99 = (s.detail.get("added_ttft_ms") or {}).get("p99")
        return math.inf if p99 is None else float(p99)

    # The median by added TTFT p99; of two middle ones, the worse.
    voters = sorted((s for s in done if s.verdict == verdict), key=added_p99)
    median = voters[len(voters) // 2]
    detail = {
        **median.detail,
        "tries": [{"verdict": s.verdict, **s.detail} for s in done],
        "votes": {v: sum(s.verdict == v for s in done) for v in (PASS, FAIL, CLIENT)},
    }
    return Step(median.rate, verdict, detail)


def vote_text(step: Step) -> str:
    """How a step's tries voted: "2/3 pass" (for its verdict / run); "" if not `majority`'s."""
    tried = step.detail.get("tries")
    return f"{step.detail['votes'][step.verdict]}/{len(tried)} {step.verdict}" if tried else ""


def arrival_offsets(rate: float, n: int, *, seed: int, poisson: bool = True) -> list[float]:
    """`n` send times (seconds from the start) at `rate` per second: Poisson (exponential
    gaps) or evenly spaced with +-25 % jitter; the same for the same (rate, n, seed)."""
    rng = random.Random(f"{seed}:{rate}")
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        gap = 1.0 / rate
        t += rng.expovariate(rate) if poisson else gap * rng.uniform(0.75, 1.25)
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def _per_s(stamps: list[float | None]) -> float | None:
    got = sorted(t for t in stamps if t is not None)
    if len(got) < 2 or got[-1] <= got[0]:
        return None
    return (len(got) - 1) / (got[-1] - got[0])


def _achieved(measured: list[StreamRecord]) -> tuple[float | None, float | None]:
    """(the rate the measured answers were due at, the rate achieved: the lower of the sends'
    and the first tokens' per second). Against the arrivals' own rate, not the nominal one: a
    few hundred Poisson arrivals are a few per cent off it by chance. A target that queues
    spreads its first tokens beyond the arrivals."""
    due = _per_s([r.due for r in measured])
    sent = _per_s([r.start for r in measured])
    first = _per_s([r.first for r in measured])
    return due, (None if sent is None or first is None else min(sent, first))


def step_summary(seg: Segment, max_tokens: int, has_router: bool) -> dict[str, Any]:
    """One step's numbers: `summarize`'s (TTFT, errors, CPU) and the open loop's own (the
    achieved rate, the client's lag, the load core's use)."""
    out = summarize(
        seg.records,
        max_tokens=max_tokens,
        wall_s=seg.secs,
        window_s=seg.window,
        router_cpu_s=seg.router_cpu if has_router else None,
        client_cpu_s=seg.client_cpu,
        worker_cpu_s=seg.worker_cpu,
    )
    measured = [r for r in seg.records if not r.warmup]
    lags = [lag for r in measured if (lag := r.lag) is not None]
    due, achieved = _achieved(measured)
    out["due_rps"] = None if due is None else round(due, 1)
    out["achieved_rps"] = None if achieved is None else round(achieved, 1)
    out["achieved_fraction"] = None if not due or achieved is None else round(achieved / due, 4)
    out["lag_ms"] = {f"p{q}": _ms(percentile(lags, q)) for q in (50, 99)}
    # The client and the workers share the load core: near 1, they are the bottleneck.
    out["load_core_util"] = round((seg.client_cpu + seg.worker_cpu) / seg.secs, 3)
    out["loadavg_1m"] = round(seg.loadavg, 2)
    return out


def _ok(s: dict[str, Any], ns: argparse.Namespace) -> bool:
    achieved = s["achieved_fraction"]
    return (
        s["requests"] > 0
        and s["complete"] == s["requests"]
        and achieved is not None
        and achieved >= ns.min_achieved
    )


def _lagging(s: dict[str, Any], ns: argparse.Namespace) -> bool:
    lag = s["lag_ms"]["p99"]
    return lag is None or lag > ns.max_lag_ms


@dataclass(slots=True)
class _Bench:
    """The running workers and routers, and the baseline's steps by (answer tokens, rate)."""

    ns: argparse.Namespace
    workers: Workers
    routers: dict[str, StartedRouter]
    baseline: dict[tuple[int, float], dict[str, Any]] = field(default_factory=dict)

    def spec(self, addr: tuple[str, int] | None, tokens: int) -> LoadSpec:
        ns = self.ns
        return LoadSpec(
            1,
            1,
            target=addr,
            prefill=(HOST, self.workers.prefill_port),
            decode=(HOST, self.workers.decode_port),
            model=ns.model,
            max_tokens=tokens,
            chat=ns.chat,
            request_timeout_s=ns.request_timeout_s,
        )

    async def one(self, name: str, tokens: int, rate: float) -> dict[str, Any]:
        """One step of `name` (or "baseline") at `rate`."""
        ns = self.ns
        started = self.routers.get(name)
        proc = started.proc if started else None
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} died:\n{proc.tail()}")
        warm = max(1, round(rate * ns.warmup_s))
        n = warm + max(ns.step_requests, math.ceil(rate * ns.step_s))
        offsets = arrival_offsets(rate, n, seed=ns.seed, poisson=ns.arrivals == "poisson")
        spec = self.spec(started.addr if started else None, tokens)
        seg = await measure(
            spec, proc, self.workers, load=lambda: run_arrivals(spec, offsets, warmup=warm)
        )
        await asyncio.sleep(ns.pause_s)  # what the step left in flight settles
        out = step_summary(seg, tokens, proc is not None)
        out.update(target=name, max_tokens=tokens, offered_rps=rate)
        return out

    async def base(self, tokens: int, rate: float) -> dict[str, Any]:
        key = (tokens, rate)
        if key not in self.baseline:
            self.baseline[key] = await self.one("baseline", tokens, rate)
            _progress(self.baseline[key], None)
        return self.baseline[key]

    async def probe(self, name: str, tokens: int, rate: float) -> Step:
        """`name`'s step at `rate`: up to `--tries` tries, their majority decides."""
        step = await majority(functools.partial(self.try_once, name, tokens, rate), self.ns.tries)
        note(f"[sustain] {name:>11} offered={rate}: {vote_text(step)}", sys.stderr)
        return step

    async def try_once(self, name: str, tokens: int, rate: float) -> Step:
        """One try of `name` at `rate` against the baseline's one step there."""
        ns = self.ns
        base = await self.base(tokens, rate)
        if not _ok(base, ns) or _lagging(base, ns):
            step = Step(rate, CLIENT, {"baseline": base, "why": "the baseline cannot do it"})
            _progress_step(name, step)
            return step
        got = await self.one(name, tokens, rate)
        b50, b99 = base["ttft_ms"]["p50"], base["ttft_ms"]["p99"]
        t50, t99 = got["ttft_ms"]["p50"], got["ttft_ms"]["p99"]
        added = {
            "p50": None if t50 is None or b50 is None else round(t50 - b50, 3),
            "p99": None if t99 is None or b99 is None else round(t99 - b99, 3),
        }
        detail: dict[str, Any] = {"run": got, "baseline": base, "added_ttft_ms": added}
        # The baseline showed that the client can offer this rate (with more work per answer:
        # two calls and two connections): when the target's step fails, what the client did
        # late is what the target made it do (a pool of connections grown while it stalled).
        if not _ok(got, ns):
            verdict, detail["why"] = FAIL, "errors or below the offered rate"
        elif added["p99"] is None or added["p99"] > ns.added_p99_ms:
            verdict, detail["why"] = FAIL, "added TTFT p99"
        elif _lagging(got, ns):
            verdict, detail["why"] = CLIENT, "passed, but the client sent late"
        else:
            verdict = PASS
        step = Step(rate, verdict, detail)
        _progress(got, step)
        return step


def _progress(s: dict[str, Any], step: Step | None) -> None:
    verdict = "" if step is None else f" -> {step.verdict}"
    added = "" if step is None else f" added p99={step.detail['added_ttft_ms']['p99']}"
    note(
        f"[sustain] {s['target']:>11} tokens={s['max_tokens']:<4} offered={s['offered_rps']:<7} "
        f"achieved={s['achieved_rps']} ({s['achieved_fraction']}) "
        f"ok={s['complete']}/{s['requests']} "
        f"ttft p50={s['ttft_ms']['p50']} p99={s['ttft_ms']['p99']}{added} "
        f"lag p99={s['lag_ms']['p99']} router util={s['router_cpu_util']} "
        f"ms/req={s['cpu_ms_per_request']} load core={s['load_core_util']} "
        f"loadavg={s['loadavg_1m']}{verdict}",
        sys.stderr,
    )


def _progress_step(name: str, step: Step) -> None:
    note(f"[sustain] {name:>11} offered={step.rate}: {step.detail.get('why')}", sys.stderr)


def _median_cpu_ms(step: Step) -> float | None:
    """The router CPU ms per request over the step's tries (their median), or None."""
    tried = step.detail.get("tries") or [step.detail]
    cpu = [c for t in tried if (c := (t.get("run") or {}).get("cpu_ms_per_request")) is not None]
    return round(statistics.median(cpu), 4) if cpu else None


def _step_row(step: Step) -> dict[str, Any]:
    d = step.detail
    run_ = d.get("run") or {}
    return {
        "rate": step.rate,
        "verdict": step.verdict,
        "votes": vote_text(step),
        "tries": [
            {k: t.get(k) for k in ("verdict", "why", "added_ttft_ms")}
            | {"router_cpu_ms_per_request": (t.get("run") or {}).get("cpu_ms_per_request")}
            for t in d.get("tries", [])
        ],
        "why": d.get("why"),
        "added_ttft_ms": d.get("added_ttft_ms"),
        "achieved_rps": run_.get("achieved_rps"),
        "achieved_fraction": run_.get("achieved_fraction"),
        "errors": run_.get("errors"),
        "lag_p99_ms": run_.get("lag_ms", {}).get("p99"),
        "baseline_achieved_fraction": d["baseline"]["achieved_fraction"],
        "baseline_lag_p99_ms": d["baseline"]["lag_ms"]["p99"],
    }


def _result_row(name: str, tokens: int, found: dict[str, Any]) -> dict[str, Any]:
    step: Step | None = found["step"]
    # The first step that did not pass: where the ladder turned (with one try, on one spike).
    failing = next((s for s in found["steps"] if s.verdict != PASS), None)
    row: dict[str, Any] = {
        "target": name,
        "max_tokens": tokens,
        "sustained_rps": found["sustained"],
        "limited_by": found["limited_by"],
        "first_failing": None
        if failing is None
        else {"rate": failing.rate, "verdict": failing.verdict, "votes": vote_text(failing)},
        "steps": [_step_row(s) for s in found["steps"]],
    }
    if step is not None:
        run_, base = step.detail["run"], step.detail["baseline"]
        row.update(
            added_ttft_ms=step.detail["added_ttft_ms"],
            ttft_ms=run_["ttft_ms"],
            baseline_ttft_ms=base["ttft_ms"],
            sustained_votes=vote_text(step),
            achieved_rps=run_["achieved_rps"],
            router_cpu_ms_per_request=_median_cpu_ms(step),
            router_cpu_util=run_["router_cpu_util"],
            client_lag_ms=run_["lag_ms"],
            load_core_util=run_["load_core_util"],
            requests=run_["requests"],
            loadavg_1m=run_["loadavg_1m"],
        )
    return row


def add_ratios(rows: list[dict[str, Any]], peer: str = "vllm") -> None:
    """Each of our rows gets `ratio_vs_<peer>`: its sustained rate over the peer's at the same
    answer length, and `ratio_bound` when either is only a lower bound (the load generator
    limited it): "<=" when the peer's is, ">=" when ours is, "?" when both are."""
    peers = {r["max_tokens"]: r for r in rows if r["target"] == peer}
    for r in rows:
        p = peers.get(r["max_tokens"])
        if r["target"] == peer or p is None:
            continue
        if not r["sustained_rps"] or not p["sustained_rps"]:
            r[f"ratio_vs_{peer}"] = None
            continue
        r[f"ratio_vs_{peer}"] = round(r["sustained_rps"] / p["sustained_rps"], 3)
        ours_low = r["limited_by"] in ("load generator", "max rate")
        peer_low = p["limited_by"] in ("load generator", "max rate")
        r["ratio_bound"] = {
            (False, False): "=",
            (False, True): "<=",
            (True, False): ">=",
            (True, True): "?",
        }[(ours_low, peer_low)]


async def run(ns: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    async with redis_for_run(ns, log_dir):
        return await _run(ns, log_dir)


async def _run(ns: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": {k: v for k, v in vars(ns).items() if not k.endswith("_")},
        "command": " ".join(["python -m disagg_tools.overhead.saturation", *ns.argv_]),
        "machine": machine_notes(ns),
        "sustained": [],
        "router_commands": {},
        "log_dir": str(log_dir),
    }
    t0 = time.monotonic()
    # SIGTERM cancels the run (every process it started is stopped on the way out): raised as
    # KeyboardInterrupt instead, it would land in a protocol callback, where uvloop reports it
    # as a transport's fatal error and goes on.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    targets = [t for t in ns.targets if t != "baseline"]
    workers = await start_workers(ns, log_dir, ns.interval_ms, "sustain")
    bench = _Bench(ns, workers, {})
    try:
        for name in targets:
            bench.routers[name] = await start_router(name, ns, workers, log_dir, "sustain")
            result["router_commands"][name] = bench.routers[name].command
        for tokens in ns.tokens:
            for name in targets:
                found = await find_sustained(
                    functools.partial(bench.probe, name, tokens),
                    start=ns.start_rps,
                    factor=ns.factor,
                    bisect=ns.bisect,
                    min_rate=ns.min_rps,
                    max_rate=ns.max_rps,
                )
                row = _result_row(name, tokens, found)
                result["sustained"].append(row)
                note(
                    f"[sustain] {name} tokens={tokens}: {row['sustained_rps']} req/s "
                    f"(limited by {row['limited_by']})",
                    sys.stderr,
                )
    finally:
        for started in bench.routers.values():
            started.proc.stop()
        workers.stop()
    add_ratios(result["sustained"])
    result["baseline_steps"] = list(bench.baseline.values())
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    return result


def _f(x: Any, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _redis_note(params: dict[str, Any]) -> str:
    if params.get("private_redis"):
        return "the run's own, on the load core"
    return f"{params.get('redis_url', '?')}, unpinned"


def markdown(result: dict[str, Any]) -> str:
    p = result["params"]
    m = result["machine"]
    lines = [
        f"#### Sustained rate at TTFT p99 ≤ {p['added_p99_ms']:g} ms added (issue 36)",
        "",
        f"Open-loop {p['arrivals']} arrivals of streaming "
        f"{'chat ' if p['chat'] else ''}completions, a token every {p['interval_ms']:g} ms, "
        f"steps of max({p['step_requests']} answers, {p['step_s']:g} s) after "
        f"{p['warmup_s']:g} s of warm-up, each step up to {p.get('tries', 1)} tries "
        f"(their majority decides); Redis: {_redis_note(p)}; load average "
        f"{m['loadavg_at_start'][0]:.2f} at the "
        f"start, {m['loadavg_at_end'][0]:.2f} at the end; {result['elapsed_s']:.0f} s.",
        "",
        "| answer tokens | target | sustained req/s | limited by | added TTFT p50 / p99 ms "
        "| router CPU ms/req | client lag p99 ms | load core | tries: sustained · first failing "
        "| vs vllm-router |",
        "|---:|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["sustained"]:
        added = r.get("added_ttft_ms") or {}
        ratio = r.get("ratio_vs_vllm")
        bound = r.get("ratio_bound", "=")
        vs = "—" if ratio is None else f"{'' if bound == '=' else bound + ' '}{ratio:.2f} ×"
        rps = r["sustained_rps"]
        shown = "—" if rps is None else f"{'≥ ' if r['limited_by'] != 'router' else ''}{rps:g}"
        lag = (r.get("client_lag_ms") or {}).get("p99")
        at = f"{ff['votes']} at {ff['rate']:g}" if (ff := r.get("first_failing")) else "—"
        tries = f"{r.get('sustained_votes') or '—'} · {at}"  # "2/3 pass · 2/2 fail at 400"
        lines.append(
            f"| {r['max_tokens']} | {r['target']} | {shown} | {r['limited_by']} "
            f"| {_f(added.get('p50'))} / {_f(added.get('p99'))} "
            f"| {_f(r.get('router_cpu_ms_per_request'), 3)} | {_f(lag, 2)} "
            f"| {_f(r.get('load_core_util'), 2)} | {tries} | {vs} |"
        )
    lines += [
        "",
        "limited by: router = the next rate up failed (the router's limit); load generator = "
        "the next rate could not be offered (the client lagged or the baseline failed): the "
        "rate is a lower bound and a ratio against it a bound too; load core = CPU of the "
        "client and the workers on their core (1 = all of it); tries: how the tries voted at the "
        "sustained rate and at the first failing one (router CPU ms/req: the median over the "
        "sustained rate's tries).",
    ]
    return "\n".join(lines) + "\n"


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead.saturation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_arguments(p)
    p.set_defaults(
        targets="ours_redis,ours_dropin,vllm", tokens=[16, 128], interval_ms=5.0, chat=True
    )
    p.add_argument(
        "--completions",
        dest="chat",
        action="store_false",
        help="/v1/completions (default: chat completions, as the issue asks)",
    )
    p.add_argument("--added-p99-ms", type=float, default=50.0, help="the TTFT p99 budget")
    p.add_argument("--start-rps", type=float, default=50.0, help="the ladder's first rate")
    p.add_argument("--factor", type=float, default=2.0, help="the ladder's step (x rate)")
    p.add_argument("--bisect", type=int, default=3, help="bisections after the ladder")
    p.add_argument(
        "--tries", type=_positive_int, default=3, help="at most, per step; a majority decides"
    )
    p.add_argument("--min-rps", type=float, default=5.0)
    p.add_argument("--max-rps", type=float, default=20_000.0)
    p.add_argument(
        "--step-requests", type=int, default=400, help="measured answers per step, at least"
    )
    p.add_argument("--step-s", type=float, default=5.0, help="measured seconds per step, at least")
    p.add_argument("--warmup-s", type=float, default=1.0, help="arrivals not measured per step")
    p.add_argument("--pause-s", type=float, default=0.5, help="quiet time after each step")
    p.add_argument("--arrivals", choices=("poisson", "even"), default="poisson")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument(
        "--min-achieved",
        type=float,
        default=0.95,
        help="a step needs this fraction of its arrivals' rate achieved (sends and first "
        "tokens per second)",
    )
    p.add_argument(
        "--max-lag-ms",
        type=float,
        default=10.0,
        help="the client's send lag p99 beyond which a step is the load generator's failure",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=10.0,
        help="an answer not done by then is an error (bounds an overloaded step)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parse(build_parser(), argv)
    if ns.nice:
        os.setpriority(os.PRIO_PROCESS, 0, ns.nice)
    if ns.rt_priority:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(ns.rt_priority))
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="bench-sustain-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with pinned(ns.load_core_), asyncio.Runner(loop_factory=uvrun.loop_factory()) as runner:
            result = runner.run(run(ns, log_dir))
    except asyncio.CancelledError:
        print("cancelled: every process it started is stopped", file=sys.stderr)
        return 143
    if ns.json_path:
        Path(ns.json_path).write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    if ns.markdown:
        path = Path(ns.markdown)
        existing = path.read_text() if path.exists() else None
        path.write_text(
            replace_between_markers(existing, md, "<!-- sustain:begin -->", "<!-- sustain:end -->")
        )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
