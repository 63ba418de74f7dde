"""The serve entry freezes the start-up heap and makes full collections rarer once serving
(router/edge/serve_cli.py `_freeze_startup_heap`, issue 24: the GC pause tail). Not timed: it checks
that the settings are applied."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.edge import serve_cli


@pytest.fixture
def restore_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_serve_freezes_the_start_up_heap_once_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_gc: None
) -> None:
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(
        "model: m\n"
        "workers:\n"
        "  - {id: p0, url: 'http://127.0.0.1:9', role: prefill}\n"
        "  - {id: d0, url: 'http://127.0.0.1:10', role: decode, kv_blocks: 100}\n"
    )
    seen: dict[str, Any] = {}

    async def fake_run(app: Any, host: str, port: int, **kw: Any) -> None:
        seen["before"] = (gc.get_freeze_count(), gc.get_threshold())
        kw["on_ready"]([("127.0.0.1", port)])  # what the real runner calls once listening
        seen["after"] = (gc.get_freeze_count(), gc.get_threshold())

    gen0, gen1, _ = gc.get_threshold()
    gc.unfreeze()
    monkeypatch.setattr(serve_cli, "run_app_until_signal", fake_run)
    assert serve_cli.main(["serve", "--config", str(cfg), "--port", "1"]) == 0
    assert seen["before"][0] == 0  # nothing frozen before the server is up
    frozen, threshold = seen["after"]
    assert frozen > 1000  # the modules and the app built at start-up
    assert threshold == (gen0, gen1, serve_cli.GC_GEN2_EVERY)
