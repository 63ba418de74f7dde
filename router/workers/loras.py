"""LoRA adapters as placement sees them: which adapters each worker holds, which it may load,
and the loads themselves (docs/lora.md).

Facts come from the engines: every `lora.poll_s` the router reads `/v1/models` of each worker
whose entry says it serves adapters (`max_loras` > 0; while no worker does, the poll sleeps
without a timer); a card with a `parent` is an adapter registered there (vLLM's
`OpenAIServingModels.show_available_models`). The catalog (`lora.catalog`,
router/lora_settings.py) names the adapters the router may load itself, on a worker with
`lora_runtime_loading`, through vLLM's `POST /v1/load_lora_adapter`.

Held adapters are kept per URL, not per worker id: the data-parallel ranks of one engine share
its API server, which registers an adapter for every rank.

    known(model)            the base model of adapter `model`, None: not an adapter
    load_cost_s(spec, a)    0 where `a` is held, `lora.load_s` (more on a worker already at
                            max_loras) where it may be loaded, None where neither: placement
                            never puts the request there
    ensure(session, spec, a) before the prefill leg: load `a` unless held; one load at a time
                            per engine, bounded by `lora.load_timeout_s`; a failure raises
                            `Unavailable` (503, Retry-After) for that request only — no breaker
                            is charged, the worker stays good for its base model and others

Memory: the names kept are what the engines list (at most `MAX_PER_ENGINE` each) and the
catalog; a client's unknown name is looked up, never stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp

from router.config import Settings
from router.errors import Unavailable
from router.loop_timing import beat
from router.lora_settings import valid_lora_name
from router.worker_spec import WorkerSpec
from router.workers.membership import Membership

__all__ = ["LoraBook", "MAX_PER_ENGINE"]

log = logging.getLogger(__name__)

MAX_PER_ENGINE = 10_000  # adapters kept per engine; beyond this an engine's list is cut
LOAD_RETRY_AFTER_S = 2.0


def adapters_of(models: Any) -> dict[str, str]:
    """The adapters of one `/v1/models` answer: name -> parent (its base model)."""
    data = models.get("data") if isinstance(models, Mapping) else None
    out: dict[str, str] = {}
    for card in data if isinstance(data, list) else ():
        if not isinstance(card, Mapping):
            continue
        name, parent = card.get("id"), card.get("parent")
        if not (isinstance(name, str) and isinstance(parent, str)):
            continue
        if valid_lora_name(name) and valid_lora_name(parent) and name != parent:
            out[name] = parent
            if len(out) >= MAX_PER_ENGINE:
                break
    return out


class LoraBook:
    """Every engine's adapters, the catalog, and the loads on demand."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._default_base = settings.models[0]
        self._held: dict[str, dict[str, str]] = {}  # engine URL -> {adapter: base model}
        self._locks: dict[str, asyncio.Lock] = {}
        self._known: dict[str, str] | None = None  # adapters(), until what is held changes
        self.loads = 0
        self.load_failures = 0
        self.rounds = 0  # passes of `run`: one at its start, then one per wake-up

    def __repr__(self) -> str:
        held = sum(len(a) for a in self._held.values())
        return f"LoraBook({held} held on {len(self._held)} engines, {self.loads} loads)"

    # -- what is known ----------------------------------------------------------------------

    def known(self, model: str) -> str | None:
        """The base model of adapter `model`; None when `model` is no adapter the router knows
        (a base model, or an unknown name)."""
        return self.adapters().get(model)

    def adapters(self) -> dict[str, str]:
        """Every adapter known (catalog and engines): name -> base model. Built again only
        after what the engines hold changed (a request asks it twice: its parse, its place)."""
        if self._known is None:
            out = {
                name: entry.base_model or self._default_base
                for name, entry in self._settings.lora.catalog.items()
            }
            for held in self._held.values():
                for name, base in held.items():
                    out.setdefault(name, base)
            self._known = out
        return self._known

    def held_by(self, spec: WorkerSpec) -> dict[str, str]:
        return dict(self._held.get(spec.url, {}))

    def holds(self, spec: WorkerSpec, adapter: str) -> bool:
        return spec.max_loras > 0 and adapter in self._held.get(spec.url, ())

    def may_load(self, spec: WorkerSpec, adapter: str) -> bool:
        return (
            spec.max_loras > 0
            and spec.lora_runtime_loading
            and adapter in self._settings.lora.catalog
        )

    def load_cost_s(self, spec: WorkerSpec, adapter: str) -> float | None:
        """What serving `adapter` on this worker costs before its prefill can start: 0 held, a
        load where it may load one (twice that on an engine already holding max_loras: the
        adapter it displaces will be loaded again), None where it can do neither."""
        if self.holds(spec, adapter):
            return 0.0
        if not self.may_load(spec, adapter):
            return None
        load_s = self._settings.lora.load_s
        full = len(self._held.get(spec.url, ())) >= spec.max_loras
        return 2 * load_s if full else load_s

    # -- learning from the engines ---------------------------------------------------------

    def learned(self, spec: WorkerSpec, models: Any) -> None:
        """A `/v1/models` answer of this worker: its adapters now."""
        held = adapters_of(models)
        if held != self._held.get(spec.url):
            self._held[spec.url] = held
            self._known = None

    def forget_others(self, specs: Iterable[WorkerSpec]) -> None:
        """Drop what is kept of engines no longer among the workers."""
        urls = {s.url for s in specs}
        for url in list(self._held):
            if url not in urls:
                del self._held[url]
                self._locks.pop(url, None)
                self._known = None

    async def poll(self, session: aiohttp.ClientSession, spec: WorkerSpec) -> None:
        timeout = aiohttp.ClientTimeout(total=self._settings.loops.health_timeout_s)
        try:
            async with session.get(
                spec.url + "/v1/models", headers=_auth(spec), timeout=timeout
            ) as resp:
                if resp.status != 200:
                    return
                self.learned(spec, await resp.json(content_type=None))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.debug("adapters of %s not read: %s", spec.id, exc)

    async def refresh(self, session: aiohttp.ClientSession, specs: Iterable[WorkerSpec]) -> None:
        """One read of every LoRA engine's adapters (one per URL: ranks share it)."""
        engines = {s.url: s for s in specs if s.max_loras > 0}
        await asyncio.gather(*(self.poll(session, s) for s in engines.values()))

    async def run(self, session: aiohttp.ClientSession, members: Membership) -> None:
        """Every `lora.poll_s`, on the pools' beat (router/loop_timing.py), while some worker
        serves adapters (`max_loras` > 0). While none does, the loop has no timer at all: the
        first such worker to join (configuration, admin API, registry, discovery) wakes it, and
        it is read within `lora.poll_s` of entering rotation, as every LoRA engine is. What an
        engine out of rotation (failing its health probes) held is forgotten: one that comes
        back may be a new process without its adapters: it is read again at the next poll."""
        joined = asyncio.Event()
        members.on_join(lambda spec: joined.set() if spec.max_loras > 0 else None)
        while True:
            self.rounds += 1
            workers = list(members.workers.values())
            if not any(w.spec.max_loras > 0 for w in workers):
                self.forget_others(())
                joined.clear()
                await joined.wait()
                continue
            specs = [w.spec for w in workers if w.healthy]
            self.forget_others(specs)
            await self.refresh(session, specs)
            # On the pools' beat: with `poll_s` a whole number of seconds, a wake-up the other
            # loops make anyway, not one of its own.
            await beat(self._settings.lora.poll_s)

    # -- loading on demand -----------------------------------------------------------------

    async def ensure(self, session: aiohttp.ClientSession, spec: WorkerSpec, adapter: str) -> None:
        """`adapter` on this worker before a leg goes there: loaded unless held. Raises
        `Unavailable` (503) when it cannot be: the request fails, the worker is not blamed."""
        if self.holds(spec, adapter):
            return
        entry = self._settings.lora.catalog.get(adapter)
        if entry is None or not self.may_load(spec, adapter):
            raise self._failed(spec, adapter, "the worker does not hold it and may not load it")
        limit = self._settings.lora.load_timeout_s
        lock = self._locks.setdefault(spec.url, asyncio.Lock())
        try:
            async with asyncio.timeout(limit), lock:
                if self.holds(spec, adapter):  # loaded by the request before us
                    return
                body = {"lora_name": adapter, "lora_path": entry.path}
                async with session.post(
                    spec.url + "/v1/load_lora_adapter", json=body, headers=_auth(spec)
                ) as resp:
                    text = (await resp.text())[:300]
                if resp.status != 200 and not (
                    resp.status == 400 and "already been loaded" in text
                ):
                    # The engine's words go to the log only (they may name its paths).
                    log.warning("load of %r on %s: %s %s", adapter, spec.id, resp.status, text)
                    raise self._failed(spec, adapter, f"the engine answered {resp.status}")
                self.loads += 1
                held = self._held.setdefault(spec.url, {})
                held[adapter] = entry.base_model or self._default_base
                self._known = None
        except TimeoutError as exc:
            raise self._failed(spec, adapter, f"not loaded within {limit} s") from exc
        except aiohttp.ClientError as exc:
            raise self._failed(spec, adapter, f"the load request failed: {exc!r}") from exc

    def _failed(self, spec: WorkerSpec, adapter: str, why: str) -> Unavailable:
        self.load_failures += 1
        log.warning("LoRA adapter %r on worker %s: %s", adapter, spec.id, why)
        return Unavailable(
            f"the LoRA adapter '{adapter}' could not be loaded on worker {spec.id}: {why}",
            retry_after_s=LOAD_RETRY_AFTER_S,
        )


def _auth(spec: WorkerSpec) -> dict[str, str]:
    return {"Authorization": f"Bearer {spec.api_key.reveal()}"} if spec.api_key else {}
