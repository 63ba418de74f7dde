"""The `discovery:` group: what the Helm chart renders loads, bad values are refused with the
setting's name, and the peers' discovery flags (vllm-router, sglang-router) set it."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import ConfigError, load_settings
from router.edge.dropin import load_serve_settings
from router.edge.serve_cli import build_parser


def _discovery(**raw: Any) -> Any:
    return load_settings(None, overrides={"discovery": raw}).discovery


def test_defaults_are_static() -> None:
    d = load_settings(None).discovery
    assert d.kind == "static" and not d.enabled and d.selectors() == {}


def test_the_charts_shape_loads() -> None:
    d = _discovery(
        kind="kubernetes",
        namespace="llm",
        source="endpointslices",
        prefill_selector="llm-d.ai/inference-serving=true,llm-d.ai/role=prefill",
        decode_selector="app in (vllm, sglang),tier!=cpu,!canary",
        adapter="sglang",
        port_name="",
        role_ports={"prefill": 8000, "decode": 8200},
        bootstrap_port_annotation="sglang.ai/bootstrap-port",
        kv_blocks=1000,
        backoff_s=0.5,
        backoff_max_s=5,
    )
    assert d.enabled and d.role_ports == {"prefill": 8000, "decode": 8200}
    assert set(d.selectors()) == {"prefill", "decode"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kind": "consul"}, "discovery.kind"),
        ({"kind": "kubernetes"}, "needs at least one of"),
        ({"prefill_selector": "app = a b"}, "discovery.prefill_selector"),
        ({"decode_selector": "app in (a"}, "discovery.decode_selector"),
        ({"source": "services"}, "discovery.source"),
        ({"role_ports": {"router": 80}}, "discovery.role_ports"),
        ({"role_ports": {"decode": 70000}}, "discovery.role_ports.decode"),
        ({"port": 0}, "discovery.port"),
        ({"kv_blocks": 0}, "discovery.kv_blocks"),
        ({"backoff_s": 2, "backoff_max_s": 1}, "backoff_max_s"),
        ({"selector": "a=b"}, "selector"),
    ],
)
def test_bad_values_name_the_setting(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _discovery(**raw)


def test_environment_sets_the_scalars() -> None:
    env = {
        "DISAGG_ROUTER_DISCOVERY_KIND": "kubernetes",
        "DISAGG_ROUTER_DISCOVERY_DECODE_SELECTOR": "role=decode",
        "DISAGG_ROUTER_DISCOVERY_DISCOVER_LAYOUT": "false",
        "DISAGG_ROUTER_DISCOVERY_BACKOFF_MAX_S": "4",
    }
    d = load_settings(None, env=env).discovery
    assert d.selectors() == {"decode": "role=decode"}
    assert d.discover_layout is False and d.backoff_max_s == 4.0


def _serve(*argv: str) -> Any:
    ns = build_parser().parse_args(["serve", *argv])
    return load_serve_settings(ns, env={}, overrides={}).discovery


def test_the_peers_discovery_flags() -> None:
    d = _serve(
        "--service-discovery",
        "--prefill-selector", "app=sglang", "component=prefill",
        "--decode-selector", "app=sglang", "component=decode",
        "--service-discovery-namespace", "prod",
        "--service-discovery-port", "30000",
        "--bootstrap-port-annotation", "example.io/bootstrap",
        "--pd-disaggregation",
    )  # fmt: skip
    assert d.kind == "kubernetes" and d.namespace == "prod"
    assert d.prefill_selector == "app=sglang,component=prefill"
    assert d.decode_selector == "app=sglang,component=decode"
    assert (d.port, d.port_name) == (30000, "")  # the peers' one port: no named port wins
    assert d.bootstrap_port_annotation == "example.io/bootstrap" and d.adapter == "sglang"
    plain = _serve("--service-discovery", "--selector", "app=vllm")
    assert plain.selectors() == {"both": "app=vllm"} and plain.adapter == "vllm"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode-selector", "a=b"], "needs --service-discovery"),
        (["--service-discovery"], "needs --prefill-selector"),
    ],
)
def test_discovery_flags_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _serve(*argv)
