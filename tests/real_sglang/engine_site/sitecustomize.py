"""Imported at start-up by every Python process of the SGLang engines the real-SGLang tests
start (their PYTHONPATH leads here, beside the `sgl_kernel` stand-in), never by the router or
the tests. Nothing installed is edited: the change is made to the loaded module.

Mooncake's KV sender on CPU. `sglang/srt/disaggregation/mooncake/conn.py` declares
`MooncakeKVSender.supports_host_tensor_indices = True`, and the prefill scheduler
(`sglang/srt/disaggregation/prefill.py`, where it sends a chunk's KV) then copies the page
indices to pinned host memory and records a `torch.cuda.Event` for the transfer thread to wait
on — a CUDA call, which fails on a CPU-only machine. On CPU the indices already live in host
memory, so the sender is told it does not take that path, and the scheduler takes its other
branch (`kv_to_page_indices`, the indices handed over as they are). Delete this the day SGLang
sets the flag from the device."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

_MODULE = "sglang.srt.disaggregation.mooncake.conn"


def _patch(module: types.ModuleType) -> None:
    sender = getattr(module, "MooncakeKVSender", None)
    if sender is not None:
        sender.supports_host_tensor_indices = False


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self._real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._real.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
