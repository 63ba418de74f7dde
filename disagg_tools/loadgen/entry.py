"""What every loadgen command does around its run: raise the open-file limit for its crowd,
run it on uvloop, print and write its report, exit non-zero on a violated invariant, and name
the commit its numbers measure."""

from __future__ import annotations

import json
import resource
import subprocess
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from disagg_tools import uvrun

__all__ = ["git_commit", "raise_nofile", "run_and_report"]

# The repository (disagg_tools/loadgen/entry.py is three levels below it) and the product code
# in it, relative to it: the router, its store and policies, and the simulated worker.
_REPO = Path(__file__).resolve().parents[2]
_PRODUCT_CODE = ("router", "state", "policies", "disagg_tools/sim")


def raise_nofile(want: int = 65536) -> int:
    """Raise RLIMIT_NOFILE's soft limit towards `want` (up to the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def run_and_report(
    coro: Coroutine[Any, Any, dict[str, Any]],
    format_report: Callable[[dict[str, Any]], str],
    *,
    workdir: Path | None,
    json_path: Path | None,
) -> int:
    """Run `coro` on uvloop when it is installed (the router's own loop), print the report,
    write it as JSON if asked; the exit code says whether any invariant was violated."""
    report = uvrun.run(coro)
    print(format_report(report))
    if workdir is not None:
        print(f"  logs            {workdir}")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    return 1 if report["violations"] else 0


def git_commit(path: Path | None = None) -> str:
    """HEAD, and the last commit that changed the product code (what the numbers measure)."""
    root = str(path or _REPO)
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        last = subprocess.run(
            ["git", "-C", root, "log", "-1", "--format=%h", "--abbrev=12", "--", *_PRODUCT_CODE],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", *_PRODUCT_CODE],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head.stdout.strip()} (code {last.stdout.strip()}{'+dirty' if dirty else ''})"
