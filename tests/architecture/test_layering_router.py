"""Inside the router: its three subpackages have one-way edges, and the request package's imports
run with the flow (docs/design.md §2).

    router.relay     → nothing of router.request nor router.workers (bytes in, events out)
    router.workers   → nothing of router.request nor router.relay (who serves, and how well)
    router.request   → the relay, the workers, the router's shared modules; inside it, a module
                       imports only the modules before it in FLOW: the types a request is made
                       of first, then the stages in the order a request meets them, and the
                       orchestrator (`lifecycle`), which runs them, last

Every import statement counts, read with `ast` as in tests/architecture/test_layering.py.
"""

from __future__ import annotations

import pytest

from tests.architecture.test_layering import ROOT, Import, imports_in, module_name

REQUEST = "router.request"

# The request package in the order its imports may run: what a try is made of, then each stage
# as a request meets it (reserve → legs → respond → resume → release), then the loop over them.
FLOW = (
    "preemption",  # the live streams a growth with no room may stop (the rule: policies/)
    "fair_takeback",  # streams stopped for the cluster's fair share (the rule: policies/)
    "holdings",  # the reservation's and the stranded KV's owners
    "attempt",  # the request (Call), one try's ask (Ask) and holdings (Attempt), a failed leg
    "retry_policy",  # whether a failed try is tried again, where, after what pause
    "pairing",  # how a placed pair serves: pulled KV, concurrent legs, decode alone
    "assemble",  # a whole answer from a stream's events (pure)
    "resumed_usage",  # a resumed stream's usage, said as one answer's (pure)
    "quota",  # the request's share of its tenant's quota, taken before it may wait
    "seat",  # the request's place under the concurrency cap: ticket, tenant, charge, quota
    "priority_class",  # the request's class: its tenant's or a less urgent one it asks for
    "admit",  # the admission decision: take a slot, place, wait or refuse, a 400 if it never fits
    "reserve",  # estimate, place, queue, reserve
    "legs",  # prefill, KV handoff, decode: the answer bound to its relay
    "respond",  # the answer to the client
    "one_worker",  # a passthrough route's leg: one worker's answer, whole or streamed
    "resume",  # the ask that continues a broken stream
    "release",  # give back, feed the estimator
    "lifecycle",  # RequestFlow: the deadline and the one retry/resume loop
)


def _imports(package: str) -> list[Import]:
    out: list[Import] = []
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        name = module_name(path)
        out += imports_in(source, name, is_package=path.name == "__init__.py", path=path)
    return out


def _inside(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _request_module(target: str) -> str | None:
    """The FLOW module `target` names (`router.request.legs.Legs` → `legs`), or None."""
    if not _inside(target, REQUEST) or target == REQUEST:
        return None
    return target[len(REQUEST) + 1 :].split(".")[0]


def test_flow_lists_every_module_of_the_request_package_once() -> None:
    modules = {p.stem for p in (ROOT / "router" / "request").glob("*.py")} - {"__init__"}
    assert sorted(FLOW) == sorted(modules)
    assert len(set(FLOW)) == len(FLOW)


@pytest.mark.parametrize(
    ("package", "not_into"),
    [
        ("router.relay", ("router.request", "router.workers")),
        ("router.workers", ("router.request", "router.relay")),
    ],
)
def test_the_relay_and_the_workers_know_nothing_of_a_request(
    package: str, not_into: tuple[str, ...]
) -> None:
    bad = [str(i) for i in _imports(package) if any(_inside(i.target, p) for p in not_into)]
    assert not bad, "\n".join(bad)


def test_the_request_packages_imports_run_with_the_flow() -> None:
    bad = []
    for imp in _imports(REQUEST):
        source, target = _request_module(imp.module), _request_module(imp.target)
        if source is None or target is None or source == target:
            continue
        if FLOW.index(target) > FLOW.index(source):
            bad.append(f"{imp}: {source} comes before {target} in the flow")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_an_import_against_the_flow() -> None:
    # reserve importing legs is what this package used to do (the stranded entry was built by
    # the legs, before any leg existed): the check must name it.
    found = imports_in(
        "from router.request.legs import Legs\n", "router.request.reserve", is_package=False
    )
    source, target = _request_module(found[0].module), _request_module(found[0].target)
    assert (source, target) == ("reserve", "legs")
    assert FLOW.index(target) > FLOW.index(source)


def test_outside_the_package_only_its_entry_and_its_assembly_reach_in() -> None:
    """The HTTP handler meets the request package through `lifecycle` (RequestFlow,
    ClientSide, RequestStages); `router.edge.request_stages` assembles the stages; the
    passthrough path and the retry policy both paths use share a failed leg's description
    (`attempt`). Nothing else reaches into a stage."""
    allowed = {
        "router.edge.request_stages": set(FLOW),
        "router.edge.app": {"lifecycle"},
        "router.edge.passthrough": {"attempt", "retry_policy", "one_worker"},
    }
    bad = []
    for imp in _imports("router"):
        if _inside(imp.module, REQUEST):
            continue
        target = _request_module(imp.target)
        if target is not None and target not in allowed.get(imp.module, set()):
            bad.append(str(imp))
    assert not bad, "\n".join(bad)


# The router's rooms, lowest first: a module may import its own room, the floor and the rooms
# below it, never one above (docs/design.md, "The house"). The floor is the modules at the
# router's root: settings, errors, metrics, tenants, admission, leases, background loops, logs.
ROOMS = (
    "",  # the floor: router/*.py
    "adapters",  # engine dialects: vLLM, SGLang, Mooncake (bytes of their APIs)
    "relay",  # bytes in, events out: the upstream client and the SSE cutter
    "workers",  # who serves and how well: pools, breakers, KV indices, discovery
    "tokens",  # tokenizers and chat templates
    "openai",  # the OpenAI wire format: parsing, prompt text, the Responses API
    "request",  # one request's trip: reserve, legs, respond, resume, release
    "control",  # controllers over the cluster: the role manager, the scaling signals
    "edge",  # the HTTP edge: app, server, CLI, admin, auth, passthrough
)


def room_of(module: str) -> str | None:
    """`router.request.legs` → "request"; `router.config` → "" (the floor); not router → None."""
    parts = module.split(".")
    if parts[0] != "router":
        return None
    if len(parts) >= 2 and parts[1] in ROOMS:
        return parts[1]
    return ""


def test_every_router_folder_is_a_room() -> None:
    folders = {p.name for p in (ROOT / "router").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(ROOMS) - {""}


def test_the_rooms_import_only_downwards() -> None:
    bad = []
    for imp in _imports("router"):
        source, target = room_of(imp.module), room_of(imp.target)
        if source is None or target is None or imp.target == "router":
            continue
        if ROOMS.index(target) > ROOMS.index(source):
            name = target or "the floor"
            bad.append(f"{imp}: {source or 'the floor'} is below {name}")
    assert not bad, "\n".join(bad)


def test_the_room_checker_sees_an_upward_import() -> None:
    # config importing a worker's breaker settings was the circle config <-> workers.
    found = imports_in(
        "from router.workers.breaker import CircuitBreaker\n", "router.config", is_package=False
    )
    assert (room_of(found[0].module), room_of(found[0].target)) == ("", "workers")
    assert ROOMS.index("workers") > ROOMS.index("")
