"""A hostile engine's KV events against a live router (issue 31, item 4).

    python -m disagg_tools.overhead.kv_flood [--blocks 1500000] [--batch-blocks 1000]
        [--kv-blocks 25000] [--big-batch 300000] [--streams 8] [--out DIR]

`disagg-router serve --config` in front of two stand-in workers (disagg_tools/overhead/
fixed_worker.py, a token every `--interval-ms`), the decode worker's entry with `kv_blocks:
--kv-blocks` and a `kv_events` endpoint that this tool binds: an 'engine' in a child process
publishing on a real ZeroMQ PUB socket whatever the phase says. Meanwhile `--streams` streaming
completions run through the router the whole time. Measured:

- the router process's RSS (/proc) at the start of each phase, at its highest, and at its end;
- the streams' worst gap between two chunks, less the workers' interval (what the router held
  them), and its p99;
- what the router counted (`/metrics`: kv_events_refused_total, kv_events_index_drops_total,
  kv_events_batches_total, kv_events_index_blocks).

Phases, one after the other on the same router: `quiet` (the streams alone: the machine's own
noise), `control` (the engine builds and sends the flood's batches on a socket nobody
subscribes to: the same load on the machine, none on the router), `flood` (`--blocks` bogus
blocks in batches of `--batch-blocks`, distinct prompts of parent None, each named and indexed
until the bound drops the index), `oversized` (one batch of `--big-batch` blocks, ~16 MiB, then
one of 2.4 MiB: over the batch limit), `cleared` (an AllBlocksCleared: the index dropped, its
memory given back). `<out>/kv-flood.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import orjson
import zmq

from disagg_tools.overhead.targets import (
    fixed_worker_command,
    fresh_key_prefix,
    wait_listening,
)
from disagg_tools.procs import HOST, Child, free_port, process_rss_bytes

__all__ = ["main", "parse_args"]

BS = 16
_WORKER = "d0"


def _stored_batch(first: int, blocks: int) -> bytes:
    stored = {
        "type": "BlockStored",
        "block_hashes": [first + k for k in range(blocks)],
        "parent_block_hash": None,
        "token_ids": [(first + i) % 30_000 for i in range(blocks * BS)],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return bytes(msgpack.packb([time.time(), [stored], 0]))


_CLEARED = bytes(msgpack.packb([0.0, [{"type": "AllBlocksCleared"}], 0]))


def _engine(endpoint: str, phases: Any, done: Any) -> None:
    """The child: bind; for each plan read from `phases`, publish it (('stored', first,
    blocks) or ('cleared', 0, 0)), sequence numbers on from the last, then say so on `done`.
    Between plans, one 1-block batch every 0.5 s, so the router stays subscribed and a batch
    lost to a dropped connection shows up as a gap."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # nothing dropped on this side: the router's limits decide
    pub.bind(endpoint)
    void = ctx.socket(zmq.PUB)  # the control phase's: the same work, no subscriber
    void.bind_to_random_port("tcp://127.0.0.1")
    seq = 0

    def send(payload: bytes) -> None:
        nonlocal seq
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1

    while True:
        if phases.poll(0.5):
            plan = phases.recv()
            if plan is None:
                return
            for kind, first, blocks in plan:
                if kind == "void":
                    void.send_multipart([b"", b"\0" * 8, _stored_batch(first, blocks)])
                else:
                    send(_CLEARED if kind == "cleared" else _stored_batch(first, blocks))
            done.send(seq)
        else:
            send(_stored_batch(2**50 + seq, 1))


def router_config(kv_blocks: int, prefill_url: str, decode_url: str, kv: str, prefix: str) -> str:
    return "\n".join(
        [
            "model: llama-3-8b",
            "perf: {model: llama-3-8b, gpu: h100}",
            f'store: {{url: "redis://127.0.0.1:6379/0", key_prefix: "{prefix}"}}',
            "estimates: {estimator: max_tokens}",
            "workers:",
            f"  - {{id: p0, url: {prefill_url}, role: prefill, adapter: vllm}}",
            f"  - {{id: {_WORKER}, url: {decode_url}, role: decode, adapter: vllm, "
            f"kv_blocks: {kv_blocks}, kv_events: {{endpoint: '{kv}'}}}}",
            "",
        ]
    )


