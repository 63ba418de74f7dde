"""No import circle among the first-party modules: every import statement, read with `ast`.

The statements are those tests/architecture/test_layering.py reads (its `imports_in`: module level,
inside
functions, under `TYPE_CHECKING`, relative ones resolved), in every module under policies/,
state/, router/ and disagg_tools/: a circle counts even when only the type checker
follows one of its arrows, because it still means two modules that cannot be understood, or
moved, one without the other. Each statement's target is resolved to the module it loads: the
longest dotted prefix of it that is a first-party module (`from router.workers.pools import
Pools` is an arrow to `router.workers.pools`). A package's `__init__` is a module like any
other, entered only when it is named.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tests.architecture.test_layering import ROOT, Import, imports_in, module_name

# Circles known and owned elsewhere: their modules (sorted) -> why each is still here. Each goes
# when its owner breaks it (the test then says to take it out); empty, the house has none.
EXPECTED: dict[tuple[str, ...], str] = {}


def module_of(target: str, modules: set[str]) -> str | None:
    """The first-party module an import of `target` loads (its longest known dotted prefix)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in modules:
            return name
    return None


def import_graph(imports: Iterable[Import], modules: set[str]) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (itself left out)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        target = module_of(imp.target, modules)
        if target is not None and target != imp.module:
            graph.setdefault(imp.module, set()).add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module, each sorted (iterative: no recursion
    limit on a deep import chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def a_cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle inside `component`, as the path a -> b -> ... -> a, from its first module
    (breadth-first back to the start: the shortest such circle)."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle in the component {component}")  # pragma: no cover


def first_party_files() -> list[Path]:
    """Every module of the product and the tools, whether or not a layer names it."""
    tops = ("policies", "state", "router", "disagg_tools")
    return sorted(path for top in tops for path in (ROOT / top).rglob("*.py"))


def every_import(files: list[Path]) -> Iterator[Import]:
    for path in files:
        yield from imports_in(
            path.read_text(encoding="utf-8"),
            module_name(path),
            is_package=path.name == "__init__.py",
            path=path,
        )


def cycles(imports: list[Import], modules: set[str]) -> dict[tuple[str, ...], list[str]]:
    """Each circle's modules (sorted) -> one circle through them, as a path."""
    graph = import_graph(imports, modules)
    return {tuple(c): a_cycle_through(c, graph) for c in strongly_connected(graph)}


# ── the checker itself ────────────────────────────────────────────────────────────────────────


def _imports(sources: dict[str, str]) -> list[Import]:
    return [
        imp for name, text in sources.items() for imp in imports_in(text, name, is_package=False)
    ]


def test_the_checker_names_a_circle_even_under_type_checking() -> None:
    sources = {
        "router.a": "from router.b import thing\n",
        "router.b": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.a import A\n"
        ),
        "router.c": "import router.a\n",
    }
    found = cycles(_imports(sources), set(sources))
    assert found == {("router.a", "router.b"): ["router.a", "router.b", "router.a"]}


def test_the_checker_finds_a_longer_circle_and_ignores_one_way_arrows() -> None:
    sources = {
        "router.x.one": "from router.x.two import f\nimport aiohttp\n",
        "router.x.two": "def g():\n    from router.x import three\n",
        "router.x.three": "from ..x.one import h\n",
        "router.x.four": "from router.x.one import h\nfrom router.x.three import k\n",
    }
    found = cycles(_imports(sources), set(sources))
    circle = ["router.x.one", "router.x.two", "router.x.three", "router.x.one"]
    assert found == {("router.x.one", "router.x.three", "router.x.two"): circle}
    one_way = {k: sources[k] for k in ("router.x.one", "router.x.four")}
    assert cycles(_imports(one_way), set(sources)) == {}


# ── the source ────────────────────────────────────────────────────────────────────────────────


def test_no_import_circle_among_the_first_party_modules() -> None:
    files = first_party_files()
    modules = {module_name(path) for path in files}
    assert {"router.edge.app", "policies.base", "state.base", "disagg_tools.sim.worker"} <= modules
    found = cycles(list(every_import(files)), modules)
    unexpected = [" -> ".join(path) for members, path in found.items() if members not in EXPECTED]
    assert not unexpected, "import circles:\n" + "\n".join(unexpected)
    gone = sorted(set(EXPECTED) - set(found))
    assert not gone, f"no longer circles, take them out of EXPECTED: {gone}"
