"""A soak with faults: trace traffic for M minutes while workers, Redis and clients fail.

    python -m disagg_tools.loadgen.soak --minutes 10 [--speed 1] [--time-scale 2]
                         [--error-rate 0.03] [--lease-s 6] [--json FILE] [--keep-logs]

The Azure conversation trace (disagg_tools/traces.py) is replayed open loop against one router
with 2 prefill + 2 decode simulated workers and a PRIVATE redis-server, `--speed` trace seconds per
wall second (the workers run `--time-scale` times faster than the GPUs they model; output
lengths are the trace's, capped at `--max-output-tokens`, sent as X-Sim-Output-Tokens so every
answer is known in advance). Meanwhile:

    error rate     every worker answers `--error-rate` of its generation requests with an error
                   before the first byte (500 on p0 and d0, 503 on p1, malformed JSON on d1)
    worker kills   every `--kill-every-s` (60 s; a fifth of the run when shorter than 5 min) one
                   worker, alternately prefill and decode, is SIGKILLed and restarted
                   `--worker-down-s` later
    Redis crash    once, at 45 % of the run, the private Redis is SIGKILLed and restarted EMPTY
    vanishing      `--vanish` of the streaming clients close their connection mid-stream
    non-streaming  `--non-stream` of the requests ask for a whole answer

The router runs with short leases (`--lease-s`, 6 s: leases.reservation_s and leases.kv_s, the
workers' KV lease the same in real seconds), TTFT/idle deadlines of 30/10 s and an admission
wait of at most 10 s, so that every request ends within its client deadline (`--deadline-s`).

Invariants (exit 1 when one fails):
    requests      every request ends ok (exact text) or cleanly: 429/503 with Retry-After and an
                  OpenAI JSON body, or an SSE error frame then [DONE]; nothing else, no 500
    recovery      after each fault, a request sent after it completes ok within
                  `--recovery-s` (default 2 lease periods + 10 s)
    quiet         0 reservations and 0 stranded entries (router view and Redis) within one
                  lease period + 5 s after the traffic stops
    retries       in every ~10 s window: retries <= budget_ratio x requests (that window and
                  the one before) + budget_min_per_s x 20 s; in total <= 2 x requests
    memory        router RSS flat after warm-up: max of the last third of the samples
                  <= max of the first third x 1.2 + 20 MB (sampled every second)
    router        the router process stays alive and counts no 500
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from disagg_tools.loadgen.entry import git_commit, raise_nofile, run_and_report
from disagg_tools.loadgen.load_cluster import Cluster, ClusterSpec
from disagg_tools.loadgen.loadclient import (
    CLEAN,
    Result,
    failure_examples,
    failure_kinds,
    make_request,
    new_session,
    outcome_counts,
    percentiles,
    send,
)
from disagg_tools.loadgen.probes import RssSampler, metric_sums, wait_quiet
from disagg_tools.traces import TRACE_DIR, TraceRequest, load_trace, prompt_text

__all__ = ["DEFAULT_TRACE", "SoakSpec", "build_parser", "main", "run", "format_report"]

MODEL = "llama-3-8b"
TRACE_NAME = "AzureLLMInferenceTrace_conv.csv"


def default_trace() -> Path:
    """The Azure conversation trace in `disagg_tools.traces.TRACE_DIR` (../shared/traces
    beside the repository), else in ../shared/traces beside the cwd (an installed copy run
    from a checkout)."""
    for where in (TRACE_DIR, Path.cwd().parent / "shared" / "traces"):
        if (where / TRACE_NAME).is_file():
            return where / TRACE_NAME
    return TRACE_DIR / TRACE_NAME


DEFAULT_TRACE = default_trace()
_ERROR_STATUS = {"p0": "500", "d0": "500", "p1": "503", "d1": "malformed"}
_KILL_ORDER = ("p0", "d0", "p1", "d1")


@dataclass(frozen=True, slots=True)
class SoakSpec:
    minutes: float = 10.0
    trace: Path = DEFAULT_TRACE
    trace_start: int = 0
    speed: float = 1.0  # trace seconds per wall second
    time_scale: float = 2.0  # simulated seconds per real second, in the workers
    max_output_tokens: int = 128
    max_prompt_tokens: int = 2048
    error_rate: float = 0.03
    kill_every_s: float | None = None  # None: 60 s, or a fifth of a run shorter than 5 min
    worker_down_s: float = 2.0
    redis_at: float = 0.45  # fraction of the run
    redis_down_s: float = 1.0
    vanish: float = 0.03
    non_stream: float = 0.15
    lease_s: float = 6.0
    deadline_s: float = 60.0
    recovery_s: float | None = None  # None: 2 lease periods + 10 s
    quiet_s: float | None = None  # None: one lease period + 5 s
    seed: int = 0

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def kill_period_s(self) -> float:
        if self.kill_every_s is not None:
            return self.kill_every_s
        return 60.0 if self.duration_s >= 300 else self.duration_s / 5

    @property
    def recovery_bound_s(self) -> float:
        return self.recovery_s if self.recovery_s is not None else 2 * self.lease_s + 10.0

    def cluster(self) -> ClusterSpec:
        worker_args = {
            wid: [
                "--fault-error-rate",
                str(self.error_rate),
                "--fault-error-status",
                status,
                "--fault-seed",
                str(self.seed + i),
            ]
            for i, (wid, status) in enumerate(_ERROR_STATUS.items())
        }
        router = {
            "leases": {"reservation_s": self.lease_s, "kv_s": self.lease_s},
            "timeouts": {"ttft_s": 30.0, "idle_s": 10.0, "prefill_s": 30.0},
            "admission": {"max_wait_s": 10.0},
            "loops": {"health_interval_s": 0.5},
        }
        return ClusterSpec(
            n_prefill=2,
            n_decode=2,
            time_scale=self.time_scale,
            redis="private",
            worker_kv_lease_s=self.lease_s,
            router=router,
            worker_args=worker_args,
        )


@dataclass(slots=True)
class Fault:
    t: float  # seconds since the traffic started
    what: str
    recovery_from: bool = False  # measure recovery from this moment
    recovered_after_s: float | None = None

    def line(self) -> str:
        rec = ""
        if self.recovery_from:
            rec = (
                "  (not recovered)"
                if self.recovered_after_s is None
                else f"  (an ok answer {self.recovered_after_s:.1f} s later)"
            )
        return f"  t=+{self.t:7.1f}s  {self.what}{rec}"


@dataclass(slots=True)
class _Run:
    spec: SoakSpec
    cluster: Cluster
    session: aiohttp.ClientSession
    t0: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    metrics: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    router_deaths: int = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, what: str, *, recovery: bool = False) -> None:
        self.faults.append(Fault(self.now(), what, recovery))

    # -- traffic ----------------------------------------------------------------------------
    def trace(self) -> list[TraceRequest]:
        s = self.spec
        # The trace's own rate: enough rows for the run at `speed`, plus a margin.
        need = int(s.duration_s * s.speed * 6) + 100
        return load_trace(s.trace, start=s.trace_start, limit=need)

    async def traffic(self) -> None:
        s = self.spec
        rng = random.Random(s.seed)
        tasks: list[asyncio.Task[None]] = []
        for tr in self.trace():
            at = tr.arrival_s / s.speed
            if at >= s.duration_s:
                break
            out = max(1, min(tr.output_tokens, s.max_output_tokens))
            capped = replace(tr, prompt_tokens=max(1, min(tr.prompt_tokens, s.max_prompt_tokens)))
            stream = rng.random() >= s.non_stream
            req = make_request(
                tr.index,
                model=MODEL,
                prompt_tokens=capped.prompt_tokens,
                output_tokens=out,
                stream=stream,
                prompt=prompt_text(capped),
            )
            vanish = None
            if stream and out >= 3 and rng.random() < s.vanish:
                vanish = rng.randint(1, min(8, out - 1))
            delay = self.t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self.sent_at.append(self.now())
            tasks.append(asyncio.create_task(self.one(req, vanish)))
        if tasks:
            await asyncio.wait(tasks, timeout=s.deadline_s + 15)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def one(self, req: Any, vanish: int | None) -> None:
        res = await send(
            self.session,
            self.cluster.router_url,
            req,
            deadline_s=self.spec.deadline_s,
            vanish_after_tokens=vanish,
        )
        self.results.append(res)

    # -- faults -----------------------------------------------------------------------------
    async def faults_loop(self) -> None:
        s = self.spec
        self.log(
            f"error_rate {s.error_rate:.0%} on every worker "
            f"({', '.join(f'{w}: {st}' for w, st in _ERROR_STATUS.items())})"
        )
        events: list[tuple[float, str]] = []
        k = 1
        while k * s.kill_period_s < s.duration_s - s.worker_down_s - 1:
            events.append((k * s.kill_period_s, _KILL_ORDER[(k - 1) % len(_KILL_ORDER)]))
            k += 1
        # Midway between two kills, so each recovery is measured from one fault alone.
        redis_t = s.redis_at * s.duration_s
        events.append((redis_t, "redis"))
        events.sort()
        for at, target in events:
            await asyncio.sleep(max(0.0, self.t0 + at - time.perf_counter()))
            if target == "redis":
                await self.crash_redis()
            else:
                await self.crash_worker(target)

    async def crash_worker(self, wid: str) -> None:
        role = self.cluster.role(wid)
        self.cluster.workers[wid].kill()
        self.log(f"SIGKILL worker {wid} ({role})")
        await asyncio.sleep(self.spec.worker_down_s)
        await self.cluster.restart_worker(wid)
        self.log(f"worker {wid} restarted", recovery=True)

    async def crash_redis(self) -> None:
        redis = self.cluster.redis
        assert redis is not None
        redis.child.kill()
        self.log("SIGKILL redis")
        await asyncio.sleep(self.spec.redis_down_s)
        redis.child.start()
        await redis.ready()
        self.log("redis restarted EMPTY", recovery=True)

    # -- monitors ---------------------------------------------------------------------------
    async def metrics_loop(self) -> None:
        while True:
            try:
                self.metrics.append(
                    (self.now(), await metric_sums(self.session, self.cluster.router_url))
                )
            except (aiohttp.ClientError, TimeoutError):
                pass
            router = self.cluster.router
            if router is not None and not router.alive():
                self.router_deaths += 1
                self.log("the router process DIED")
                return
            await asyncio.sleep(2.0)


def _recoveries(faults: list[Fault], results: list[Result], t0: float) -> None:
    ok = sorted((r.t_send - t0, r.t_end - t0) for r in results if r.outcome == "ok")
    for f in faults:
        if f.recovery_from:
            after = [end for send_t, end in ok if send_t >= f.t]
            f.recovered_after_s = (min(after) - f.t) if after else None


def _retry_check(run: _Run, ratio: float, min_per_s: float) -> tuple[list[str], dict[str, Any]]:
    violations = []
    samples = run.metrics
    retries = [(t, m.get("disagg_router_retries_total", 0.0)) for t, m in samples]
    worst = 0.0
    for i, (ta, ra) in enumerate(retries):
        for tb, rb in retries[i + 1 :]:
            if tb - ta > 10.5:
                break
            sent = sum(1 for t in run.sent_at if ta - 10 <= t <= tb)
            allowed = ratio * sent + min_per_s * 20
            worst = max(worst, (rb - ra) / allowed if allowed else 0.0)
            if rb - ra > allowed:
                violations.append(
                    f"{rb - ra:.0f} retries in t=[{ta:.0f}, {tb:.0f}] s, budget "
                    f"allows {allowed:.0f}"
                )
    last = samples[-1][1] if samples else {}
    total = last.get("disagg_router_retries_total", 0.0)
    if total > 2 * len(run.sent_at):
        violations.append(f"{total:.0f} retries for {len(run.sent_at)} requests (max 2 each)")
    info = {
        "retries": total,
        "retry_budget_exhausted": last.get("disagg_router_retry_budget_exhausted_total", 0.0),
        "resumes": last.get("disagg_router_resumes_total", 0.0),
        "worst_window_budget_use": round(worst, 3),
        "upstream_errors": {
            k.removeprefix("disagg_router_upstream_errors_total"): v
            for k, v in last.items()
            if k.startswith("disagg_router_upstream_errors_total{")
        },
    }
    return violations[:5], info


def _rss_check(samples: list[tuple[float, int]]) -> tuple[list[str], dict[str, Any]]:
    if len(samples) < 9:
        return ["fewer than 9 RSS samples"], {}
    third = len(samples) // 3
    warm = max(r for _, r in samples[:third]) / 2**20
    last = max(r for _, r in samples[-third:]) / 2**20
    bound = warm * 1.2 + 20
    info = {
        "warmup_max_mb": round(warm, 1),
        "last_third_max_mb": round(last, 1),
        "bound_mb": round(bound, 1),
        "samples": len(samples),
    }
    return ([] if last <= bound else [f"RSS grew: {last:.1f} MB > {bound:.1f} MB"]), info


async def run(spec: SoakSpec, *, workdir: Path | None = None) -> dict[str, Any]:
    raise_nofile(8192)
    own_dir = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="bench-soak-"))
    cluster = Cluster(spec.cluster(), workdir)
    try:
        await cluster.start()
        router = cluster.router
        assert router is not None
        async with new_session(2048) as session:
            r = _Run(spec, cluster, session)
            rss = RssSampler(lambda: router.pid, period_s=1.0)
            r.t0 = time.perf_counter()
            rss.start()
            monitors = [asyncio.create_task(r.metrics_loop()), asyncio.create_task(r.faults_loop())]
            try:
                await r.traffic()
            finally:
                for task in monitors:
                    task.cancel()
                await asyncio.gather(*monitors, return_exceptions=True)
                await rss.stop()
            traffic_end = r.now()
            quiet_bound = spec.quiet_s if spec.quiet_s is not None else spec.lease_s + 5.0
            left, waited = await wait_quiet(
                session, cluster.router_url, cluster.redis_url, cluster.key_prefix, quiet_bound
            )
            try:
                r.metrics.append((r.now(), await metric_sums(session, cluster.router_url)))
            except (aiohttp.ClientError, TimeoutError):
                pass
        return _report(spec, r, rss.samples, left, waited, quiet_bound, traffic_end)
    finally:
        cluster.stop()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _report(
    spec: SoakSpec,
    r: _Run,
    rss: list[tuple[float, int]],
    left: Any,
    waited: float,
    quiet_bound: float,
    traffic_end: float,
) -> dict[str, Any]:
    _recoveries(r.faults, r.results, r.t0)
    counts = outcome_counts(r.results)
    lost = len(r.sent_at) - len(r.results)
    if lost:
        counts["hang"] = counts.get("hang", 0) + lost
    inv: dict[str, list[str]] = {}
    bad = {k: v for k, v in counts.items() if k not in CLEAN}
    inv["requests"] = [f"not clean: {bad}"] if bad else []
    inv["recovery"] = [
        f"{f.what} at t=+{f.t:.0f}s: "
        + (
            "no ok answer afterwards"
            if f.recovered_after_s is None
            else f"first ok answer {f.recovered_after_s:.1f} s later"
        )
        for f in r.faults
        if f.recovery_from
        and (f.recovered_after_s is None or f.recovered_after_s > spec.recovery_bound_s)
    ]
    inv["quiet"] = [] if left.clean else [f"after {waited:.1f} s: {left!r}"]
    retry_v, retry_info = _retry_check(r, 0.2, 10.0)
    inv["retries"] = retry_v
    rss_v, rss_info = _rss_check(rss)
    inv["memory"] = rss_v
    last = r.metrics[-1][1] if r.metrics else {}
    five_hundred = sum(
        v
        for k, v in last.items()
        if k.startswith("disagg_router_requests_total{") and 'status="500"' in k
    )
    inv["router"] = ([f"router process died {r.router_deaths}x"] if r.router_deaths else []) + (
        [f"router counted {five_hundred:.0f} responses with status 500"] if five_hundred else []
    )
    ok = [x for x in r.results if x.outcome == "ok"]
    examples = failure_examples(r.results, CLEAN)
    return {
        "minutes": spec.minutes,
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "spec": {
            "speed": spec.speed,
            "time_scale": spec.time_scale,
            "error_rate": spec.error_rate,
            "kill_every_s": spec.kill_period_s,
            "lease_s": spec.lease_s,
            "vanish": spec.vanish,
            "non_stream": spec.non_stream,
            "max_output_tokens": spec.max_output_tokens,
            "recovery_bound_s": spec.recovery_bound_s,
            "quiet_bound_s": quiet_bound,
        },
        "requests": len(r.sent_at),
        "outcomes": counts,
        "traffic_s": round(traffic_end, 1),
        "tokens_ok": sum(x.tokens for x in ok),
        "ttft_s": {
            k: None if v is None else round(v, 3)
            for k, v in percentiles([x.ttft_s for x in ok if x.ttft_s]).items()
        },
        "faults": [
            {
                "t": round(f.t, 1),
                "what": f.what,
                "recovered_after_s": None
                if f.recovered_after_s is None
                else round(f.recovered_after_s, 1),
            }
            for f in r.faults
        ],
        "fault_lines": [f.line() for f in r.faults],
        "retries": retry_info,
        "rss": rss_info,
        "leftovers": left.to_dict(),
        "quiet_wait_s": round(waited, 1),
        "failure_examples": examples,
        "failure_kinds": failure_kinds(r.results, CLEAN),
        "invariants": inv,
        "violations": [f"{k}: {v}" for k, vs in inv.items() for v in vs],
    }


def format_report(rep: dict[str, Any]) -> str:
    s = rep["spec"]
    lines = [
        f"disagg_tools.loadgen.soak {rep['minutes']} min commit={rep['commit']} speed={s['speed']} "
        f"time_scale={s['time_scale']} error_rate={s['error_rate']} kill_every={s['kill_every_s']}"
        f"s lease={s['lease_s']}s",
        f"  requests        {rep['requests']} over {rep['traffic_s']} s: {rep['outcomes']}",
        f"  ok tokens       {rep['tokens_ok']}, TTFT p50/p90/p99 s {rep['ttft_s']}",
        f"  retries         {rep['retries']}",
        f"  router RSS      {rep['rss']}",
        "  fault log",
        *rep["fault_lines"],
    ]
    for kind, count in rep.get("failure_kinds", {}).items():
        lines.append(f"  failures        {count:6d} x {kind}")
    for ex in rep["failure_examples"]:
        lines.append(f"  failure         {ex}")
    lines.append("  invariants")
    for name, vs in rep["invariants"].items():
        lines.append(f"    {name:<10} {'PASS' if not vs else 'FAIL'}")
        lines.extend(f"      - {v}" for v in vs)
    lines.append(
        "  RESULT          "
        + (
            "all invariants hold"
            if not rep["violations"]
            else f"{len(rep['violations'])} VIOLATION(S)"
        )
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    d = SoakSpec()
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.loadgen.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--trace", type=Path, default=d.trace)
    p.add_argument("--trace-start", type=int, default=0)
    p.add_argument("--speed", type=float, default=d.speed, help="trace seconds per wall second")
    p.add_argument("--time-scale", type=float, default=d.time_scale)
    p.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--error-rate", type=float, default=d.error_rate)
    p.add_argument("--kill-every-s", type=float, default=None)
    p.add_argument("--worker-down-s", type=float, default=d.worker_down_s)
    p.add_argument("--vanish", type=float, default=d.vanish)
    p.add_argument("--non-stream", type=float, default=d.non_stream)
    p.add_argument("--lease-s", type=float, default=d.lease_s)
    p.add_argument("--deadline-s", type=float, default=d.deadline_s)
    p.add_argument("--recovery-s", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--keep-logs", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    spec = SoakSpec(
        minutes=ns.minutes,
        trace=ns.trace,
        trace_start=ns.trace_start,
        speed=ns.speed,
        time_scale=ns.time_scale,
        max_output_tokens=ns.max_output_tokens,
        max_prompt_tokens=ns.max_prompt_tokens,
        error_rate=ns.error_rate,
        kill_every_s=ns.kill_every_s,
        worker_down_s=ns.worker_down_s,
        vanish=ns.vanish,
        non_stream=ns.non_stream,
        lease_s=ns.lease_s,
        deadline_s=ns.deadline_s,
        recovery_s=ns.recovery_s,
        seed=ns.seed,
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench-soak-")) if ns.keep_logs else None
    return run_and_report(
        run(spec, workdir=workdir), format_report, workdir=workdir, json_path=ns.json
    )


if __name__ == "__main__":
    sys.exit(main())
