"""A worker's own load report against the router's reservations (router/workers/worker_state.py
`used_blocks`): a report is as old as the last poll, and room released since is free at once.

Found in issue 33's flood bench: a decode worker's report, read while its eight streams ran,
kept it looking full after they all ended and their reservations were released — no admission
until the next poll (up to `loops.load_poll_s`), 20 requests waiting beside an empty worker.
The worker here is a real aiohttp server answering vLLM's /metrics with the KV usage a test
sets; the placement snapshot is the one every request is placed on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from router.config import settings_from_mapping
from router.loop_timing import LoopTiming
from router.workers.accounting import LocalAccounting
from router.workers.discovery import LoadSnapshot
from router.workers.load_poller import LoadPoller
from router.workers.membership import Membership
from router.workers.placement_view import PlacementView

MODEL = "llama-3-8b"
CAPACITY = 120


@contextlib.asynccontextmanager
async def reporting_worker(usage: list[float]) -> AsyncIterator[str]:
    """A worker whose /metrics says it uses `usage[0]` of its KV blocks."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            text=(
                "vllm:num_requests_running 8\nvllm:num_requests_waiting 0\n"
                f"vllm:kv_cache_usage_perc {usage[0]}\n"
            )
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _pieces(url: str) -> tuple[Membership, LocalAccounting, LoadPoller, PlacementView]:
    s = settings_from_mapping(
        {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "workers": [
                {"id": "p0", "url": url, "role": "prefill", "adapter": "vllm"},
                {
                    "id": "d0",
                    "url": url,
                    "role": "decode",
                    "adapter": "vllm",
                    "kv_blocks": CAPACITY,
                },
            ],
        }
    )
    members = Membership(s)
    timing = LoopTiming(members.carrying_work)
    return (
        members,
        LocalAccounting(members, timing),
        LoadPoller(s, members, timing),
        PlacementView(members, s),
    )


def _free(view: PlacementView) -> int:
    (d0,) = view.snapshot().decode
    return d0.free_blocks


async def test_room_released_after_the_report_is_free_at_once() -> None:
    usage = [0.9]  # 108 of 120 blocks: eight streams of 15 running, as reported
    async with reporting_worker(usage) as url, aiohttp.ClientSession() as session:
        members, accounting, poller, view = _pieces(url)
        d0 = members.workers["d0"]
        accounting.note_reserved("d0", 8 * 15)
        await poller.poll(session, d0)
        assert d0.load is not None and d0.load.kv_usage == 0.9
        assert _free(view) == 0
        for _ in range(7):  # seven of the streams end: their reservations are released
            accounting.note_released("d0", 15)
        # The report still says 108 used, but all it held was reserved: free now is what the
        # reservations leave (before: 120 - 108 = 12 until the next poll).
        assert _free(view) == CAPACITY - 15
        accounting.note_reserved("d0", 30)  # new placements take it
        assert _free(view) == CAPACITY - 45


async def test_usage_beyond_the_reservations_is_carried_until_the_next_report() -> None:
    usage = [0.5]  # 60 blocks used while 30 are reserved: 30 the router did not reserve
    async with reporting_worker(usage) as url, aiohttp.ClientSession() as session:
        members, accounting, poller, view = _pieces(url)
        d0 = members.workers["d0"]
        accounting.note_reserved("d0", 30)
        await poller.poll(session, d0)
        assert _free(view) == CAPACITY - 60
        accounting.note_released("d0", 20)  # the reserved part shrinks; the rest is still there
        assert _free(view) == CAPACITY - (10 + 30)
        accounting.note_reserved("d0", 40)
        assert _free(view) == CAPACITY - (50 + 30)
        usage[0] = 0.25  # the next report: 30 used, under the 50 reserved
        await poller.poll(session, d0)
        assert _free(view) == CAPACITY - 50


async def test_a_report_set_without_the_accounting_is_taken_as_it_is() -> None:
    async with reporting_worker([0.0]) as url:
        members, accounting, _, view = _pieces(url)
        d0 = members.workers["d0"]
        accounting.note_reserved("d0", 15)
        d0.load = LoadSnapshot(4, 0, 0.5, None, time.monotonic())  # not through `took_load`
        assert _free(view) == CAPACITY - 60
