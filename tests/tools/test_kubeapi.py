"""The stand-in Kubernetes API server (disagg_tools/kubeapi) against real clients.

kubectl 1.35 (scripts/install_k8s_tools.sh) and kubernetes_asyncio (the async port of the
official Python client) list and watch it; the raw-protocol tests pin the documented behaviour
the clients rely on (resourceVersion ordering, selector semantics, 410 after compaction, the
chunked JSON-lines stream, bookmarks), so a stand-in that gets one wrong fails here.
Loopback only; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from disagg_tools.kubeapi.kubeconfig import write_kubeconfig
from disagg_tools.kubeapi.selectors import SelectorError, parse_label_selector
from disagg_tools.kubeapi.server import KubeApiServer, KubeApiSettings, running_kubeapi
from disagg_tools.kubeapi.store import NotFound
from disagg_tools.kubeapi.watch import WatchSettings
from tests.paths import REPO

KUBECTL_HOME = Path(
    os.environ.get("K8S_TOOLS_HOME", Path.home() / ".cache" / "disagg-router" / "k8s-tools")
)
KUBECTL = KUBECTL_HOME / "bin" / "kubectl"
FAST = WatchSettings(bookmark_interval_s=0.2, too_large_wait_s=0.3)

Obj = dict[str, Any]


@pytest.fixture
async def api() -> AsyncIterator[KubeApiServer]:
    async with running_kubeapi(KubeApiSettings(history_size=50, watch=FAST)) as server:
        server.add_pod("decode-0", labels={"role": "decode", "gpu": "a100"}, ports={"http": 8000})
        server.add_pod("decode-1", labels={"role": "decode"}, ports={"http": 8000})
        server.add_pod("prefill-0", labels={"role": "prefill"}, ports={"http": 8001})
        server.add_pod("sidecar", labels={"app": "other"})
        server.add_pod("elsewhere", namespace="other", labels={"role": "decode"})
        yield server


@contextlib.asynccontextmanager
async def core_v1(server: KubeApiServer) -> AsyncIterator[client.CoreV1Api]:
    cfg = client.Configuration(host=server.url)
    async with client.ApiClient(cfg) as api_client:
        yield client.CoreV1Api(api_client)


def names(pods: Any) -> set[str]:
    return {p.metadata.name for p in pods.items}


def ready(pod: client.V1Pod) -> str:
    return next(c.status for c in pod.status.conditions if c.type == "Ready")


async def raw_events(url: str, *, until: int, within_s: float = 5.0) -> tuple[Any, list[Obj]]:
    """The first `until` events of a raw watch (or all of them when it ends first)."""
    out: list[Obj] = []
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        async with asyncio.timeout(within_s):
            while len(out) < until:
                line = await resp.content.readline()
                if not line:
                    break
                out.append(json.loads(line))
        return resp, out


# ── the client library: kubernetes_asyncio ────────────────────────────────────────────────────


async def test_the_client_lists_with_the_documented_label_selector_semantics(
    api: KubeApiServer,
) -> None:
    async with core_v1(api) as v1:

        async def sel(selector: str, **kw: Any) -> set[str]:
            return names(await v1.list_namespaced_pod("default", label_selector=selector, **kw))

        assert await sel("role=decode") == {"decode-0", "decode-1"}
        assert await sel("role==decode") == {"decode-0", "decode-1"}
        # != and notin also select the pods without the label at all.
        assert await sel("role!=decode") == {"prefill-0", "sidecar"}
        assert await sel("role notin (decode)") == {"prefill-0", "sidecar"}
        assert await sel("role in (decode, prefill)") == {"decode-0", "decode-1", "prefill-0"}
        assert await sel("gpu") == {"decode-0"}
        assert await sel("!gpu") == {"decode-1", "prefill-0", "sidecar"}
        assert await sel("role=decode,!gpu") == {"decode-1"}
        assert await sel("role") == {"decode-0", "decode-1", "prefill-0"}
        assert await sel("") == {"decode-0", "decode-1", "prefill-0", "sidecar"}
        every = await v1.list_pod_for_all_namespaces(label_selector="role=decode")
        assert names(every) == {"decode-0", "decode-1", "elsewhere"}
        by_name = await v1.list_namespaced_pod("default", field_selector="metadata.name=decode-1")
        assert names(by_name) == {"decode-1"}
        not_name = await v1.list_namespaced_pod("default", field_selector="metadata.name!=sidecar")
        assert names(not_name) == {"decode-0", "decode-1", "prefill-0"}
        for bad in ("role in ()", "role=", "role==a b", "=x", "role in (a"):
            if bad == "role=":
                continue  # `key=` is valid: the empty value
            with pytest.raises(ApiException) as e:
                await sel(bad)
            assert e.value.status == 400, bad
        assert await sel("role=") == set()
        with pytest.raises(ApiException) as e:
            await v1.list_namespaced_pod("default", field_selector="spec.unknown=x")
        assert e.value.status == 400 and "field label not supported" in e.value.body
        pod = await v1.read_namespaced_pod("decode-0", "default")
        assert pod.spec.containers[0].ports[0].name == "http"
        assert pod.status.pod_ip and ready(pod) == "True"
        with pytest.raises(ApiException) as e:
            await v1.read_namespaced_pod("nope", "default")
        assert e.value.status == 404 and json.loads(e.value.body)["reason"] == "NotFound"


async def test_the_client_watch_sees_added_modified_deleted_and_a_bookmark(
    api: KubeApiServer,
) -> None:
    async with core_v1(api) as v1:
        listed = await v1.list_namespaced_pod("default", label_selector="role=decode")
        start = listed.metadata.resource_version
        assert int(start) == api.store.rv  # the list carries the current resourceVersion

        async def churn() -> None:
            await asyncio.sleep(0.1)
            api.add_pod("decode-2", labels={"role": "decode"}, ports={"http": 8000})
            api.add_pod("prefill-9", labels={"role": "prefill"})  # filtered out
            api.set_ready("decode-2", False)
            api.terminate_pod("decode-2")
            api.delete_pod("decode-2")
            await asyncio.sleep(0.5)  # at least one bookmark interval with nothing new
            api.bookmark_now()

        seen: list[tuple[str, Any]] = []
        task = asyncio.create_task(churn())
        w = watch.Watch()
        stream = w.stream(
            v1.list_namespaced_pod,
            "default",
            label_selector="role=decode",
            resource_version=start,
            allow_watch_bookmarks=True,
            timeout_seconds=10,
        )
        async with asyncio.timeout(8):
            async for event in stream:
                seen.append((event["type"], event["object"]))
                kinds = [k for k, _ in seen]
                if "DELETED" in kinds and kinds[-1] == "BOOKMARK":
                    w.stop()
                    break
        await w.close()
        await task
        changes = [(k, o) for k, o in seen if k != "BOOKMARK"]
        assert [k for k, _ in changes] == ["ADDED", "MODIFIED", "MODIFIED", "DELETED"]
        assert all(o.metadata.name == "decode-2" for _, o in changes)
        assert ready(changes[0][1]) == "True" and ready(changes[1][1]) == "False"
        assert changes[1][1].metadata.deletion_timestamp is None
        assert changes[2][1].metadata.deletion_timestamp is not None  # Terminating
        versions = [int(o.metadata.resource_version) for _, o in changes]
        assert versions == sorted(versions) and len(set(versions)) == 4
        assert versions[0] > int(start)
        # prefill-9's change is skipped but counted: the DELETED comes two versions after ADDED+1.
        assert versions[-1] == api.store.rv
        bookmark = seen[-1][1]
        assert bookmark["metadata"] == {"resourceVersion": str(api.store.rv)}
        assert w.resource_version == str(api.store.rv)  # the client resumes from the bookmark


async def test_a_watch_from_a_compacted_version_is_410_to_the_client(api: KubeApiServer) -> None:
    async with core_v1(api) as v1:
        old = (await v1.list_namespaced_pod("default")).metadata.resource_version
        api.add_pod("decode-7", labels={"role": "decode"})
        api.compact()
        with pytest.raises(ApiException) as e:
            async with asyncio.timeout(5):
                async for _ in watch.Watch().stream(
                    v1.list_namespaced_pod, "default", resource_version=old, timeout_seconds=5
                ):
                    pass
        assert e.value.status == 410 and "Expired" in str(e.value.reason)
        # The documented recovery: a fresh list, then a watch from its version works.
        fresh = (await v1.list_namespaced_pod("default")).metadata.resource_version
        api.delete_pod("decode-7")
        w = watch.Watch()
        async with asyncio.timeout(5):
            async for event in w.stream(
                v1.list_namespaced_pod, "default", resource_version=fresh, timeout_seconds=5
            ):
                assert event["type"] == "DELETED" and event["object"].metadata.name == "decode-7"
                break
        await w.close()


async def test_the_client_survives_dropped_watch_connections(api: KubeApiServer) -> None:
    """A clean end (as a server-side timeout ends a watch): the client re-watches from the last
    version it saw and misses nothing written in between."""
    async with core_v1(api) as v1:
        start = (await v1.list_namespaced_pod("default")).metadata.resource_version
        w = watch.Watch()
        seen: list[str] = []
        # No timeout_seconds: the client watches forever and reconnects when a stream ends.
        stream = w.stream(v1.list_namespaced_pod, "default", resource_version=start)
        api.add_pod("a", labels={"x": "1"})
        async with asyncio.timeout(8):
            async for event in stream:
                seen.append(f"{event['type']} {event['object'].metadata.name}")
                if seen == ["ADDED a"]:
                    await api.watching()
                    assert api.drop_watches(abrupt=False) == 1
                    api.add_pod("b", labels={"x": "1"})  # while no watch is open
                if len(seen) == 2:
                    break
        await w.close()
        assert seen == ["ADDED a", "ADDED b"]
        watches = [r for r in api.requests if "watch=" in r]
        assert len(watches) == 2 and f"resourceVersion={int(start) + 1}" in watches[1]


async def test_an_abrupt_drop_cuts_the_stream_and_a_rewatch_loses_nothing(
    api: KubeApiServer,
) -> None:
    async with core_v1(api) as v1:
        last = (await v1.list_namespaced_pod("default")).metadata.resource_version

        async def cut_then_write() -> None:
            await api.watching()
            api.drop_watches(abrupt=True)
            api.add_pod("c", labels={"x": "1"})  # written while the client is cut off

        task = asyncio.create_task(cut_then_write())
        w = watch.Watch()
        with pytest.raises(aiohttp.ClientPayloadError):
            async with asyncio.timeout(5):
                async for _ in w.stream(
                    v1.list_namespaced_pod, "default", resource_version=last, timeout_seconds=9
                ):
                    pytest.fail("no event before the cut")  # pragma: no cover
        await w.close()
        await task
        w = watch.Watch()
        async with asyncio.timeout(5):
            async for event in w.stream(
                v1.list_namespaced_pod, "default", resource_version=last, timeout_seconds=5
            ):
                assert (event["type"], event["object"].metadata.name) == ("ADDED", "c")
                break
        await w.close()


async def test_endpoint_slices_list_and_watch(api: KubeApiServer) -> None:
    endpoint = {
        "addresses": ["10.0.0.9"],
        "conditions": {"ready": True, "serving": True, "terminating": False},
        "targetRef": {"kind": "Pod", "name": "decode-0", "namespace": "default"},
    }
    api.put_endpoint_slice(
        "decode-abc", service="decode", endpoints=[endpoint], ports={"http": 8000}
    )
    async with client.ApiClient(client.Configuration(host=api.url)) as ac:
        d1 = client.DiscoveryV1Api(ac)
        listed = await d1.list_namespaced_endpoint_slice(
            "default", label_selector="kubernetes.io/service-name=decode"
        )
        assert [s.metadata.name for s in listed.items] == ["decode-abc"]
        assert listed.items[0].endpoints[0].conditions.ready is True
        endpoint["conditions"] = {"ready": False, "serving": True, "terminating": True}
        api.put_endpoint_slice(
            "decode-abc", service="decode", endpoints=[endpoint], ports={"http": 8000}
        )
        w = watch.Watch()
        async with asyncio.timeout(5):
            async for event in w.stream(
                d1.list_namespaced_endpoint_slice,
                "default",
                resource_version=listed.metadata.resource_version,
                timeout_seconds=5,
            ):
                assert event["type"] == "MODIFIED"
                assert event["object"].endpoints[0].conditions.terminating is True
                break
        await w.close()


async def test_the_client_sees_injected_500_and_429(api: KubeApiServer) -> None:
    async with core_v1(api) as v1:
        api.fail_next(1, status=429)
        with pytest.raises(ApiException) as e:
            await v1.list_namespaced_pod("default")
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
        api.fail_next(1, status=500)
        with pytest.raises(ApiException) as e:
            await v1.list_namespaced_pod("default")
        assert e.value.status == 500
        assert len((await v1.list_namespaced_pod("default")).items) == 4  # the faults are spent
        api.slow(0.3)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await v1.read_namespaced_pod("decode-0", "default")
        assert loop.time() - began >= 0.3
        api.slow(0)


# ── the protocol itself, raw ──────────────────────────────────────────────────────────────────


async def test_a_watch_is_a_chunked_json_lines_stream_from_the_documented_versions(
    api: KubeApiServer,
) -> None:
    base = f"{api.url}/api/v1/namespaces/default/pods"
    # resourceVersion "0" or unset: synthetic ADDED for what exists now, in key order.
    for rv in ("&resourceVersion=0", ""):
        resp, events = await raw_events(f"{base}?watch=1&labelSelector=role%3Ddecode{rv}", until=2)
        assert resp.headers["Transfer-Encoding"] == "chunked"
        assert resp.headers["Content-Type"].startswith("application/json")
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("ADDED", "decode-0"),
            ("ADDED", "decode-1"),
        ]
        assert all(e["object"]["kind"] == "Pod" for e in events)
    # A number: only what changed after it (the pods before it are not re-sent).
    before = api.store.rv
    api.set_ready("decode-1", False)
    _, events = await raw_events(f"{base}?watch=true&resourceVersion={before}", until=1)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("MODIFIED", "decode-1")
    ]
    assert events[0]["object"]["metadata"]["resourceVersion"] == str(before + 1)
    # timeoutSeconds ends the stream cleanly, with the last chunk.
    loop = asyncio.get_running_loop()
    began = loop.time()
    _, events = await raw_events(
        f"{base}?watch=1&resourceVersion={api.store.rv}&timeoutSeconds=1", until=99
    )
    assert events == [] and 0.9 <= loop.time() - began < 5


async def test_a_watch_from_a_version_not_reached_yet_waits_and_sends_each_change_once(
    api: KubeApiServer,
) -> None:
    base = f"{api.url}/api/v1/namespaces/default/pods"
    # A version not reached yet: the watch waits for it, then sends what comes after it, once.
    ahead = api.store.rv + 1

    async def write_two() -> None:
        await api.watching()
        api.add_pod("p1")  # is `ahead` itself: not after it
        api.add_pod("p2")

    task = asyncio.create_task(write_two())
    _, events = await raw_events(
        f"{base}?watch=1&resourceVersion={ahead}&timeoutSeconds=1", until=99
    )
    await task
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "p2")]


async def test_selector_transitions_are_added_and_deleted_to_the_watcher(
    api: KubeApiServer,
) -> None:
    start = api.store.rv
    api.update_pod("sidecar", labels={"role": "decode"})  # starts matching
    api.update_pod("decode-0", labels={"role": "retired"})  # stops matching
    api.update_pod("prefill-0", labels={"role": "prefill", "v": "2"})  # never matches
    url = f"{api.url}/api/v1/namespaces/default/pods?watch=1&labelSelector=role%3Ddecode"
    _, events = await raw_events(f"{url}&resourceVersion={start}", until=2)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "sidecar"),
        ("DELETED", "decode-0"),
    ]
    gone = events[1]["object"]
    # The DELETED object is its last matching state, stamped with the change's version.
    assert gone["metadata"]["labels"]["role"] == "decode"
    assert gone["metadata"]["resourceVersion"] == str(start + 2)


async def test_410_bookmarks_and_initial_events_on_the_wire(api: KubeApiServer) -> None:
    base = f"{api.url}/api/v1/namespaces/default/pods"
    old = api.store.rv
    api.add_pod("n1")
    api.compact()
    resp, events = await raw_events(f"{base}?watch=1&resourceVersion={old}", until=5)
    assert resp.status == 200 and len(events) == 1  # the error is in the stream, then it ends
    assert events[0]["type"] == "ERROR"
    st = events[0]["object"]
    assert (st["kind"], st["status"], st["reason"], st["code"]) == (
        "Status",
        "Failure",
        "Expired",
        410,
    )
    assert st["message"] == f"too old resource version: {old} ({api.store.rv})"
    # The current version is not expired: an empty history still resumes from it.
    _, events = await raw_events(
        f"{base}?watch=1&resourceVersion={api.store.rv}&allowWatchBookmarks=true", until=1
    )
    assert events == [
        {
            "type": "BOOKMARK",
            "object": {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(api.store.rv)},
            },
        }
    ]
    # Bookmarks only when asked for.
    _, events = await raw_events(
        f"{base}?watch=1&resourceVersion={api.store.rv}&timeoutSeconds=1", until=1
    )
    assert events == []
    # sendInitialEvents: the ADDED events, then a bookmark annotated as their end.
    _, events = await raw_events(
        f"{base}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
        "&allowWatchBookmarks=true&labelSelector=role%3Dprefill",
        until=2,
    )
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}?watch=1&sendInitialEvents=true") as r:
            assert r.status == 400  # needs resourceVersionMatch=NotOlderThan and bookmarks


async def test_list_versions_pages_and_410(api: KubeApiServer) -> None:
    base = f"{api.url}/api/v1/namespaces/default/pods"
    async with aiohttp.ClientSession() as s:

        async def get(query: str) -> tuple[int, Obj]:
            async with s.get(f"{base}?{query}") as r:
                return r.status, await r.json()

        at = api.store.rv
        api.delete_pod("sidecar")
        api.add_pod("late")
        # Exact: the list as it was then; the current list otherwise.
        status, then = await get(f"resourceVersion={at}&resourceVersionMatch=Exact")
        assert status == 200 and then["metadata"]["resourceVersion"] == str(at)
        assert {p["metadata"]["name"] for p in then["items"]} == {
            "decode-0",
            "decode-1",
            "prefill-0",
            "sidecar",
        }
        assert "kind" not in then["items"][0]  # list items carry no kind, as on the API
        _, now = await get(f"resourceVersion={at}")
        assert now["metadata"]["resourceVersion"] == str(api.store.rv)
        assert {p["metadata"]["name"] for p in now["items"]} == {
            "decode-0",
            "decode-1",
            "prefill-0",
            "late",
        }
        # Pages: key order, a continue token pinned to the first page's version.
        status, page1 = await get("limit=3")
        assert [p["metadata"]["name"] for p in page1["items"]] == ["decode-0", "decode-1", "late"]
        assert page1["metadata"]["remainingItemCount"] == 1
        api.add_pod("aaa-after-page-1")  # not in the pinned list
        _, page2 = await get(f"limit=3&continue={page1['metadata']['continue']}")
        assert [p["metadata"]["name"] for p in page2["items"]] == ["prefill-0"]
        assert "continue" not in page2["metadata"]
        assert page2["metadata"]["resourceVersion"] == page1["metadata"]["resourceVersion"]
        # Too old: 410 Expired for an exact list and for a continue token.
        api.compact()
        status, body = await get(f"resourceVersion={at}&resourceVersionMatch=Exact")
        assert status == 410 and body["reason"] == "Expired"
        assert body["message"] == "The resourceVersion for the provided list is too old."
        status, body = await get(f"limit=3&continue={page1['metadata']['continue']}")
        assert status == 410 and body["reason"] == "Expired"
        # Not yet reached: 504 Too large resource version (after a short wait).
        status, body = await get(f"resourceVersion={api.store.rv + 5}")
        assert status == 504 and body["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"
        for bad in (
            "resourceVersion=abc",
            "resourceVersionMatch=Exact",
            "continue=zz&resourceVersion=1",
        ):
            status, body = await get(bad)
            assert status == 400 and body["kind"] == "Status", bad


def test_label_selector_parser_matches_the_apimachinery_grammar() -> None:
    s = parse_label_selector(" tier in (a , b),  env!=prod ,!legacy, n>3")
    assert s.matches({"tier": "a", "n": "4"})
    assert not s.matches({"tier": "a", "n": "3"})
    assert not s.matches({"tier": "a", "n": "4", "legacy": ""})
    assert not s.matches({"tier": "a", "n": "4", "env": "prod"})
    assert not s.matches({"tier": "c", "n": "4"})
    assert parse_label_selector("app.kubernetes.io/name=x").matches({"app.kubernetes.io/name": "x"})
    for bad in ("a in ()", "a,", "a b", "-a=1", "a=-b", "a>x", "a in (b"):
        with pytest.raises(SelectorError):
            parse_label_selector(bad)


# ── kubectl ───────────────────────────────────────────────────────────────────────────────────

needs_kubectl = pytest.mark.skipif(
    not KUBECTL.is_file(),
    reason=f"kubectl not at {KUBECTL}: `bash scripts/install_k8s_tools.sh` installs kubectl 1.35",
)


async def kubectl(kubeconfig: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        str(KUBECTL),
        "--kubeconfig",
        str(kubeconfig),
        "--request-timeout=10s",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@needs_kubectl
async def test_kubectl_gets_pods_by_label(api: KubeApiServer, tmp_path: Path) -> None:
    kc = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    proc = await kubectl(kc, "get", "pods", "-l", "role=decode", "-o", "json")
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()
    doc = json.loads(out)
    assert doc["kind"] == "List"
    assert sorted(p["metadata"]["name"] for p in doc["items"]) == ["decode-0", "decode-1"]
    assert {p["spec"]["containers"][0]["ports"][0]["containerPort"] for p in doc["items"]} == {8000}
    # kubectl found pods through the discovery documents, then listed with the selector.
    assert any(
        r.startswith("GET /api/v1/namespaces/default/pods?labelSelector=role") for r in api.requests
    )


@needs_kubectl
async def test_kubectl_watch_sees_an_added_and_a_deleted_pod(
    api: KubeApiServer, tmp_path: Path
) -> None:
    kc = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    proc = await kubectl(
        kc, "get", "pods", "--watch", "-o", "json", "--output-watch-events", "-l", "role=decode"
    )
    assert proc.stdout is not None
    try:
        decoder = json.JSONDecoder()
        buffer, events = "", []

        async def next_event() -> Obj:
            nonlocal buffer
            while True:
                text = buffer.lstrip()
                if text:
                    try:
                        obj, end = decoder.raw_decode(text)
                        buffer = text[end:]
                        return dict(obj)
                    except json.JSONDecodeError:
                        pass
                chunk = await proc.stdout.read(65536)  # type: ignore[union-attr]
                if not chunk:
                    raise AssertionError("kubectl ended its watch")
                buffer += chunk.decode()

        async with asyncio.timeout(20):
            while len(events) < 2:  # the listed pods first, as ADDED
                events.append(await next_event())
            await api.watching()
            api.add_pod("decode-9", labels={"role": "decode"})
            api.add_pod("prefill-9", labels={"role": "prefill"})
            api.delete_pod("decode-9")
            while len(events) < 4:
                events.append(await next_event())
        got = [(e["type"], e["object"]["metadata"]["name"]) for e in events]
        assert got == [
            ("ADDED", "decode-0"),
            ("ADDED", "decode-1"),
            ("ADDED", "decode-9"),
            ("DELETED", "decode-9"),
        ]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


@needs_kubectl
async def test_kubectl_deletes_a_pod(api: KubeApiServer, tmp_path: Path) -> None:
    kc = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    proc = await kubectl(kc, "delete", "pod", "decode-1", "--wait=true")
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()
    assert b'"decode-1" deleted' in out
    with pytest.raises(NotFound):
        api.pod("decode-1")


async def test_writes_over_http_and_the_fault_surface(api: KubeApiServer) -> None:
    """What another process (the simulator) uses: the API's own write verbs with optimistic
    concurrency, and POST /standin/faults."""
    pods = f"{api.url}/api/v1/namespaces/default/pods"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{pods}/decode-0") as r:
            pod = await r.json()
        stale = json.loads(json.dumps(pod))
        pod["metadata"]["labels"]["role"] = "prefill"
        async with s.put(f"{pods}/decode-0", json=pod) as r:
            assert r.status == 200
        async with s.put(f"{pods}/decode-0", json=stale) as r:  # an older resourceVersion
            assert r.status == 409 and (await r.json())["reason"] == "Conflict"
        assert api.pod("decode-0")["metadata"]["labels"]["role"] == "prefill"
        async with s.post(pods, json={"metadata": {"name": "decode-0"}, "spec": {}}) as r:
            assert r.status == 409 and (await r.json())["reason"] == "AlreadyExists"
        old = api.store.rv
        async with s.post(f"{api.url}/standin/faults", json={"compact": True}) as r:
            assert r.status == 200
        async with s.post(
            f"{api.url}/standin/faults", json={"fail_next": 1, "fail_status": 429}
        ) as r:
            assert r.status == 200
        async with s.get(pods) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
        _, events = await raw_events(f"{pods}?watch=1&resourceVersion={old - 1}", until=1)
        assert events[0]["object"]["code"] == 410


# ── the command line ──────────────────────────────────────────────────────────────────────────


async def test_the_cli_serves_a_pods_file_and_writes_a_kubeconfig(tmp_path: Path) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        "- name: decode-0\n  labels: {role: decode}\n  ports: {http: 8000}\n  podIP: 10.1.2.3\n"
        "- name: prefill-0\n  labels: {role: prefill}\n  ready: false\n",
        encoding="utf-8",
    )
    kc = tmp_path / "kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "disagg_tools.kubeapi",
        "--port",
        "0",
        "--pods",
        str(pods),
        "--kubeconfig",
        str(kc),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.decode().startswith("kubeapi listening on http://127.0.0.1:")
        cfg = client.Configuration()
        await config.load_kube_config(config_file=str(kc), client_configuration=cfg)
        async with client.ApiClient(cfg) as ac:
            v1 = client.CoreV1Api(ac)
            listed = await v1.list_namespaced_pod("default")
            by_name = {p.metadata.name: p for p in listed.items}
            assert set(by_name) == {"decode-0", "prefill-0"}
            assert by_name["decode-0"].status.pod_ip == "10.1.2.3"
            assert ready(by_name["prefill-0"]) == "False"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
    assert proc.returncode == 0
