"""What the router keeps of LoRA adapters (router/workers/loras.py, router/lora_settings.py):
only what an engine's /v1/models says in vLLM's shape, bounded; the cost of serving an adapter
on a worker; the catalog's checks."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import settings_from_mapping
from router.worker_spec import ConfigError
from router.workers.loras import MAX_PER_ENGINE, LoraBook, adapters_of

BASE = "llama-3-8b"


def _settings(catalog: dict[str, Any] | None = None, **worker: Any) -> Any:
    entry = {"id": "d0", "url": "http://127.0.0.1:1", "role": "decode", "kv_blocks": 64, **worker}
    return settings_from_mapping(
        {"model": BASE, "workers": [entry], "lora": {"catalog": catalog or {}, "load_s": 0.4}}
    )


def test_only_cards_with_a_parent_in_vllm_s_shape_are_adapters() -> None:
    models = {
        "object": "list",
        "data": [
            {"id": BASE, "parent": None},
            {"id": "sql", "parent": BASE},
            {"id": "bad name", "parent": BASE},  # a space: no model name the router keeps
            {"id": "x" * 300, "parent": BASE},  # too long
            {"id": 7, "parent": BASE},
            {"id": "odd", "parent": ["not", "a", "name"]},
            "not a card",
            {"id": "self", "parent": "self"},
        ],
    }
    assert adapters_of(models) == {"sql": BASE}
    assert adapters_of({"data": "nope"}) == {} and adapters_of(["x"]) == {}
    many = {"data": [{"id": f"a{i}", "parent": BASE} for i in range(MAX_PER_ENGINE + 500)]}
    assert len(adapters_of(many)) == MAX_PER_ENGINE


def test_the_cost_of_an_adapter_on_a_worker() -> None:
    s = _settings({"fr": "/loras/fr"}, max_loras=1, lora_runtime_loading=True)
    book, spec = LoraBook(s), s.workers[0]
    assert book.known("fr") == BASE and book.known("nope") is None and book.known(BASE) is None
    assert book.load_cost_s(spec, "fr") == 0.4  # may load it
    assert book.load_cost_s(spec, "sql") is None  # neither holds nor may load: never placed
    book.learned(spec, {"data": [{"id": "sql", "parent": BASE}]})
    assert book.load_cost_s(spec, "sql") == 0.0
    assert book.load_cost_s(spec, "fr") == 0.8  # at max_loras: the one it displaces reloads
    assert book.adapters() == {"fr": BASE, "sql": BASE}
    off = _settings({"fr": "/loras/fr"}).workers[0]  # max_loras 0: serves no adapter
    book.learned(off, {"data": [{"id": "sql", "parent": BASE}]})
    assert book.load_cost_s(off, "sql") is None and book.load_cost_s(off, "fr") is None


@pytest.mark.parametrize(
    ("catalog", "error"),
    [
        ({"has space": "/p"}, "not an adapter name"),
        ({"a": ""}, "path"),
        ({"a": {"path": "/p", "rank": 8}}, "expected a path"),
        ({"a": 5}, "expected a path"),
    ],
)
def test_a_bad_catalog_is_a_config_error(catalog: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        _settings(catalog)


def test_bad_worker_lora_keys_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="max_loras"):
        _settings(max_loras=-1)
    with pytest.raises(ConfigError, match="lora_runtime_loading"):
        _settings(lora_runtime_loading="yes")
