"""docs/configuration.md is the settings model's own account of itself: regenerated, it must not
change, and every setting must carry the line that explains it."""

from __future__ import annotations

import dataclasses

from disagg_tools.launcher.config_doc import COMMAND, PAGE, render
from router.config import GROUPS, Settings
from router.config_renames import RENAMED


def test_configuration_page_is_generated_from_the_settings() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert page == render(), f"docs/configuration.md is stale: run `{COMMAND}`"


def test_every_setting_has_a_doc_and_every_group_a_table() -> None:
    for cls in (Settings, *GROUPS.values()):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"
    page = render()
    for group, cls in GROUPS.items():
        assert f"## `{group}:`" in page
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in page.split(f"## `{group}:`")[1], (group, f.name)
    for old, (group, name) in RENAMED.items():
        assert f"| `{old}` | `{group}.{name}` |" in page


def test_about_25_names_at_the_top_level() -> None:
    keys = {f.metadata.get("key", f.name) for f in dataclasses.fields(Settings)} - {""}
    # 26 after the grouping, + `discovery:` (issue 34: the Helm chart renders it top-level),
    # + `lora:` (issue 35: the adapters' catalog, docs/lora.md).
    assert len(keys) <= 28, sorted(keys)
