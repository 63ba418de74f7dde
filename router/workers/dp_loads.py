"""A data-parallel server's load, split by rank: one poll of its URL, a report per rank target.

    vLLM    `/metrics`: each engine core's samples carry the label `engine="<rank>"` (its
            Prometheus logger labels every per-engine metric by the engine's index); the
            samples of one rank are parsed as one worker's (router/workers/discovery.py)
    SGLang  `/v1/loads` (`{"loads": [{"dp_rank", "num_running_reqs", ...}]}`) or the older
            `/get_load` (a list, one record per rank in rank order); each record alone

Its ranks' number is also what the server reports of its data parallelism
(`reported_dp_size`). A report of a rank the worker was not declared with is not any target's:
it is ignored and counted (`LoadPoller`, router/workers/load_poller.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from router.workers.discovery import (
    VLLM_LOAD_NAMES,
    LoadSnapshot,
    fetch_vllm_load_text,
    parse_sglang_load,
    vllm_load,
)
from router.workers.prom_samples import Sample, label_value, samples
from router.workers.worker_state import WorkerState

__all__ = [
    "assign_rank_loads",
    "fetch_rank_loads",
    "reported_dp_size",
    "split_sglang_loads",
    "split_vllm_metrics",
]


def split_vllm_metrics(text: str, at: float) -> dict[int, LoadSnapshot]:
    """vLLM's Prometheus text -> a load per `engine` label (none: the text has no such label),
    in one pass over the load gauges' lines. A rank none of whose load gauges is in the text
    gets no reading: its last one ages as a silent worker's does, rather than reading as idle."""
    by_rank: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples(text, VLLM_LOAD_NAMES):
        engine = label_value(sample.labels, "engine")
        if engine is not None and engine.isdigit():
            by_rank[int(engine)].append(sample)
    return {rank: vllm_load(found, at) for rank, found in by_rank.items()}


def split_sglang_loads(
    load: Any, server_info: Mapping[str, Any] | None, at: float
) -> dict[int, LoadSnapshot]:
    """SGLang's per-rank load records -> a load per rank (its `dp_rank`, else its place)."""
    if isinstance(load, Mapping) and isinstance(load.get("loads"), list):
        load = load["loads"]
    if not isinstance(load, list):
        return {}
    out: dict[int, LoadSnapshot] = {}
    for place, record in enumerate(load):
        if not isinstance(record, Mapping):
            continue
        rank = record.get("dp_rank", place)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
            out[rank] = parse_sglang_load([record], server_info, at)
    return out


async def _get(session: aiohttp.ClientSession, url: str, path: str) -> aiohttp.ClientResponse:
    resp = await session.get(url.rstrip("/") + path)
    if resp.status != 200:
        resp.release()
        raise aiohttp.ClientError(f"{path} answered {resp.status}")
    return resp


async def fetch_rank_loads(
    session: aiohttp.ClientSession,
    url: str,
    adapter: str,
    clock: Callable[[], float] = time.monotonic,
) -> dict[int, LoadSnapshot]:
    """One poll of a data-parallel server: its load per rank (raises aiohttp.ClientError)."""
    if adapter != "sglang":
        return split_vllm_metrics(await fetch_vllm_load_text(session, url), clock())
    try:
        async with await _get(session, url, "/v1/loads") as resp:
            load = await resp.json(content_type=None)
    except aiohttp.ClientError:  # before SGLang 0.5
        async with await _get(session, url, "/get_load") as resp:
            load = await resp.json(content_type=None)
    async with await _get(session, url, "/server_info") as resp:
        info = await resp.json(content_type=None)
    return split_sglang_loads(load, info if isinstance(info, Mapping) else None, clock())


def assign_rank_loads(ranks: list[WorkerState], loads: Mapping[int, LoadSnapshot]) -> list[int]:
    """Each rank target's own report; returns the ranks reported that none of `ranks` is
    (a server started with more ranks than its entry declares), which are ignored."""
    by_rank = {w.spec.dp_rank: w for w in ranks}
    foreign = []
    for rank, load in sorted(loads.items()):
        target = by_rank.get(rank)
        if target is None:
            foreign.append(rank)
        else:
            target.took_load(load)
    return foreign


async def reported_dp_size(session: aiohttp.ClientSession, url: str, adapter: str) -> int | None:
    """The data parallelism a server reports of itself: SGLang's `/server_info` `dp_size`, the
    number of vLLM engines in its `/metrics`; None when it says nothing (raises
    aiohttp.ClientError, ValueError)."""
    if adapter == "sglang":
        async with await _get(session, url, "/server_info") as resp:
            info = await resp.json(content_type=None)
        size = info.get("dp_size") if isinstance(info, Mapping) else None
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
    ranks = await fetch_rank_loads(session, url, adapter)
    return max(ranks) + 1 if ranks else None
