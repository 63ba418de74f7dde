"""LoRA adapters on a simulated worker, as vLLM serves them (`--enable-lora`, `--max-loras`,
`--lora-modules name=path`, and with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True the runtime routes).

    GET  /v1/models                 the base model, then one card per registered adapter with
                                    `parent` = the base model and `root` = its path (vLLM's)
    POST /v1/load_lora_adapter      {lora_name, lora_path}: 200 text "Success: ...";
                                    400 both fields missing / already loaded; 404 no such path
    POST /v1/unload_lora_adapter    {lora_name}: 200 text; 404 "cannot be found"
    GET|POST /sim/lora              test hooks: the state; {"fail_loads": bool} fails every load

Without runtime loading the two routes answer FastAPI's plain 404 ({"detail": "Not Found"}), as
vLLM does when it never registered them.

Two sets, as in vLLM: *registered* adapters (listed, servable; vLLM keeps their LoRARequest and
reloads the weights from the path when needed) and *resident* ones, at most `max_loras`, held in
LRU order (vLLM's LRU adapter cache): a request under a registered adapter that is not resident
waits `load_s` (simulated) to swap it in, evicting the least recently used. A runtime load
registers the adapter and makes it resident, after `load_s`.

Every request under an adapter is counted per adapter (`requests`), so a test can assert from the
worker's own counters where adapter requests went.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .faults import error_body

__all__ = ["LoraConfig", "LoraState", "add_lora_routes", "parse_lora_modules"]

# Paths the simulated engine cannot find (vLLM: "No adapter found for <path>", a 404).
MISSING_PATH_MARK = "missing"


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """`enabled` = vLLM's --enable-lora; `modules` = --lora-modules (name, path) pairs loaded
    at start; `runtime_loading` = VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; `load_s` = simulated
    seconds a load (or a swap-in of a registered, non-resident adapter) takes."""

    enabled: bool = False
    max_loras: int = 1
    modules: tuple[tuple[str, str], ...] = ()
    runtime_loading: bool = False
    load_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.load_s < 0:
            raise ValueError("lora load_s must be >= 0")
        if self.modules and not self.enabled:
            raise ValueError("lora modules need --enable-lora")


def parse_lora_modules(items: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`name=path` items (vLLM's --lora-modules); a bare path is named after itself."""
    out: list[tuple[str, str]] = []
    for item in items or ():
        name, sep, path = item.partition("=")
        out.append((name, path) if sep else (item, item))
    return tuple(out)


class LoraState:
    """The adapters of one simulated worker."""

    def __init__(
        self, config: LoraConfig, base_model: str, time_factor: Callable[[], float]
    ) -> None:
        self.config = config
        self.base_model = base_model
        self._time_factor = time_factor
        self.registered: dict[str, tuple[str, int]] = {}  # name -> (path, lora_int_id)
        self.resident: OrderedDict[str, None] = OrderedDict()  # LRU, oldest first
        self.requests: Counter[str] = Counter()
        self.loads = 0  # runtime loads and swap-ins that took load_s
        self.evictions = 0
        self.fail_loads = False
        self._next_id = 0
        self._lock = asyncio.Lock()  # one load at a time, as the engine's add_lora
        for name, path in config.modules:
            self._register(name, path)
            self._make_resident(name)

    def serves(self, model: str) -> bool:
        return model in self.registered

    def event_key(self, name: str | None) -> tuple[str, int] | None:
        """(lora_name, lora_id) for the KV events of a request under `name` (sim.kv_events):
        vLLM names its blocks apart per adapter and says which in each BlockStored."""
        if name is None or name not in self.registered:
            return None
        return name, self.registered[name][1]

    def _register(self, name: str, path: str) -> None:
        self._next_id += 1
        self.registered[name] = (path, self._next_id)

    def _make_resident(self, name: str) -> None:
        self.resident.pop(name, None)
        self.resident[name] = None
        while len(self.resident) > self.config.max_loras:
            self.resident.popitem(last=False)
            self.evictions += 1

    async def _swap_in(self, name: str) -> None:
        self.loads += 1
        await asyncio.sleep(self.config.load_s * self._time_factor())
        self._make_resident(name)

    async def activate(self, name: str) -> None:
        """A request under `name` (registered) is about to run: swap it in if not resident."""
        self.requests[name] += 1
        if name in self.resident:
            self.resident.move_to_end(name)
            return
        async with self._lock:
            if name in self.resident:
                self.resident.move_to_end(name)
                return
            await self._swap_in(name)

    async def load(self, name: str, path: str) -> web.Response:
        if not name or not path:
            return _error(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if name in self.registered:
            return _error(
                400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
            )
        if self.fail_loads or MISSING_PATH_MARK in path:
            return _error(
                404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"
            )
        async with self._lock:
            if name in self.registered:  # a concurrent load of the same name won
                return _error(
                    400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
                )
            await self._swap_in(name)
            self._register(name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    def unload(self, name: str) -> web.Response:
        if not name:
            return _error(
                400,
                "either 'lora_name' and 'lora_int_id' needs to be provided.",
                "InvalidUserInput",
            )
        if name not in self.registered:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.registered[name]
        self.resident.pop(name, None)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": self.base_model,
                "max_model_len": None,
                "permission": [],
            }
            for name, (path, _) in self.registered.items()
        ]

    def describe(self) -> dict[str, Any]:
        return {
            "enabled": self.config.enabled,
            "max_loras": self.config.max_loras,
            "runtime_loading": self.config.runtime_loading,
            "registered": sorted(self.registered),
            "resident": list(self.resident),
            "requests": dict(self.requests),
            "loads": self.loads,
            "evictions": self.evictions,
            "fail_loads": self.fail_loads,
        }

    def __repr__(self) -> str:
        return f"LoraState({len(self.registered)} registered, {len(self.resident)} resident)"


def _error(status: int, message: str, err_type: str) -> web.Response:
    body = error_body(status, message)
    body["error"]["type"] = err_type  # type: ignore[index]
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def add_lora_routes(app: web.Application, state_of: Callable[[web.Application], LoraState]) -> None:
    """The runtime adapter routes and the test hook."""

    async def read(request: web.Request) -> dict[str, Any] | None:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return None
        return body if isinstance(body, dict) else None

    def not_there() -> web.Response:
        return web.Response(
            status=404, body=orjson.dumps({"detail": "Not Found"}), content_type="application/json"
        )

    async def load(request: web.Request) -> web.Response:
        state = state_of(request.app)
        if not (state.config.enabled and state.config.runtime_loading):
            return not_there()
        body = await read(request)
        if body is None:
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        name, path = body.get("lora_name"), body.get("lora_path")
        return await state.load(
            name if isinstance(name, str) else "", path if isinstance(path, str) else ""
        )

    async def unload(request: web.Request) -> web.Response:
        state = state_of(request.app)
        if not (state.config.enabled and state.config.runtime_loading):
            return not_there()
        body = await read(request)
        if body is None:
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        name = body.get("lora_name")
        return state.unload(name if isinstance(name, str) else "")

    async def hook(request: web.Request) -> web.Response:
        state = state_of(request.app)
        if request.method == "POST":
            body = await read(request) or {}
            if "fail_loads" in body:
                state.fail_loads = bool(body["fail_loads"])
        return web.Response(body=orjson.dumps(state.describe()), content_type="application/json")

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
    app.router.add_get("/sim/lora", hook)
    app.router.add_post("/sim/lora", hook)
