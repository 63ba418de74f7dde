"""Health probes and KV-layout discovery of the pools' workers.

A worker is in rotation once it answers `/health` and what its entry leaves out is known: its KV
layout (configured, or read from the worker itself: `discover_layout`) and, for an SGLang prefill
without a configured `bootstrap_port`, the bootstrap port its `/server_info` reports. Two failed
probes in a row take it out; a worker that may come back upgraded (or restarted on another
bootstrap port) has those read again first. A worker that answered a real request well within
the last probe interval is not probed: that answer says more than `/health` does (whose pass
does not show that the engine works, router/workers/breaker.py), and a worker that stops
answering stops renewing it. The prober slows down to
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
from router.loop_timing import LoopTiming
from router.workers.discovery import (
    WorkerFacts,
    fetch_layout_facts,
    fetch_server_facts,
    merge_layout,
)
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

    def two_probes(self) -> asyncio.Timeout:
        """The bound of one facts read: two health-probe timeouts (vLLM's takes two requests)."""
        return asyncio.timeout(2 * self._settings.loops.health_timeout_s)

    async def layout_facts(
        self, session: aiohttp.ClientSession, url: str, adapter: str
    ) -> dict[str, Any]:
        """What the worker at `url` reports of its KV layout, within two health-probe timeouts.
        Raises aiohttp.ClientError, TimeoutError, ValueError."""
        async with self.two_probes():
            return await fetch_layout_facts(session, url, adapter)

    async def discover_layout(self, session: aiohttp.ClientSession, w: WorkerState) -> bool:
        """Read what a worker's entry leaves out from the worker itself: a `discover_layout`
        worker's layout (its own configured fields stay on top), an SGLang prefill's bootstrap
        port, the role an SGLang `both` engine serves. Until this succeeds the worker is out of
        rotation."""
        spec = w.spec
        try:
            async with self.two_probes():
                facts, sglang = await fetch_server_facts(session, spec.url, spec.adapter)
            layout = (
                merge_layout(spec.layout, facts, dict(spec.layout_configured))
                if spec.discover_layout
                else spec.layout
            )
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("cannot read the facts of worker %s yet: %r", spec.id, exc)
            return False
        bootstrap_port = sglang.bootstrap_port if sglang is not None else None
        before = (w.engine_role, spec.bootstrap_port)
        if spec.switches_engine_role and not self._note_engine_role(w, sglang):
            return False
        # A `both` engine outside PD mode serves whole requests: it needs no bootstrap server.
        if spec.reads_bootstrap_port and w.engine_role != "both":
            if bootstrap_port is None:
                log.warning(
                    "worker %s: its /server_info gives no disaggregation_bootstrap_port (is it "
                    "started with --disaggregation-mode prefill?); set bootstrap_port",
                    spec.id,
                )
                return False
            spec = replace(spec, bootstrap_port=bootstrap_port)
        news = (w.engine_role, spec.bootstrap_port) != before or not w.layout_known
        w.spec = replace(spec, layout=layout)
        w.layout_known = True
        if news:  # (an SGLang `both` engine is read at every probe: say only what changed)
            log.info(
                "worker %s reports its KV layout %s%s%s",
                spec.id,
                layout.key,
                f", bootstrap port {bootstrap_port}" if spec.reads_bootstrap_port else "",
                f", serving {w.engine_role}" if spec.switches_engine_role else "",
            )
            if spec.switches_engine_role and not w.engine_switchable and w.engine_role != "both":
                log.warning(
                    "worker %s is registered as both but its SGLang engine runs as %s without "
                    "--enable-pd-role-switch: it stays %s",
                    spec.id, w.engine_role, w.engine_role,
                )  # fmt: skip
        return True

    @staticmethod
    def _note_engine_role(w: WorkerState, facts: WorkerFacts | None) -> bool:
        """An SGLang `both` engine's role and switch flag from its /server_info."""
        if facts is None or facts.pd_mode is None:
            log.warning("worker %s: its /server_info gives no disaggregation_mode", w.spec.id)
            return False
        w.engine_role, w.engine_switchable = facts.pd_mode, facts.pd_role_switch
        if facts.decode_graphs:
            w.decode_graphs = facts.decode_graphs
        return True

    def _answered_lately(self, w: WorkerState) -> bool:
        """`w` answered a real request well within the last probe interval, and nothing else is
        owed at its probe: no request failed since, healthy, no failed probe, its layout known,
        no engine role to read, not a data-parallel server (its lead's probe speaks for every
        rank)."""
        breaker = w.breaker
        at = breaker.succeeded_at
        return (
            at is not None
            and breaker.failures == 0
            and breaker.clock() - at < self._settings.loops.health_interval_s
            and w.healthy
            and w.consecutive_failures == 0
            and w.layout_known
            and not w.spec.switches_engine_role
            and w.spec.dp_size == 1
        )

    async def probe(self, session: aiohttp.ClientSession, w: WorkerState) -> None:
        if self._answered_lately(w):
            return
        try:
            timeout = aiohttp.ClientTimeout(total=self._settings.loops.health_timeout_s)
            async with session.get(w.spec.url + "/health", timeout=timeout) as resp:
                ok = resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok and (not w.layout_known or w.spec.switches_engine_role):
            # An SGLang `both` engine's role is read at every probe: the replica that leads may
            # have switched it, or it restarted in its start-up role between two probes.
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
                w.engine_broken = None  # what comes back is a new process
                if w.spec.reads_server_facts:
                    # It may come back upgraded (a rolling upgrade restarts workers in place):
                    # its layout (and bootstrap port) are read again before it is used again.
                    w.layout_known = False
        self._members.follow_lead(w)  # a data-parallel worker's ranks: one URL, one verdict

    def _may_slow(self) -> bool:
        """Every worker answers its probes (layout known, breaker closed), and this replica is
        quiet. A drained worker counts as answering: drained is a state, not a failure."""
        if self._timing.busy():
            return False
        return all(
            w.healthy
            and w.consecutive_failures == 0
            and w.layout_known
            and not w.engine_behind
            and w.breaker.opened_at is None
            for w in self._members.workers.values()
        )

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Every `health_interval_s`; while every worker is healthy and this replica is quiet,
        the interval doubles up to `health_idle_interval_s`. A failed probe, a worker out of
        rotation, or the first placement after the quiet spell brings it back at once."""
        s = self._settings
        interval = s.loops.health_interval_s
        while True:
            await asyncio.gather(*(self.probe(session, w) for w in self._members.probe_targets()))
            if self._may_slow():
                interval = min(
                    2 * interval, max(s.loops.health_interval_s, s.loops.health_idle_interval_s)
                )
                await self._timing.quiet_sleep(interval)
            else:
                interval = s.loops.health_interval_s
                await self._timing.beat(interval)
