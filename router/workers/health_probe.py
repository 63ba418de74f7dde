"""Health probes and KV-layout discovery of the pools' workers.

A worker is in rotation once it answers `/health` and what its entry leaves out is known: its KV
layout (configured, or read from the worker itself: `discover_layout`) and, for an SGLang prefill
without a configured `bootstrap_port`, the bootstrap port its `/server_info` reports. Two failed
probes in a row take it out; a worker that may come back upgraded (or restarted on another
bootstrap port) has those read again first. The prober slows down to
`health_idle_interval_s` while every worker answers and the replica is quiet: a request's own
failure trips the breaker meanwhile, and the first placement brings the cadence back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import aiohttp

from router.config import Settings
from router.workers.discovery import fetch_layout_facts, fetch_server_facts, merge_layout
from router.workers.loop_timing import LoopTiming
from router.workers.membership import Membership
from router.workers.worker_state import WorkerState

__all__ = ["HealthProber"]

log = logging.getLogger(__name__)


class HealthProber:
    def __init__(self, members: Membership, timing: LoopTiming, settings: Settings) -> None:
        self._members = members
        self._timing = timing
        self._settings = settings

    def __repr__(self) -> str:
        return f"HealthProber({len(self._members.workers)} workers)"

    async def layout_facts(
        self, session: aiohttp.ClientSession, url: str, adapter: str
    ) -> dict[str, Any]:
        """What the worker at `url` reports of its KV layout, within two health-probe timeouts
        (it takes two requests for vLLM). Raises aiohttp.ClientError, TimeoutError, ValueError."""
        async with asyncio.timeout(2 * self._settings.health_timeout_s):
            return await fetch_layout_facts(session, url, adapter)

    async def discover_layout(self, session: aiohttp.ClientSession, w: WorkerState) -> bool:
        """Read what a worker's entry leaves out from the worker itself: a `discover_layout`
        worker's layout (its own configured fields stay on top), an SGLang prefill's bootstrap
        port. Until this succeeds the worker is out of rotation."""
        spec = w.spec
        try:
            async with asyncio.timeout(2 * self._settings.health_timeout_s):
                facts, bootstrap_port = await fetch_server_facts(session, spec.url, spec.adapter)
            layout = (
                merge_layout(spec.layout, facts, dict(spec.layout_configured))
                if spec.discover_layout
                else spec.layout
            )
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("cannot read the facts of worker %s yet: %r", spec.id, exc)
            return False
        if spec.reads_bootstrap_port:
            if bootstrap_port is None:
                log.warning(
                    "worker %s: its /server_info gives no disaggregation_bootstrap_port (is it "
                    "started with --disaggregation-mode prefill?); set bootstrap_port",
                    spec.id,
                )
                return False
            spec = replace(spec, bootstrap_port=bootstrap_port)
        w.spec = replace(spec, layout=layout)
        w.layout_known = True
        log.info(
            "worker %s reports its KV layout %s%s",
            spec.id,
            layout.key,
            f", bootstrap port {bootstrap_port}" if spec.reads_bootstrap_port else "",
        )
        return True

    async def probe(self, session: aiohttp.ClientSession, w: WorkerState) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self._settings.health_timeout_s)
            async with session.get(w.spec.url + "/health", timeout=timeout) as resp:
                ok = resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok and not w.layout_known:
            await self.discover_layout(session, w)
        if ok:
            if not w.healthy:
                log.info("worker %s is healthy again", w.spec.id)
            # Not the breaker: /health passes on a worker whose engine is broken; a half-open
            # breaker is closed by a real request that works (router/workers/breaker.py).
            w.healthy, w.consecutive_failures = True, 0
        else:
            w.consecutive_failures += 1
            if w.healthy and w.consecutive_failures >= 2:
                log.warning(
                    "worker %s failed %d health probes: out of rotation",
                    w.spec.id,
                    w.consecutive_failures,
                )
                w.healthy = False
                if w.spec.reads_server_facts:
                    # It may come back upgraded (a rolling upgrade restarts workers in place):
                    # its layout (and bootstrap port) are read again before it is used again.
                    w.layout_known = False

    def _may_slow(self) -> bool:
        """Every worker answers its probes (layout known, breaker closed), and this replica is
        quiet. A drained worker counts as answering: drained is a state, not a failure."""
        if self._timing.busy():
            return False
        return all(
            w.healthy
            and w.consecutive_failures == 0
            and w.layout_known
            and w.breaker.opened_at is None
            for w in self._members.workers.values()
        )

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Every `health_interval_s`; while every worker is healthy and this replica is quiet,
        the interval doubles up to `health_idle_interval_s`. A failed probe, a worker out of
        rotation, or the first placement after the quiet spell brings it back at once."""
        s = self._settings
        interval = s.health_interval_s
        while True:
            await asyncio.gather(
                *(self.probe(session, w) for w in list(self._members.workers.values()))
            )
            if self._may_slow():
                interval = min(2 * interval, max(s.health_interval_s, s.health_idle_interval_s))
                await self._timing.quiet_sleep(interval)
            else:
                interval = s.health_interval_s
                await self._timing.beat(interval)
