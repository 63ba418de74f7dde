"""Data-parallel ranks, per rank against per URL (issue 35).

    python -m disagg_tools.launcher.dp_bench [--rate R --duration-s S ...] [--out FILE]


Two simulated decode servers of `--ranks` engines each (disagg_tools/sim/dp_front.py), plain
simulated prefill workers, and the router in this process, twice over the same arrivals:

    per-rank  each entry `dp_size: N`: N targets with their own `kv_blocks` (the engine's), the
              rank told to the server (X-data-parallel-rank)
    per-URL   each entry one target with the ranks' blocks summed; the server's own balancer
              (round robin, as a DP engine without a rank given) picks the rank

A skewed load: Poisson arrivals, `--long-share` of the answers long, the rest short. Reported
per mode: TTFT p50/p99, ITL p99, goodput (answers exact and within the SLOs, per second), the
simulated engines' preemptions (a rank whose KV ran out) and requests per rank, and the requests
the router sent to a rank whose breaker was open (`breaker_open` refusals: the legs refuse
those before sending). Times are real seconds at `--time-scale` (the SLOs are given in
simulated seconds and divided by it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from disagg_tools.loadgen.loadclient import (
    LoadRequest,
    Result,
    make_request,
    new_session,
    percentiles,
    send,
)
from disagg_tools.sim.dp_front import running_dp_worker
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import settings_from_mapping
from router.edge.app import create_app
from router.edge.server import serving

__all__ = ["DpBenchSpec", "main", "run"]

MODEL = "llama-3-8b"


@dataclass(frozen=True, slots=True)
class DpBenchSpec:
    decode_workers: int = 2
    ranks: int = 4
    blocks_per_rank: int = 128
    prefill_workers: int = 2
    rate: float = 6.0  # arrivals per real second
    duration_s: float = 30.0
    time_scale: float = 4.0
    prompt_tokens: int = 200
    long_share: float = 0.2
    long_tokens: int = 400
    short_tokens: int = 32
    ttft_slo_sim_s: float = 2.0
    itl_slo_sim_s: float = 0.1
    seed: int = 1


def _arrivals(spec: DpBenchSpec) -> list[tuple[float, LoadRequest]]:
    rng = random.Random(spec.seed)
    out: list[tuple[float, LoadRequest]] = []
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.duration_s:
            return out
        tokens = spec.long_tokens if rng.random() < spec.long_share else spec.short_tokens
        req = make_request(i, model=MODEL, prompt_tokens=spec.prompt_tokens, output_tokens=tokens)
        out.append((t, req))
        i += 1


def _config(spec: DpBenchSpec, role: str, wid: str, blocks: int) -> WorkerConfig:
    return WorkerConfig(
        role=role,
        worker_id=wid,
        model=MODEL,
        kv_blocks=blocks,
        time_scale=spec.time_scale,
        kv_lease_s=30.0 * spec.time_scale,
    )


@contextlib.asynccontextmanager
async def _cluster(spec: DpBenchSpec, per_rank: bool) -> AsyncIterator[tuple[str, dict[str, str]]]:
    async with contextlib.AsyncExitStack() as stack:
        entries: list[dict[str, Any]] = []
        decode: dict[str, str] = {}
        for i in range(spec.prefill_workers):
            url = await stack.enter_async_context(
                running_worker(_config(spec, "prefill", f"p{i}", 1 << 16))
            )
            entries.append({"id": f"p{i}", "url": url, "role": "prefill", "adapter": "sim"})
        for i in range(spec.decode_workers):
            cfg = _config(spec, "decode", f"d{i}", spec.blocks_per_rank)
            url = decode[f"d{i}"] = await stack.enter_async_context(
                running_dp_worker(cfg, spec.ranks)
            )
            entry: dict[str, Any] = {"id": f"d{i}", "url": url, "role": "decode", "adapter": "sim"}
            if per_rank:
                entry |= {"dp_size": spec.ranks, "kv_blocks": spec.blocks_per_rank}
            else:  # the URL as one pool: its ranks' blocks summed
                entry["kv_blocks"] = spec.blocks_per_rank * spec.ranks
            entries.append(entry)
        settings = settings_from_mapping(
            {
                "model": MODEL,
                "perf": {"model": MODEL, "gpu": "h100"},
                "workers": entries,
                "loops": {"health_interval_s": 0.5, "state_refresh_s": 0.05},
            }
        )
        app = create_app(settings)
        runner = await stack.enter_async_context(serving(app, "127.0.0.1", 0, settings.timeouts))
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", decode


async def _json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        return await resp.json()


async def _breaker_refusals(session: aiohttp.ClientSession, router: str) -> float:
    async with session.get(router + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("disagg_router_upstream_errors_total") and 'kind="breaker_open"' in line
    )


def _summary(spec: DpBenchSpec, results: list[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.outcome == "ok"]
    ttft_slo = spec.ttft_slo_sim_s / spec.time_scale
    itl_slo = spec.itl_slo_sim_s / spec.time_scale
    itls = [gap for r in ok for gap in r.itl_s]

    def good(r: Result) -> bool:
        mean_itl = sum(r.itl_s) / len(r.itl_s) if len(r.itl_s) else 0.0
        return r.ttft_s is not None and r.ttft_s <= ttft_slo and mean_itl <= itl_slo

    return {
        "requests": len(results),
        "ok": len(ok),
        "not_ok": {o: sum(r.outcome == o for r in results) for o in {r.outcome for r in results}}
        if len(ok) < len(results)
        else {},
        "examples": sorted({r.detail[:200] for r in results if r.outcome != "ok"})[:3],
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None], (50, 99)),
        "itl_s": percentiles(itls, (50, 99)),
        "goodput_rps": sum(good(r) for r in ok) / wall_s,
        "slo_attainment": sum(good(r) for r in ok) / max(1, len(results)),
    }


async def run_mode(spec: DpBenchSpec, per_rank: bool) -> dict[str, Any]:
    arrivals = _arrivals(spec)
    async with _cluster(spec, per_rank) as (router, decode), new_session(512) as session:
        await asyncio.sleep(1.0)  # the first health probes
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(at: float, req: LoadRequest) -> Result:
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            return await send(session, router, req, deadline_s=300.0)

        results = await asyncio.gather(*(one(at, req) for at, req in arrivals))
        wall = loop.time() - start
        preemptions, per_rank_requests = 0, {}
        for wid, url in decode.items():
            state = await _json(session, url + "/sim/state")
            for rank, rs in enumerate(state["ranks"]):
                preemptions += rs["counters"].get("preemptions", 0)
                per_rank_requests[f"{wid}@{rank}"] = sum(
                    n for k, n in rs["counters"].items() if k.startswith("request_success")
                )
        out = _summary(spec, results, wall)
        out |= {
            "mode": "per-rank" if per_rank else "per-URL",
            "preemptions": preemptions,
            "requests_per_rank": per_rank_requests,
            "sent_to_an_open_breaker": 0,  # the legs refuse them: counted as breaker_open
            "breaker_open_refusals": await _breaker_refusals(session, router),
        }
        return out


async def run(spec: DpBenchSpec) -> list[dict[str, Any]]:
    return [await run_mode(spec, per_rank) for per_rank in (True, False)]


def format_rows(spec: DpBenchSpec, rows: list[dict[str, Any]]) -> str:
    head = (
        f"{spec.decode_workers} decode servers x {spec.ranks} ranks ({spec.blocks_per_rank} "
        f"blocks each), {spec.prefill_workers} prefill; {spec.rate}/s for {spec.duration_s} s, "
        f"{spec.long_share:.0%} of answers {spec.long_tokens} tokens, else {spec.short_tokens}; "
        f"time scale {spec.time_scale}"
    )
    lines = [
        head,
        "",
        "| placement | requests | exact | TTFT p50 | TTFT p99 | ITL p99 | goodput (req/s) | "
        "SLO attainment | preemptions | busiest / idlest rank |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        counts = list(r["requests_per_rank"].values())
        lines.append(
            f"| {r['mode']} | {r['requests']} | {r['ok']} | {r['ttft_s']['p50']:.3f} s | "
            f"{r['ttft_s']['p99']:.3f} s | {r['itl_s']['p99'] * 1000:.1f} ms | "
            f"{r['goodput_rps']:.2f} | {r['slo_attainment']:.1%} | {r['preemptions']} | "
            f"{max(counts)} / {min(counts)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg_tools.launcher.dp_bench")
    d = DpBenchSpec()
    for name in DpBenchSpec.__dataclass_fields__:
        default = getattr(d, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ns = parser.parse_args(argv)
    spec = DpBenchSpec(**{k: getattr(ns, k) for k in DpBenchSpec.__dataclass_fields__})
    rows = asyncio.run(run(spec))
    print(format_rows(spec, rows))
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps({"spec": asdict(spec), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
