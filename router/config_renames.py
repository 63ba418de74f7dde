"""Settings that moved into groups (issue 34), still accepted under their old names for one
release: a flat key of the file (`redis_url: ...`) or its environment variable
(`DISAGG_ROUTER_REDIS_URL`) lands on its new place (`store: {url: ...}`,
`DISAGG_ROUTER_STORE_URL`) with one warning line naming the new name. An old name and its new
one both given, with different values, in the same source is a ConfigError: which one was meant
cannot be told.

The drop-in command-line flags (`--redis-url`, ...) are the peers' names (vllm-router,
sglang-router) and are not deprecated: router/edge/serve_cli.py maps them to the new fields.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

from router.worker_spec import ConfigError

__all__ = ["ENV_PREFIX", "OLD_ENV", "RENAMED", "env_name", "move_old_env", "move_old_keys"]

log = logging.getLogger("router.config")

ENV_PREFIX = "DISAGG_ROUTER_"

# old top-level key -> (group, field)
RENAMED: dict[str, tuple[str, str]] = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "listen_backlog": ("server", "listen_backlog"),
    "max_body_bytes": ("server", "max_body_bytes"),
    "shutdown_grace_s": ("server", "shutdown_grace_s"),
    "redis_url": ("store", "url"),
    "key_prefix": ("store", "key_prefix"),
    "redis_max_connections": ("store", "max_connections"),
    "redis_pool_timeout_s": ("store", "pool_timeout_s"),
    "api_keys": ("auth", "api_keys"),
    "admin_token": ("auth", "admin_token"),
    "admin_read_token": ("auth", "admin_read_token"),
    "forward_client_auth": ("auth", "forward_client_auth"),
    "public_metrics": ("auth", "public_metrics"),
    "public_openapi": ("auth", "public_openapi"),
    "state_refresh_s": ("loops", "state_refresh_s"),
    "health_interval_s": ("loops", "health_interval_s"),
    "health_idle_interval_s": ("loops", "health_idle_interval_s"),
    "health_timeout_s": ("loops", "health_timeout_s"),
    "histogram_refresh_s": ("loops", "histogram_refresh_s"),
    "stranded_reap_s": ("loops", "stranded_reap_s"),
    "registry_refresh_s": ("loops", "registry_refresh_s"),
    "load_poll_s": ("loops", "load_poll_s"),
    "load_max_age_s": ("loops", "load_max_age_s"),
    "reservation_lease_s": ("leases", "reservation_s"),
    "kv_lease_s": ("leases", "kv_s"),
    "upstream_connections": ("upstream", "connections"),
    "relay": ("upstream", "relay"),
    "forward_headers": ("upstream", "forward_headers"),
    "assemble_non_streaming": ("upstream", "assemble_non_streaming"),
    "estimator": ("estimates", "estimator"),
    "estimator_args": ("estimates", "estimator_args"),
    "trust_hints": ("estimates", "trust_hints"),
    "chars_per_token": ("estimates", "chars_per_token"),
    "tokenizers": ("estimates", "tokenizers"),
    "overrun_margin_half_life_s": ("overruns", "margin_half_life_s"),
    "overrun_margin_max_share": ("overruns", "margin_max_share"),
    "max_n": ("api", "max_n"),
    "responses_split": ("api", "responses_split"),
    "fairness": ("admission", "fairness"),
    "fairness_args": ("admission", "fairness_args"),
}

# The old names the environment was read under (before the groups every scalar had its own).
OLD_ENV: tuple[str, ...] = (
    "host",
    "port",
    "redis_url",
    "key_prefix",
    "estimator",
    "max_body_bytes",
    "reservation_lease_s",
    "relay",
    "redis_max_connections",
)

_UNTIL = "(accepted until the next release)"


def env_name(group: str | None, name: str) -> str:
    """The environment variable of a setting: DISAGG_ROUTER_<GROUP>_<FIELD>, or
    DISAGG_ROUTER_<FIELD> for a top-level one."""
    return ENV_PREFIX + (f"{group}_{name}" if group else name).upper()


def _as_mapping(group: str, section: Any) -> dict[str, Any]:
    if section is None:
        return {}
    if isinstance(section, Mapping):
        return dict(section)
    if is_dataclass(section) and not isinstance(section, type):
        return {f.name: getattr(section, f.name) for f in fields(section)}
    raise ConfigError(f"{group}: must be a mapping of its settings, not {section!r}")


def move_old_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` (one source's top-level mapping) with each old flat key moved into its group."""
    out = dict(raw)
    for old, (group, name) in RENAMED.items():
        if old not in out:
            continue
        value = out.pop(old)
        section = _as_mapping(group, out.get(group))
        if name in section and section[name] != value:
            raise ConfigError(
                f"config: {old!r} (deprecated) and '{group}: {{{name}: ...}}' are both given, "
                f"with different values: keep only '{group}: {{{name}: ...}}'"
            )
        section[name] = value
        out[group] = section
        log.warning("config: %r is deprecated; use '%s: {%s: ...}' %s", old, group, name, _UNTIL)
    return out


def move_old_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with each old variable renamed to its new name (one warning each)."""
    out = dict(env)
    for old in OLD_ENV:
        old_var = env_name(None, old)
        value = out.pop(old_var, None)
        if value in (None, ""):
            continue
        new_var = env_name(*RENAMED[old])
        if out.get(new_var) not in (None, "", value):
            raise ConfigError(
                f"config: {old_var} (deprecated) and {new_var} are both set, with different "
                f"values: keep only {new_var}"
            )
        out[new_var] = str(value)
        log.warning("config: %s is deprecated; use %s %s", old_var, new_var, _UNTIL)
    return out
