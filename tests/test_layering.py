"""The one-way layering (router → policies, state) holds: checked in a fresh interpreter."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> list[str]:
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(ROOT / package)])]


def _imported_after(module: str) -> set[str]:
    code = (
        "import sys, importlib; before = set(sys.modules); importlib.import_module(%r); "
        "print('\\n'.join(sorted(set(sys.modules) - before)))" % module
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return set(out.stdout.split())


def test_policies_import_no_io_libraries_nor_upper_layers() -> None:
    for module in ["policies"] + _modules("policies"):
        loaded = {m.split(".")[0] for m in _imported_after(module)}
        assert not loaded & {"aiohttp", "redis", "router", "state", "sim", "bench", "asyncio"}, (
            module
        )


def test_state_knows_nothing_of_http_or_the_router() -> None:
    for module in ["state"] + _modules("state"):
        loaded = {m.split(".")[0] for m in _imported_after(module)}
        assert not loaded & {"aiohttp", "router", "sim", "bench"}, module


def test_bench_is_a_pure_client() -> None:
    for module in ["bench"] + _modules("bench"):
        loaded = {m.split(".")[0] for m in _imported_after(module)}
        assert not loaded & {"router", "state", "sim"}, module


def test_every_module_imports_on_its_own() -> None:
    for package in ("router", "policies", "state", "sim", "bench"):
        for module in [package] + _modules(package):
            _imported_after(module)
