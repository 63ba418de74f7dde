"""A stateful property test of the reservation invariants (issue 20).

Hypothesis's rule-based state machine drives a real small cluster (tests/sm_cluster.py: a
private Redis, two router replicas in process, two prefill, two decode and one `both`
simulated worker, a decode worker to register and delete) with:

- requests, streaming and whole, with and without `X-Expected-Output-Tokens` (too low, too
  high, junk), `n` > 1, short and long answers; clients that vanish mid-answer, and clients
  that read the head and stop reading (closed by a later step);
- admin actions: drain/undrain, the `both` worker's role, registering and deleting a worker;
- faults: a worker stopped and brought back, Redis SIGKILLed and restarted empty, a replica
  killed abruptly (its reservations expire by lease) and a new one started;
- tenants (issue 31, tests/sm_tenants.py): every request under a random tenant's key (one
  with a block limit, one with requests per minute, one unlimited; different weights), answers
  of a natural length shorter than max_tokens (`X-Sim-Output-Tokens`); a tenant that poisons its
  estimate with a burst of short answers, then sends long ones in the same max_tokens class;
  preemption on (the default), so answers that outgrow their reservations preempt, and a rule
  that makes a replica preempt every stream once mid-way (`preemption.force_after_tokens`).

After every step, on one snapshot (tests/sm_invariants.py): the store's reservations are the
routers' live view (but for owed releases, calls in flight, a killed replica's leases still
running, and a just-reset store), reserved <= capacity but for bounded forced growth; each
client saw a clean answer. At a quiet point (a rule, and the end of each run): nothing
reserved, stranded, live or owed.

CI runs a short derandomized budget; `STATE_MACHINE_STEPS=10000` runs that many steps in all
(200 a run), randomized.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from disagg_tools.sim.textgen import expected_choice
from tests.conftest import MODEL
from tests.sm_clients import Held, Outcomes, hold, vanish, whole_or_stream
from tests.sm_cluster import TOKEN, Cluster, LoopThread
from tests.sm_invariants import RequestBound, exact, quiet, snapshot
from tests.sm_tenants import TENANT_KEYS

LONG_STEPS = int(os.environ.get("STATE_MACHINE_STEPS", "0"))
STEPS_PER_RUN = 200 if LONG_STEPS else 20
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HINTS = [None, None, "1", "4", "5000", "junk", "-3", "²", " 12"]
WORKERS = ("p0", "p1", "d0", "d1", "b0")
TENANT_NAMES = sorted(TENANT_KEYS)
CHAT = "/v1/chat/completions"
POISONED_MAX_TOKENS = 2000
# The long answers after the poison: shorter in CI's budget (each waiting step waits for them).
POISON_NATURAL = [400, 1200, 1900] if LONG_STEPS else [300, 1000]
MEAN_TOKENS = 48  # the simulated workers' mean answer (tests/sm_cluster.py)
QUIET_WITHIN_S = 20.0  # a killed replica's leases (3 s) and stranded entries (~5 s) run out

_loop: LoopThread | None = None


@pytest.fixture(autouse=True, scope="module")
def _stop_loop() -> Any:
    yield
    global _loop
    if _loop is not None:
        _loop.close()
        _loop = None


def loop() -> LoopThread:
    global _loop
    if _loop is None:
        _loop = LoopThread()
    return _loop


# One client: (kind, stream, hint, n, max_tokens, long answer, replica, bytes read if vanishing,
# tenant, natural answer length)
client = st.tuples(
    st.sampled_from(["read", "read", "read", "vanish", "hold"]),
    st.booleans(),
    st.sampled_from(HINTS),
    st.sampled_from([1, 1, 2, 3]),
    st.sampled_from([8, 64, 300, 1500]),
    st.booleans(),  # ignore_eos: the answer runs to max_tokens
    st.integers(0, 1),
    st.sampled_from([0, 200, 2000]),
    st.sampled_from(TENANT_NAMES),
    st.sampled_from([None, None, 4, 200]),  # X-Sim-Output-Tokens
)


load = st.lists(client, max_size=4)  # traffic under an admin action or a fault


class ReservationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.c = Cluster()
        self.lt = loop()
        self.lt.run(self.c.start())
        self.sync = redis.Redis(
            port=self.c.redis.port, socket_timeout=2.0, socket_connect_timeout=0.5
        )
        self.session = self.lt.run(_session())
        self.out = Outcomes()
        self.bounds: dict[str, RequestBound] = {}
        self.tasks: dict[asyncio.Future[Any], str] = {}  # client -> what it is, since when
        self.held: list[Held] = []
        self.ids = itertools.count()
        self.registered = False
        self.steps = 0

    # -- requests --------------------------------------------------------------------------
    def _request(
        self,
        stream: bool,
        hint: str | None,
        n: int,
        max_tokens: int,
        long: bool,
        tenant: str,
        natural: int | None,
        content: str = "",
    ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
        """The body, the headers and each choice's exact answer of one request."""
        rid = f"sm{next(self.ids)}"
        content = content or f"{rid}: tell me about reservations " * (1 + int(rid[2:]) % 4)
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if n > 1:
            body["n"] = n
        if long:
            body["ignore_eos"] = True
        sim = {} if natural is None else {"X-Sim-Output-Tokens": str(natural)}
        headers = {"X-Request-Id": rid, "Authorization": f"Bearer {TENANT_KEYS[tenant]}", **sim}
        if hint is not None:
            headers["X-Expected-Output-Tokens"] = hint
        self.bounds[rid] = RequestBound(len(content), max_tokens, n)
        expected = [expected_choice(CHAT, body, i, sim, MEAN_TOKENS)[0] for i in range(n)]
        return body, headers, expected

    def _url(self, replica: int) -> str:
        alive = self.c.alive
        return alive[replica % len(alive)].url

    def _spawn(self, coro: Any, what: str) -> None:
        task = asyncio.run_coroutine_threadsafe(coro, self.lt.loop)
        self.tasks[task] = f"{what} at {time.time():.3f}"
        task.add_done_callback(lambda t: self.tasks.pop(t, None))

    @rule(clients=st.lists(client, min_size=1, max_size=8))
    def add_clients(self, clients: list[tuple[Any, ...]]) -> None:
        """Clients that read their answer, vanish mid-answer, or hold it unread. Hypothesis's
        simplest step is the first of the rules with the fewest arguments, by name: this one,
        so that even a run of simplest steps sends requests."""
        self._start(clients)

    def _start(self, clients: list[tuple[Any, ...]]) -> None:
        for kind, stream, hint, n, max_tokens, long, replica, after_bytes, *who in clients:
            tenant, natural = who
            url = self._url(replica)
            if kind == "hold":  # a long stream, so its writes outgrow the buffers
                body, headers, _ = self._request(True, hint, 1, 4000, True, tenant, None)
                held = Held()
                self.held.append(held)
                self._spawn(hold(url, body, headers, held, self.out), f"hold {headers}")
                continue
            body, headers, expected = self._request(
                stream, hint, n, max_tokens, long, tenant, natural
            )
            if kind == "vanish":
                what = f"vanish after {after_bytes} B {headers} {body}"
                self._spawn(vanish(url, body, headers, after_bytes, self.out), what)
            else:
                self._read(url, body, headers, expected)

    def _read(
        self, url: str, body: dict[str, Any], headers: dict[str, str], expected: list[str]
    ) -> None:
        what = f"read {headers} {body} on {url}"
        self._spawn(whole_or_stream(self.session, url, body, headers, self.out, expected), what)

    @rule(
        tenant=st.sampled_from(TENANT_NAMES),
        burst=st.integers(2, 3),
        long=st.lists(
            st.tuples(st.booleans(), st.sampled_from(POISON_NATURAL), st.integers(0, 1)),
            min_size=2,
            max_size=8 if LONG_STEPS else 6,
        ),
    )
    def poison(self, tenant: str, burst: int, long: list[tuple[bool, int, int]]) -> None:
        """Issue 31's hostile tenant: answers that stop after 3 tokens under max_tokens 2,000
        (`burst` pairs, one answer on each replica, a pair at a time: cold, each reserves its
        whole cap, and a limited tenant's would be refused for its limit all at once) teach
        the tenant's estimate for that class a few tokens; then long answers in the same class,
        admitted on that estimate, outgrow their reservations: streams preempt (for the
        tenant's limit or a full worker), whole answers grow by force where none can be."""
        pad = "poison the estimate of this class "
        for _ in range(burst):
            self._shorts(tenant, pad)
        # A replica's histogram cache answers from what it has and refreshes behind (every
        # 0.2 s): one more short answer on each replica makes both read the burst's.
        time.sleep(0.25)
        self._shorts(tenant, pad)
        time.sleep(0.25)
        for stream, natural, replica in long:
            body, headers, expected = self._request(
                stream, None, 1, POISONED_MAX_TOKENS, False, tenant, natural, pad
            )
            self._read(self._url(replica), body, headers, expected)

    def _shorts(self, tenant: str, content: str) -> None:
        clients = []
        for replica in (0, 1):
            body, headers, expected = self._request(
                True, None, 1, POISONED_MAX_TOKENS, False, tenant, 3, content
            )
            url = self._url(replica)
            clients.append(whole_or_stream(self.session, url, body, headers, self.out, expected))
        self.lt.run(_all(clients))

    @rule(load=load, which=st.integers(0, 1), after=st.sampled_from([0, 5, 40]))
    def forced_preemption(self, load: list[tuple[Any, ...]], which: int, after: int) -> None:
        """A replica preempts every resumable stream once when it has relayed `after` tokens
        (the test-only preemption.force_after_tokens; 0: off again): each resumes exactly."""
        preemptor = self.c.alive[which % len(self.c.alive)].parts.requests.answering.preemptor
        preemptor.settings = replace(preemptor.settings, force_after_tokens=after)
        self._start(load)

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 7))
    def close_held(self, which: int) -> None:
        self.lt.run(self.held.pop(which % len(self.held)).close())

    @rule(dt=st.sampled_from([0.05, 0.3, 1.0]))
    def time_passes(self, dt: float) -> None:
        time.sleep(dt)

    @rule(within_s=st.just(30.0))
    def clients_finish(self, within_s: float) -> None:
        """Every reading client ends (bounded): a quiescent point but for held clients."""
        self._wait_clients(within_s)

    # -- admin -----------------------------------------------------------------------------
    def _admin(self, method: str, path: str, body: dict[str, Any] | None, replica: int) -> int:
        url = self._url(replica) + path
        status, raw = self.lt.run(_send(self.session, method, url, body))
        assert status < 500, (method, path, status, raw[:300])
        return status

    @rule(load=load, wid=st.sampled_from(WORKERS), drained=st.booleans(), replica=st.integers(0, 1))
    def drain(self, load: list[tuple[Any, ...]], wid: str, drained: bool, replica: int) -> None:
        self._start(load)
        action = "drain" if drained else "undrain"
        status = self._admin("POST", f"/admin/workers/{wid}/{action}", {"force": True}, replica)
        assert status == 200, status

    @rule(load=load, role=st.sampled_from(["prefill", "decode"]), replica=st.integers(0, 1))
    def role_change(self, load: list[tuple[Any, ...]], role: str, replica: int) -> None:
        self._start(load)
        body = {"role": role, "force": True}
        status = self._admin("POST", "/admin/workers/b0/role", body, replica)
        assert status in (200, 409), status  # 409: a change already under way

    @rule(load=load, replica=st.integers(0, 1))
    def register_or_delete(self, load: list[tuple[Any, ...]], replica: int) -> None:
        self._start(load)
        if not self.registered:
            assert self._admin("POST", "/admin/workers", self.c.entry("r0"), replica) == 201
        else:
            status = self._admin("DELETE", "/admin/workers/r0", {"force": True}, replica)
            self.c.deleted_until["r0"] = time.time() + 2.0
            assert status in (200, 404), status  # 404: another replica's sync came first
        self.registered = not self.registered

    # -- faults ----------------------------------------------------------------------------
    @precondition(lambda self: all(w.up for w in self.c.workers.values()))
    @rule(load=load, wid=st.sampled_from([*WORKERS, "r0"]))
    def kill_worker(self, load: list[tuple[Any, ...]], wid: str) -> None:
        self._start(load)
        self.lt.run(self.c.workers[wid].stop())

    @precondition(lambda self: not all(w.up for w in self.c.workers.values()))
    @rule(load=load)
    def revive_worker(self, load: list[tuple[Any, ...]]) -> None:
        self._start(load)
        for w in self.c.workers.values():
            if not w.up:
                self.lt.run(w.start())

    @rule(load=load, down_s=st.sampled_from([0.05, 0.5, 1.5]))
    def redis_outage(self, load: list[tuple[Any, ...]], down_s: float) -> None:
        self._start(load)
        self.lt.run(self.c.kill_redis())
        time.sleep(down_s)
        self.lt.run(self.c.restart_redis())

    @precondition(lambda self: len(self.c.alive) == 2)
    @rule(load=load, which=st.integers(0, 1))
    def kill_replica(self, load: list[tuple[Any, ...]], which: int) -> None:
        self._start(load)
        self.lt.run(self.c.kill_replica(self.c.alive[which]))

    @precondition(lambda self: len(self.c.alive) < 2)
    @rule(load=load)
    def start_replica(self, load: list[tuple[Any, ...]]) -> None:
        self._start(load)
        self.lt.run(self.c.start_replica())

    @rule(within_s=st.just(QUIET_WITHIN_S))
    def quiet_point(self, within_s: float) -> None:
        self._check_quiet(within_s)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def reservations_match(self) -> None:
        self.steps += 1
        bad = self.lt.run(self._exact())
        assert not bad, "\n".join([*bad, "recent warnings:", *self.c.errors.warnings])
        assert not self.out.problems, "\n".join(self.out.problems)
        assert not self.c.errors.records, "\n".join(self.c.errors.records)

    async def _exact(self) -> list[str]:
        return exact(self.c, snapshot(self.c, self.sync), self.bounds)

    async def _quiet(self) -> list[str]:
        return quiet(snapshot(self.c, self.sync))

    def _wait_clients(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while self.tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.tasks, (
            f"{len(self.tasks)} clients still running after {within_s} s (now "
            f"{time.time():.3f}): {list(self.tasks.values())}; recent warnings: "
            f"{list(self.c.errors.warnings)}"
        )

    def _check_quiet(self, within_s: float = QUIET_WITHIN_S) -> None:
        for held in self.held:
            self.lt.run(held.close())
        self.held.clear()
        self._wait_clients(40.0)
        deadline = time.monotonic() + within_s
        bad = self.lt.run(self._quiet())
        while bad and time.monotonic() < deadline:
            time.sleep(0.1)
            bad = self.lt.run(self._quiet())
        assert not bad, "\n".join(bad)

    def teardown(self) -> None:
        try:
            self._check_quiet()
        finally:
            print(f"state machine run: {self.steps} steps, outcomes {self.out.statuses}")
            counts = self.c.preemptions.counts + self.c.quotas.counts
            preempted = {
                reason: sum(
                    int(_counter(r.parts.metrics.preemptions, reason=reason))
                    for r in self.c.replicas
                )
                for reason in ("worker_full", "tenant_limit", "forced")
            }
            print(f"  preemptions {preempted}; {dict(counts)}; 429s {dict(self.out.reasons)}")
            self.lt.run(self.session.close())
            self.lt.run(self.c.close())
            self.sync.close()


async def _all(clients: list[Any]) -> None:
    await asyncio.gather(*clients)


def _counter(metric: Any, **labels: str) -> float:
    value: float = metric.labels(**labels)._value.get()
    return value


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))


async def _send(
    session: aiohttp.ClientSession, method: str, url: str, body: dict[str, Any] | None
) -> tuple[int, bytes]:
    async with session.request(method, url, json=body, headers=AUTH) as r:
        return r.status, await r.read()


ReservationMachine.TestCase.settings = settings(
    # Hypothesis ends some runs early (~150 steps a run on average here): enough runs to pass
    # LONG_STEPS in all.
    max_examples=max(1, LONG_STEPS // 140) if LONG_STEPS else 5,
    stateful_step_count=STEPS_PER_RUN,
    deadline=None,
    derandomize=not LONG_STEPS,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
    # No shrinking: each step runs on a real cluster with real timing, so a shrunk case is
    # neither fast nor reliably the same; the failing run's steps are printed as they ran.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


@pytest.mark.timeout(900 if not LONG_STEPS else 6 * 3600)
class TestReservations(ReservationMachine.TestCase):  # type: ignore[name-defined]
    pass
