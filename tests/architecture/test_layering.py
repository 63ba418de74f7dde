"""The layers have no arrow back: every import statement in the source, read with `ast`.

The arrow table (also in docs/design.md, "Layers"). A layer may import the standard library,
the third-party libraries not forbidden to it, itself, and the first-party modules listed;
an entry names a layer or one module of it (`disagg_tools.sim.textgen` allows that module
only). The tools are one namespaced package, `disagg_tools`, each of its subpackages a layer.

    policies                → (nothing)          no asyncio, aiohttp, redis: pure, synchronous
    state                   → policies           no aiohttp
    router                  → policies, state    the product: nothing above it
    disagg_tools.sim        → policies, uvrun    the simulated GPU worker
    disagg_tools.simcluster → policies           pure: no asyncio, aiohttp, redis, prometheus
    disagg_tools.procs      → (nothing)          child processes, free ports, /proc readings
    disagg_tools.traces     → (nothing)          the trace formats
    disagg_tools.progress   → (nothing)          progress bars (tqdm)
    disagg_tools.goodput    → progress           the goodput search
    disagg_tools.replay     → traces, progress, goodput, simcluster.metrics
                                                 the replay bench (the simulator's percentiles)
    disagg_tools.overhead   → procs, progress, uvrun, simcluster.metrics
                                                 the overhead benchmark
    disagg_tools.loadgen    → procs, traces, uvrun, sim.textgen
                                                 load, soak, hostile (answers checked against
                                                 the worker's toy model)
    disagg_tools.experiments → policies, simcluster, traces, goodput
                                                 the simulator experiments
    disagg_tools.kubeapi    → uvrun              the stand-in Kubernetes API server
    disagg_tools.uvrun      → (nothing)          the uvloop start-up of the tools (the router
                                                 picks its loop itself: it imports no uvrun)
    disagg_tools.launcher   → anything           the umbrella CLI, local cluster, validation
    tests                   → anything

Every statement counts: module level, inside functions, under `TYPE_CHECKING`, `import x` and
`from x import y`, relative ones resolved against the importing module's package. Dynamic
imports by name (`policies.registry` loading a dotted path from a config) are not statements
and are not checked here. The fresh-interpreter checks below add what actually loads.
"""

from __future__ import annotations

import ast
import functools
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO

T = "disagg_tools"
SIM, SIMCLUSTER, UVRUN, LAUNCHER = f"{T}.sim", f"{T}.simcluster", f"{T}.uvrun", f"{T}.launcher"
KUBEAPI = f"{T}.kubeapi"
# The client tools: four products over the modules they share.
REPLAY, OVERHEAD, LOADGEN, EXPERIMENTS = (
    f"{T}.replay",
    f"{T}.overhead",
    f"{T}.loadgen",
    f"{T}.experiments",
)
PROCS, TRACES, PROGRESS, GOODPUT = f"{T}.procs", f"{T}.traces", f"{T}.progress", f"{T}.goodput"
CLIENT_TOOLS = (REPLAY, OVERHEAD, LOADGEN, EXPERIMENTS, PROCS, TRACES, PROGRESS, GOODPUT)
TOOLS = (SIM, SIMCLUSTER, *CLIENT_TOOLS, KUBEAPI, UVRUN, LAUNCHER)
FIRST_PARTY = ("policies", "state", "router", T, *TOOLS)
# What policies, state and simcluster never load.
UPPER_TOOLS = frozenset({SIM, *CLIENT_TOOLS, KUBEAPI})
ANYTHING = frozenset(FIRST_PARTY)

ALLOWED: dict[str, frozenset[str]] = {
    "policies": frozenset(),
    "state": frozenset({"policies"}),
    "router": frozenset({"policies", "state"}),
    T: frozenset(),  # the namespace's own __init__: a docstring
    SIM: frozenset({"policies", UVRUN}),
    SIMCLUSTER: frozenset({"policies"}),
    PROCS: frozenset(),
    TRACES: frozenset(),
    PROGRESS: frozenset(),
    GOODPUT: frozenset({PROGRESS}),
    REPLAY: frozenset({TRACES, PROGRESS, GOODPUT, f"{SIMCLUSTER}.metrics"}),
    OVERHEAD: frozenset({PROCS, PROGRESS, UVRUN, f"{SIMCLUSTER}.metrics"}),
    LOADGEN: frozenset({PROCS, TRACES, UVRUN, f"{SIM}.textgen"}),
    EXPERIMENTS: frozenset({"policies", SIMCLUSTER, TRACES, GOODPUT}),
    KUBEAPI: frozenset({UVRUN}),
    UVRUN: frozenset(),
    LAUNCHER: ANYTHING,
}

FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "policies": frozenset({"asyncio", "aiohttp", "redis", "uvloop"}),
    "state": frozenset({"aiohttp"}),
    SIMCLUSTER: frozenset({"asyncio", "aiohttp", "redis", "prometheus_client", "uvloop"}),
}


def layer_of(name: str) -> str | None:
    """The layer a dotted name is in (a tools subpackage is a layer of its own), or None when
    it is not first-party. `disagg_tools` alone (its `__init__`) is a layer too."""
    parts = name.split(".")
    if parts[0] == T and len(parts) > 1 and f"{T}.{parts[1]}" in FIRST_PARTY:
        return f"{T}.{parts[1]}"
    return parts[0] if parts[0] in FIRST_PARTY else None


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the importing module, e.g. "router.edge.serve_cli"
    target: str  # what it names, e.g. "disagg_tools.replay.replay_cli.run_bench" or "aiohttp.web"
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.module} imports {self.target}"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_in(source: str, module: str, *, is_package: bool, path: Path = ROOT) -> list[Import]:
    """Every import statement in `source` (the text of `module`), wherever it is written.

    `from x import a, b` yields `x.a` and `x.b` (a name may be a submodule: `from sim import
    textgen`); relative imports are resolved against the module's package."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [Import(module, alias.name, path, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                keep = len(base_parts) - (node.level - 1)
                if keep <= 0:
                    raise ValueError(f"{module}: relative import beyond the top-level package")
                base = ".".join(base_parts[:keep])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                target = base if alias.name == "*" else f"{base}.{alias.name}"
                out.append(Import(module, target, path, node.lineno))
    return out


def _layer_files(root: Path, layer: str) -> list[Path]:
    where = root / layer.replace(".", "/")
    if where.with_suffix(".py").is_file():
        return [where.with_suffix(".py")]
    if layer == T:
        return [where / "__init__.py"]
    return sorted(where.rglob("*.py"))


def source_imports(root: Path = ROOT) -> Iterator[Import]:
    for package in FIRST_PARTY:
        for path in _layer_files(root, package):
            name = module_name(path, root)
            yield from imports_in(
                path.read_text(encoding="utf-8"),
                name,
                is_package=path.name == "__init__.py",
                path=path,
            )


def _covered(target: str, entry: str) -> bool:
    return target == entry or target.startswith(entry + ".")


def violation(imp: Import) -> str | None:
    """Why `imp` breaks the table, or None."""
    layer = layer_of(imp.module)
    assert layer is not None, imp
    top = layer_of(imp.target) or imp.target.split(".")[0]
    if top == layer:
        return None
    if top in FIRST_PARTY:
        if any(_covered(imp.target, entry) for entry in ALLOWED[layer]):
            return None
        return f"{imp}: {layer} may import only {sorted(ALLOWED[layer]) or 'no first-party'}"
    if top in FORBIDDEN_THIRD_PARTY.get(layer, ()):
        return f"{imp}: {layer} must not use {top}"
    return None


def violations(imports: Iterator[Import] | list[Import]) -> list[str]:
    return [v for imp in imports if (v := violation(imp)) is not None]


# ── the checker itself ────────────────────────────────────────────────────────────────────────


def test_the_checker_catches_a_function_level_import_of_an_upper_layer() -> None:
    source = (
        "import asyncio\n"
        "from policies.base import blocks_for\n"
        "def entry():\n"
        "    if True:\n"
        "        from disagg_tools.replay.replay_cli import run_bench\n"
        "    import disagg_tools.sim.worker\n"
        "    return run_bench\n"
    )
    found = imports_in(source, "router.edge.serve_cli", is_package=False)
    assert {i.target for i in found} == {
        "asyncio",
        "policies.base.blocks_for",
        "disagg_tools.replay.replay_cli.run_bench",
        "disagg_tools.sim.worker",
    }
    bad = violations(found)
    assert len(bad) == 2, bad
    assert any("replay.replay_cli.run_bench" in v and ":5:" in v for v in bad)
    assert any("sim.worker" in v and ":6:" in v for v in bad)


def test_the_checker_resolves_relative_imports_and_type_checking_blocks() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import textgen\n"
        "from .worker import running_worker\n"
        "from .. import launcher\n"
        "if TYPE_CHECKING:\n"
        "    from router.config import Settings\n"
    )
    found = imports_in(source, f"{SIM}.sub.mod", is_package=False)
    targets = {i.target for i in found}
    assert {f"{SIM}.sub.textgen", f"{SIM}.sub.worker.running_worker", f"{SIM}.launcher"} <= (
        targets
    )
    # sim.launcher is sim's own; router.config is an arrow sim does not have.
    assert [v for v in violations(found)] == [
        next(str(i) for i in found if i.target == "router.config.Settings")
        + f": {SIM} may import only ['{UVRUN}', 'policies']"
    ]
    from_package = imports_in("from .faults import FaultConfig\n", SIM, is_package=True)
    assert [i.target for i in from_package] == [f"{SIM}.faults.FaultConfig"]


def test_the_checker_allows_one_module_not_its_package() -> None:
    ok = imports_in(
        f"from {SIM}.textgen import expected_answer\n", f"{LOADGEN}.x", is_package=False
    )
    assert violations(ok) == []
    also_ok = imports_in(f"from {SIM} import textgen\n", f"{LOADGEN}.x", is_package=False)
    assert violations(also_ok) == []
    bad = imports_in(f"from {SIM} import worker\nimport {SIM}\n", f"{LOADGEN}.x", is_package=False)
    assert len(violations(bad)) == 2


def test_the_checker_applies_the_third_party_bans() -> None:
    found = imports_in("def f():\n    import asyncio\n", "policies.x", is_package=False)
    assert violations(found) == [f"{found[0]}: policies must not use asyncio"]
    found = imports_in("import prometheus_client\n", f"{SIMCLUSTER}.x", is_package=False)
    assert len(violations(found)) == 1


# ── the source ────────────────────────────────────────────────────────────────────────────────


def test_every_import_statement_in_the_source_follows_the_arrows() -> None:
    found = list(source_imports())
    assert len(found) > 500  # the walk saw the source, not an empty tree
    bad = violations(found)
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_router_or_the_launcher_back() -> None:
    for imp in source_imports():
        layer = layer_of(imp.module)
        top = layer_of(imp.target)
        if layer != LAUNCHER and top == LAUNCHER:
            pytest.fail(str(imp))
        if layer not in ("router", LAUNCHER) and top == "router":
            pytest.fail(str(imp))


# ── what actually loads, in a fresh interpreter ───────────────────────────────────────────────


def _modules(package: str) -> list[str]:
    where = ROOT / package.replace(".", "/")
    if not where.is_dir():
        return []
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(where)])]


def _layers_loaded(module: str) -> set[str]:
    return {layer_of(m) or m.split(".")[0] for m in _imported_after(module)}


@functools.cache
def _imported_after(module: str) -> frozenset[str]:
    """The modules that importing `module` alone loads, in a fresh interpreter (cached: the
    checks below and the import-on-its-own sweep share one run per module)."""
    code = (
        f"import sys, importlib; before = set(sys.modules); importlib.import_module({module!r}); "
        "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return frozenset(out.stdout.split())


def test_policies_import_no_io_libraries_nor_upper_layers() -> None:
    for module in ["policies"] + _modules("policies"):
        loaded = _layers_loaded(module)
        assert not loaded & {"aiohttp", "redis", "router", "state", "asyncio", *UPPER_TOOLS}, module


def test_state_knows_nothing_of_http_or_the_router() -> None:
    for module in ["state"] + _modules("state"):
        loaded = _layers_loaded(module)
        assert not loaded & {"aiohttp", "router", *UPPER_TOOLS}, module


@pytest.mark.parametrize("tool", CLIENT_TOOLS)
def test_bench_is_a_pure_client(tool: str) -> None:
    """Every client tool, each module alone: none of the router, the store or the launcher, and
    of the simulated worker only its toy model (the load tools check answers against it)."""
    toy_model = {SIM, f"{SIM}.textgen"}
    for module in [tool] + _modules(tool):
        after = _imported_after(module)
        assert not {layer_of(m) for m in after} & {"router", "state", LAUNCHER}, module
        worker = {m for m in after if layer_of(m) == SIM} - toy_model
        assert not worker, (module, sorted(worker))


def test_the_cluster_simulator_loads_no_io_library() -> None:
    for module in [SIMCLUSTER] + _modules(SIMCLUSTER):
        loaded = _layers_loaded(module)
        assert not loaded & {
            "aiohttp",
            "redis",
            "prometheus_client",
            "router",
            *UPPER_TOOLS,
        }, module


def test_the_simulated_workers_toy_model_loads_without_aiohttp() -> None:
    for module in (SIM, f"{SIM}.textgen"):
        loaded = _layers_loaded(module)
        assert not loaded & {"aiohttp", "redis", "prometheus_client"}, module


@pytest.mark.parametrize("package", FIRST_PARTY)
def test_every_module_imports_on_its_own(package: str) -> None:
    for module in [package] + _modules(package):
        _imported_after(module)