class Streams:
    """`n` streaming completions through the router, each started again when it ends; the
    gaps between chunks are kept per phase (`mark` starts a new one)."""

    def __init__(self, base_url: str, n: int, max_tokens: int) -> None:
        self.base_url, self.n, self.max_tokens = base_url, n, max_tokens
        self.gaps: list[float] = []
        self.errors = 0
        self._tasks: list[asyncio.Task[None]] = []

    def mark(self) -> list[float]:
        gaps, self.gaps = self.gaps, []
        return gaps

    async def _one(self, session: aiohttp.ClientSession) -> None:
        body = {"model": "llama-3-8b", "prompt": "flood " * 20, "max_tokens": self.max_tokens}
        while True:
            try:
                async with session.post(
                    f"{self.base_url}/v1/completions", json={**body, "stream": True}
                ) as resp:
                    last = None
                    async for _ in resp.content.iter_any():
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append(now - last)
                        last = now
            except (aiohttp.ClientError, OSError):
                self.errors += 1
                await asyncio.sleep(0.2)

    def start(self, session: aiohttp.ClientSession) -> None:
        self._tasks = [asyncio.create_task(self._one(session)) for _ in range(self.n)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The router's kv_events_* samples for the flooded worker, by name and reason."""
    async with session.get(f"{base_url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "_created" in line or f'worker="{_WORKER}"' not in line:
            continue
        if "kv_events_" in line:
            name, value = line.rsplit(" ", 1)
            name = name.split("kv_events_", 1)[1].replace(f'worker="{_WORKER}"', "")
            out[name.replace("{,", "{").replace(",}", "}").replace("{}", "")] = float(value)
    return out


async def _wait_answering(session: aiohttp.ClientSession, base_url: str, router: Child) -> None:
    body = {"model": "llama-3-8b", "prompt": "ready?", "max_tokens": 2}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not router.alive():
            raise RuntimeError(f"the router exited:\n{router.tail()}")
        try:
            async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, OSError):
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError(f"the router does not answer:\n{router.tail()}")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(ns: argparse.Namespace) -> dict[str, Any]:
    log_dir: Path = ns.out
    kv_endpoint = f"tcp://{HOST}:{free_port()}"
    mp = multiprocessing.get_context("spawn")
    to_engine, phases_end = mp.Pipe()
    done_end, from_engine = mp.Pipe()
    engine = mp.Process(target=_engine, args=(kv_endpoint, phases_end, done_end), daemon=True)
    engine.start()
    children: list[Child] = []
    prefix = fresh_key_prefix("kvflood")
    try:
        ports = {role: free_port() for role in ("prefill", "decode")}
        for role, port in ports.items():
            cmd = fixed_worker_command(role, port, "llama-3-8b", ns.interval_ms, 10.0)
            cmd += ["--kv-blocks", str(ns.kv_blocks)]  # what its /metrics report: the bound
            children.append(Child(f"kvflood-{role}", cmd, log_dir=log_dir))
        for child, port in zip(children, ports.values(), strict=True):
            await wait_listening(port, child)
        urls = {role: f"http://{HOST}:{port}" for role, port in ports.items()}
        config = log_dir / "kv-flood.yaml"
        config.write_text(
            router_config(ns.kv_blocks, urls["prefill"], urls["decode"], kv_endpoint, prefix)
        )
        port = free_port()
        exe = Path(sys.executable).with_name("disagg-router")
        cmd = [str(exe), "--log-level", "WARNING", "serve", "--config", str(config)]
        cmd += ["--host", HOST, "--port", str(port)]
        router = Child("kvflood-router", cmd, log_dir=log_dir)
        children.append(router)
        base_url = f"http://{HOST}:{port}"
        async with aiohttp.ClientSession() as session:
            await _wait_answering(session, base_url, router)
            streams = Streams(base_url, ns.streams, ns.max_tokens)
            streams.start(session)
            await asyncio.sleep(2.0)  # the streams under way, the subscriber connected
            streams.mark()
            flood = [
                (2**40 + i * ns.batch_blocks, ns.batch_blocks)
                for i in range(ns.blocks // ns.batch_blocks)
            ]
            plans: list[tuple[str, list[tuple[str, int, int]]]] = [
                ("quiet", []),
                ("control", [("void", first, n) for first, n in flood]),
                ("flood", [("stored", first, n) for first, n in flood]),
                (
                    "oversized",
                    [("stored", 2**41, ns.big_batch), ("stored", 2**42, 2**21 // 48 + 1000)],
                ),
                ("cleared", [("cleared", 0, 0)]),
            ]
            results = []
            for name, plan in plans:
                engine_io = (to_engine, from_engine)
                results.append(
                    await _phase(name, plan, session, base_url, router, streams, engine_io)
                )
                print(orjson.dumps(results[-1]).decode(), file=sys.stderr, flush=True)
            await streams.stop()
        report = {
            "command": " ".join(sys.argv),
            "kv_blocks": ns.kv_blocks,
            "index_bound": 2 * ns.kv_blocks,
            "interval_ms": ns.interval_ms,
            "streams": ns.streams,
            "stream_errors": streams.errors,
            "phases": results,
        }
        return report
    finally:
        to_engine.send(None)
        engine.join(timeout=5)
        if engine.is_alive():
            engine.kill()
        for child in reversed(children):
            child.stop()


async def _phase(
    name: str,
    plan: list[tuple[str, int, int]],
    session: aiohttp.ClientSession,
    base_url: str,
    router: Child,
    streams: Streams,
    engine_io: tuple[Any, Any],
) -> dict[str, Any]:
    to_engine, from_engine = engine_io
    before = await _metrics(session, base_url)
    base = peak = process_rss_bytes(router.pid)
    streams.mark()
    start = time.perf_counter()
    to_engine.send(plan)
    applied_before = before.get("batches_total", 0.0)
    # Until the engine has sent it all and the router's counters stop moving (the engine's
    # 1-block keep-alive moves them every 0.5 s: a second without more than that), or 5 s for
    # the quiet phase.
    settle = time.monotonic() + (5.0 if not plan else 300.0)
    sent, last_check, last, still = False, 0.0, 0.0, 0
    while time.monotonic() < settle:
        await asyncio.sleep(0.05)
        peak = max(peak, process_rss_bytes(router.pid))
        if not sent and from_engine.poll():
            from_engine.recv()
            sent = True
        if sent and time.monotonic() - last_check >= 0.25:
            last_check = time.monotonic()
            now = await _metrics(session, base_url)
            moved = sum(v for k, v in now.items() if k != "index_blocks")
            still = still + 1 if moved - last <= 2 else 0
            last = moved
            if still >= 4 and now.get("batches_total", 0.0) > applied_before:
                break
    elapsed = time.perf_counter() - start
    await asyncio.sleep(0.5)
    after = await _metrics(session, base_url)
    gaps = streams.mark()
    end = process_rss_bytes(router.pid)
    interval = 0.0 if not gaps else min(gaps)
    return {
        "phase": name,
        "batches_sent": len(plan),
        "blocks_sent": sum(b for _, _, b in plan),
        "elapsed_s": round(elapsed, 2),
        "router_rss_mb": {
            "start": round(base / 2**20, 1),
            "peak": round(peak / 2**20, 1),
            "end": round(end / 2**20, 1),
            "growth_peak": round((peak - base) / 2**20, 1),
        },
        "stream_chunks": len(gaps),
        "stream_gap_ms": {
            "worst": round(max(gaps, default=float("nan")) * 1e3, 2),
            "p99": round(_pct(gaps, 0.99) * 1e3, 2),
            "median": round(_pct(gaps, 0.5) * 1e3, 2),
            "shortest": round(interval * 1e3, 2),
        },
        "router_counted": {
            k: after[k] - before.get(k, 0.0)
            for k in sorted(after)
            if k != "index_blocks" and after[k] != before.get(k, 0.0)
        },
        "index_blocks_at_end": after.get("index_blocks"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead.kv_flood",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--blocks", type=int, default=1_500_000, help="bogus blocks in the flood")
    p.add_argument("--batch-blocks", type=int, default=1000)
    p.add_argument("--kv-blocks", type=int, default=25_000, help="the worker's KV capacity")
    p.add_argument("--big-batch", type=int, default=300_000)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--interval-ms", type=float, default=10.0, help="the workers' token interval")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--out", type=Path, default=Path("kv-flood-out"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(ns))
    text = orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()
    (ns.out / "kv-flood.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
