"""The settings' old flat names (before the groups) still load for one release: each lands on its
new field with one warning naming the new name; an old name and its new one given differently
is an error."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import ConfigError, Settings, load_settings, settings_from_mapping
from router.config_renames import OLD_ENV, RENAMED, env_name
from router.worker_spec import Secret

# A value for each old name, unlike its default, that its new field keeps as given.
SAMPLES: dict[str, Any] = {
    "host": "0.0.0.0",
    "port": 8123,
    "listen_backlog": 128,
    "max_body_bytes": 4096,
    "shutdown_grace_s": 3.0,
    "redis_url": "redis://127.0.0.1:6379/9",
    "key_prefix": "old:",
    "redis_max_connections": 7,
    "redis_pool_timeout_s": 2.5,
    "api_keys": ["k-old"],
    "admin_token": "t-admin",
    "admin_read_token": "t-read",
    "forward_client_auth": True,
    "public_metrics": False,
    "public_openapi": False,
    "state_refresh_s": 0.3,
    "health_interval_s": 0.7,
    "health_idle_interval_s": 9.0,
    "health_timeout_s": 1.5,
    "histogram_refresh_s": 2.5,
    "stranded_reap_s": 4.0,
    "registry_refresh_s": 5.0,
    "load_poll_s": 0.0,
    "load_max_age_s": 6.0,
    "reservation_lease_s": 11.0,
    "kv_lease_s": 12.0,
    "upstream_connections": 99,
    "relay": "aiohttp",
    "forward_headers": ["x-a"],
    "assemble_non_streaming": False,
    "estimator": "max_tokens",
    "estimator_args": {"q": 1},
    "trust_hints": True,
    "chars_per_token": 3.0,
    "tokenizers": {},
    "overrun_margin_half_life_s": 7.0,
    "overrun_margin_max_share": 0.5,
    "max_n": 4,
    "responses_split": False,
    "fairness": "vtc",
    "fairness_args": {"w": 2},
}


def _field(settings: Settings, group: str, name: str) -> Any:
    value = getattr(getattr(settings, group), name)
    if isinstance(value, tuple):
        return [str.__str__(v) if isinstance(v, Secret) else v for v in value]
    return str.__str__(value) if isinstance(value, Secret) else value


def test_the_samples_cover_every_old_name() -> None:
    assert set(SAMPLES) == set(RENAMED)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_key_lands_on_its_new_field_with_one_warning(
    old: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    group, name = RENAMED[old]
    path = tmp_path / "cluster.yaml"
    raw: dict[str, Any] = {"model": "m", old: SAMPLES[old]}
    if old.startswith("public_"):  # a closed endpoint needs a credential to accept
        raw["tenants"] = [{"name": "a", "keys": ["k-tenant"]}]
    path.write_text(yaml.safe_dump(raw))
    with caplog.at_level(logging.WARNING, logger="router.config"):
        settings = load_settings(path)
    assert _field(settings, group, name) == SAMPLES[old]
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert lines == [
        f"config: {old!r} is deprecated; use '{group}: {{{name}: ...}}' "
        "(accepted until the next release)"
    ]


@pytest.mark.parametrize("old", OLD_ENV)
def test_an_old_variable_lands_on_its_new_field_with_one_warning(
    old: str, caplog: pytest.LogCaptureFixture
) -> None:
    group, name = RENAMED[old]
    value = SAMPLES[old]
    with caplog.at_level(logging.WARNING, logger="router.config"):
        settings = load_settings(env={env_name(None, old): str(value)})
    assert _field(settings, group, name) == value
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert lines == [
        f"config: {env_name(None, old)} is deprecated; use {env_name(group, name)} "
        "(accepted until the next release)"
    ]


def test_old_and_new_given_differently_is_an_error() -> None:
    with pytest.raises(ConfigError, match="'redis_url' .* both given"):
        settings_from_mapping({"redis_url": "redis://a", "store": {"url": "redis://b"}})
    with pytest.raises(ConfigError, match="DISAGG_ROUTER_STORE_URL"):
        load_settings(
            env={"DISAGG_ROUTER_REDIS_URL": "redis://a", "DISAGG_ROUTER_STORE_URL": "redis://b"}
        )
    # The same value twice is only redundant.
    same = settings_from_mapping({"port": 9, "server": {"port": 9}})
    assert same.server.port == 9


def test_new_names_load_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    env = {"DISAGG_ROUTER_STORE_URL": "redis://e", "DISAGG_ROUTER_LOOPS_LOAD_POLL_S": "0"}
    with caplog.at_level(logging.WARNING, logger="router.config"):
        settings = load_settings(
            env=env, overrides={"server": {"port": 9, "host": None}, "policy": None}
        )
    assert not caplog.records
    assert settings.store.url == "redis://e" and settings.loops.load_poll_s == 0
    assert settings.server.port == 9 and settings.server.host == "127.0.0.1"
    keys = load_settings(env={"DISAGG_ROUTER_AUTH_API_KEYS": "k1, k2,"}).auth.api_keys
    assert [k.reveal() for k in keys] == ["k1", "k2"]  # a list: comma-separated
    with pytest.raises(ConfigError, match="DISAGG_ROUTER_AUTH_PUBLIC_METRICS"):
        load_settings(env={"DISAGG_ROUTER_AUTH_PUBLIC_METRICS": "maybe"})


def test_precedence_across_sources_is_not_a_conflict(tmp_path: Path) -> None:
    """The file's new name, the environment's old one: the environment wins, as it always did."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"store": {"url": "redis://file", "key_prefix": "f:"}}))
    settings = load_settings(path, env={"DISAGG_ROUTER_REDIS_URL": "redis://env"})
    assert settings.store.url == "redis://env" and settings.store.key_prefix == "f:"
