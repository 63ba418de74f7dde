"""The `lora` settings group: the adapters the router may load on demand, and how it loads them
(docs/lora.md). Kept apart from router/settings_groups.py: one concept, one module.

    lora:
      catalog:                      # adapter name -> where a worker loads it from
        sql-expert: {path: /loras/sql, base_model: llama-3-8b}
        chat-fr: /loras/chat-fr     # a bare path: the base model is the first served model
      load_s: 0.5                   # what a load is expected to cost (the placement cost model)
      load_timeout_s: 30            # a load not done by then fails that request (503)
      poll_s: 5                     # how often each LoRA worker's /v1/models is read

An adapter name is a model name a client sends: 1-256 printable characters, no spaces. The
router never builds a path from a client's name: a path comes only from this catalog.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.settings_groups import setting
from router.worker_spec import ConfigError

__all__ = ["LoraEntry", "LoraSettings", "valid_lora_name"]

MAX_CATALOG = 100_000


def valid_lora_name(name: object) -> bool:
    """A name the router will keep (from the catalog, or a worker's /v1/models)."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 256
        and not any(ch.isspace() or not ch.isprintable() for ch in name)
    )


@dataclass(frozen=True, slots=True)
class LoraEntry:
    """One catalog adapter: the path an engine loads it from, and its base model ("" = the
    first served model)."""

    path: str
    base_model: str = ""


def _entry(name: str, raw: Any) -> LoraEntry:
    if isinstance(raw, LoraEntry):
        return raw
    if isinstance(raw, str):
        raw = {"path": raw}
    if not isinstance(raw, Mapping) or set(raw) - {"path", "base_model"}:
        raise ConfigError(f"lora.catalog.{name}: expected a path or {{path, base_model}}")
    path, base = raw.get("path"), raw.get("base_model", "")
    if not isinstance(path, str) or not 0 < len(path) <= 4096:
        raise ConfigError(f"lora.catalog.{name}.path: expected a non-empty string")
    if not isinstance(base, str) or len(base) > 256:
        raise ConfigError(f"lora.catalog.{name}.base_model: expected a model name")
    return LoraEntry(path, base)


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """LoRA adapters (docs/lora.md): a request whose `model` names an adapter is placed only on a
    (prefill, decode) pair whose both sides hold it or may load it."""

    catalog: Mapping[str, LoraEntry] = setting(
        doc="adapter name -> {path, base_model} (or a bare path): the adapters the router may "
        "load on a worker with lora_runtime_loading (docs/lora.md)",
        factory=dict,
    )
    load_s: float = setting(0.5, doc="seconds a load is expected to take: placement's cost of it")
    load_timeout_s: float = setting(
        30.0,
        doc="a load not done by then fails its request with a 503 (the worker stays in rotation)",
    )
    poll_s: float = setting(5.0, doc="how often each LoRA worker's /v1/models is read")

    def __post_init__(self) -> None:
        if not isinstance(self.catalog, Mapping) or len(self.catalog) > MAX_CATALOG:
            raise ConfigError(f"lora.catalog: a mapping of at most {MAX_CATALOG} adapters")
        catalog: dict[str, LoraEntry] = {}
        for name, raw in self.catalog.items():
            if not valid_lora_name(name):
                raise ConfigError(
                    f"lora.catalog: {name!r} is not an adapter name (1-256 printable "
                    "characters, no spaces)"
                )
            catalog[name] = _entry(name, raw)
        object.__setattr__(self, "catalog", catalog)
        if self.load_s < 0 or self.load_timeout_s <= 0 or self.poll_s <= 0:
            raise ConfigError("lora: load_s must be >= 0, load_timeout_s and poll_s > 0")
