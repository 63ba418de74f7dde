"""What a pod document says about its worker (router/workers/kube/pods.py), and the back-off
of the list-watch: pure functions over the API's documents (the stand-in's, disagg_tools/kubeapi
objects.py, built as the API types are)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from disagg_tools.kubeapi.objects import PodSpec, pod_object, set_ready
from router.config import load_settings
from router.settings_groups import DiscoverySettings
from router.workers.kube.listwatch import Backoff
from router.workers.kube.pods import in_rotation, ready, registration, terminating


def _settings(**raw: Any) -> DiscoverySettings:
    base = {"kind": "kubernetes", "decode_selector": "role=decode"}
    return load_settings(None, overrides={"discovery": {**base, **raw}}).discovery


def _pod(**kw: Any) -> dict[str, Any]:
    doc = pod_object(PodSpec(**{"name": "w-0", "namespace": "llm", **kw}))
    doc["metadata"]["resourceVersion"] = "7"
    return doc


def test_readiness_follows_the_ready_condition_and_the_deletion() -> None:
    pod = _pod()
    assert ready(pod) and in_rotation(pod) and not terminating(pod)
    assert not in_rotation(set_ready(pod, False))
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert ready(pod) and terminating(pod) and not in_rotation(pod)
    assert not ready(_pod(phase="Pending"))


@pytest.mark.parametrize(
    ("kw", "settings", "port"),
    [
        ({"ports": {"http": 8100}}, {}, 8100),  # the named port first
        ({"ports": {"http": 8100}, "annotations": {"disagg-router.io/port": "9"}}, {}, 8100),
        ({"annotations": {"disagg-router.io/port": "8300"}}, {}, 8300),  # then the annotation
        ({}, {"role_ports": {"decode": 8200}}, 8200),  # then the role's number
        ({}, {}, 8000),  # then the port
        ({"ports": {"http": 8100}}, {"port_name": "", "port": 30000}, 30000),  # the peers' flag
    ],
)
def test_the_engine_port(kw: dict[str, Any], settings: dict[str, Any], port: int) -> None:
    raw = registration(_pod(pod_ip="10.1.2.3", **kw), "decode", _settings(**settings))
    assert raw is not None and raw["url"] == f"http://10.1.2.3:{port}"


def test_a_registration_from_a_pod() -> None:
    pod = _pod(
        pod_ip="fd00::5",
        labels={"pod-template-hash": "5d9c", "model": "qwen"},
        annotations={
            "sglang.ai/bootstrap-port": "8998",
            "disagg-router.io/kv-layout": orjson.dumps({"dtype": "fp8"}).decode(),
        },
        ports={"http": 30000, "kv-events": 5557, "kv-replay": 5558},
    )
    d = _settings(adapter="sglang", model_label="model", kv_events_topic="kv", kv_blocks=99)
    raw = registration(pod, "prefill", d)
    assert raw == {
        "id": "w-0",
        "url": "http://[fd00::5]:30000",
        "role": "prefill",
        "adapter": "sglang",
        "pod": "llm/w-0",
        "revision": "5d9c",
        "bootstrap_port": 8998,
        "kv_events": {
            "endpoint": "tcp://[fd00::5]:5557",
            "replay_endpoint": "tcp://[fd00::5]:5558",
            "topic": "kv",
        },
        "layout": {"dtype": "fp8", "model": "qwen"},
    }
    decode = registration(pod, "decode", d)
    assert decode is not None and "bootstrap_port" not in decode and decode["kv_blocks"] == 99
    assert registration(_pod(pod_ip=None), "decode", d) is None  # no address yet
    revision = registration(_pod(labels={"rev": "v2"}), "decode", _settings(revision_label="rev"))
    assert revision is not None and revision["revision"] == "v2"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_malformed_layout_annotation_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="disagg-router.io/kv-layout"):
        registration(_pod(annotations={"disagg-router.io/kv-layout": text}), "decode", _settings())


def test_backoff_doubles_with_jitter_up_to_its_most() -> None:
    low, high = Backoff(1.0, 8.0, rand=lambda: 0.0), Backoff(1.0, 8.0, rand=lambda: 1.0)
    assert [low.delay() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert [high.delay() for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert low.delay(at_least=6.0) == 6.0  # a 429's Retry-After, when longer
    assert high.delay(at_least=60.0) == 8.0  # never past the most
    high.reset()
    assert high.delay() == 1.0
