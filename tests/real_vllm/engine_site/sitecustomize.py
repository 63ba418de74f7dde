"""Imported at start-up by every Python process of the vLLM engines these tests start (their
PYTHONPATH leads here), never by the router or the tests.

NIXL's Python agent (nixl 1.5.1) hard-codes its UCX progress thread's poll timeout to zero
(`pthrDelay = 0`): the thread spins on poll() and takes a whole core per engine, idle or not.
Three engines on a 2-core machine then leave the engines' own threads starved — steps and KV
pulls that stalled for minutes. With a timeout the thread sleeps in poll() until UCX signals
work (it watches the UCX workers' event fds), so transfers are not delayed; the timeout is
only NIXL's periodic fallback wake-up. Set by REAL_VLLM_NIXL_POLL_US (microseconds, 0 = leave
NIXL as it is)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api", "nixl._api")


def _delay_us() -> int:
    try:
        return int(os.environ.get("REAL_VLLM_NIXL_POLL_US", "0"))
    except ValueError:
        return 0


class _Bindings(types.ModuleType):
    """The NIXL bindings module, with agent configurations given a poll timeout."""

    def __init__(self, real: types.ModuleType, delay_us: int) -> None:
        super().__init__(real.__name__)
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (NIXL's name)
        if getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            load(module)
            real = getattr(module, "nixlBind", None)
            if isinstance(real, types.ModuleType) and not isinstance(real, _Bindings):
                module.nixlBind = _Bindings(real, _delay_us())

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _delay_us() > 0:
    sys.meta_path.insert(0, _Finder())
