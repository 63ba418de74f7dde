"""Our router and sglang-router 0.3.2 in front of the same real SGLang prefill/decode pair
(SGLang 0.5.23 on CPU, mooncake_tcp; the engines of tests/real_sglang), measured in one run:
TTFT and ITL as the `openai` client sees them, requests interleaved between the two routers so
both meet the same engines in the same state. Not a test: docs/real-sglang.md has the figures.

    python scripts/sglang_side_by_side.py [--requests 40] [--concurrency 1,8] [--tokens 64]

Needs scripts/prepare_real_sglang.sh (the engines) and scripts/install_peers.sh (sglang-router).
Our router runs with Redis (as deployed) from a config that gives URLs and roles only."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg_tools.procs import Child, free_port  # noqa: E402
from tests.real_sglang.conftest import (  # noqa: E402
    MAX_TOTAL_TOKENS,
    SERVED,
    START_TIMEOUT_S,
    SglangServer,
    missing_reason,
    unique_prompt,
)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _stream(client: AsyncOpenAI, tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one greedy streamed completion, EOS ignored."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    stream = await client.completions.create(
        model=SERVED,
        prompt=unique_prompt(40),
        max_tokens=tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for piece in stream:
        if any(c.text for c in piece.choices):
            stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("an empty answer")
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


async def _wait(url: str, proc: Child, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        while True:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            try:
                await _stream(c, 2)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)


async def run(ns: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="sglang-side-by-side-"))
    prefill = SglangServer("p0", "prefill", workdir)
    decode = SglangServer("d0", "decode", workdir)
    routers: dict[str, Child] = {}
    try:
        for s in (prefill, decode):
            s.start()
        for s in (prefill, decode):
            s.wait_ready(time.monotonic() + START_TIMEOUT_S)
        ours_port, peer_port = free_port(), free_port()
        config = workdir / "ours.yaml"
        config.write_text(
            f"model: {SERVED}\n"
            "perf: {model: tiny-llama, gpu: h100, block_size: 1}\n"
            f"redis_url: {ns.redis_url}\n"
            f'key_prefix: "sglang-side-by-side-{ours_port}:"\n'
            "workers:\n"
            f"  - {{id: p0, url: {prefill.url}, role: prefill, adapter: sglang}}\n"
            f"  - {{id: d0, url: {decode.url}, role: decode, adapter: sglang, "
            f"kv_blocks: {MAX_TOTAL_TOKENS}}}\n"
        )
        routers["ours"] = Child(
            "ours",
            [
                sys.executable,
                "-m",
                "router.edge.serve_cli",
                "--log-level",
                "WARNING",
                "serve",
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(ours_port),
            ],
            log_dir=workdir,
        )
        routers["sglang-router"] = Child(
            "sglang-router",
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--pd-disaggregation",
                "--prefill",
                prefill.url,
                str(prefill.bootstrap_port),
                "--decode",
                decode.url,
                "--host",
                "127.0.0.1",
                "--port",
                str(peer_port),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ],
            log_dir=workdir,
            env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"},
        )
        urls = {
            "ours": f"http://127.0.0.1:{ours_port}",
            "sglang-router": f"http://127.0.0.1:{peer_port}",
        }
        for name, proc in routers.items():
            await _wait(urls[name], proc)
        clients = {
            name: AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
            for name, url in urls.items()
        }
        print("| concurrency | router | TTFT p50 / p90 ms | ITL p50 / p90 ms | answers |")
        print("|---:|---|---:|---:|---:|")
        for conc in ns.concurrency:
            ttft: dict[str, list[float]] = {n: [] for n in clients}
            itl: dict[str, list[float]] = {n: [] for n in clients}
            for _round in range(max(1, ns.requests // conc)):
                for name, client in clients.items():  # interleaved: the same engines' state
                    got = await asyncio.gather(*(_stream(client, ns.tokens) for _ in range(conc)))
                    for first, gaps in got:
                        ttft[name].append(first * 1e3)
                        itl[name] += [g * 1e3 for g in gaps]
            for name in clients:
                t, i = ttft[name], itl[name]
                print(
                    f"| {conc} | {name} | {statistics.median(t):.1f} / {_pct(t, 0.9):.1f} "
                    f"| {statistics.median(i):.2f} / {_pct(i, 0.9):.2f} | {len(t)} |"
                )
        for client in clients.values():
            await client.close()
    finally:
        for proc in routers.values():
            proc.stop()
        for s in (prefill, decode):
            s.stop()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=40, help="answers per router per concurrency")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ns = p.parse_args()
    ns.concurrency = [int(c) for c in ns.concurrency.split(",")]
    reason = missing_reason()
    if reason is not None:
        print(f"real SGLang: {reason}", file=sys.stderr)
        return 2
    asyncio.run(run(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
