"""Data-parallel ranks as placement targets (docs/data-parallel.md).

A vLLM (`--data-parallel-size N`) or SGLang (`--dp N`) server is one URL with N independent
engines behind it: each its own queue, KV pool and KV events. Placing on the URL alone
overloads one rank while another idles, and reserves decode room in one pool that is really N.
So a worker entry with `dp_size: N` is expanded here into N placement targets:

    id `<id>@<rank>`   its own WorkerState: reservations, load, breaker, stranded KV, KV index
    url                shared: the request carries the rank (router/adapters/dp_rank.py)
    kv_blocks          per rank (each engine's own pool, as each reports num_gpu_blocks)
    kv_events          the rank's own publisher: the entry's ports + rank, as vLLM's
                       `ZmqEventPublisher.offset_endpoint_port` binds them

Health is probed per URL (one probe, the ranks follow the lead: rank 0); each rank's breaker is
its own, so one rank that fails never takes its siblings out.
"""

from __future__ import annotations

from dataclasses import replace

from router.worker_spec import KvEventsSpec, WorkerSpec

__all__ = [
    "expand_ranks",
    "is_lead",
    "offset_endpoint",
    "parent_id",
    "rank_id",
]


def rank_id(parent: str, rank: int) -> str:
    return f"{parent}@{rank}"


def parent_id(spec: WorkerSpec) -> str:
    """The id of the entry a target came from (its own id when it has no ranks)."""
    return spec.dp_parent or spec.id


def is_lead(spec: WorkerSpec) -> bool:
    """The target whose health probe stands for its URL: rank 0, or a worker without ranks."""
    return not spec.dp_rank


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A ZeroMQ endpoint moved to data-parallel rank `rank`: a tcp port + rank, any other
    transport suffixed `_dp<rank>` (what vLLM's publishers bind; rank 0 unchanged)."""
    if rank <= 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit():
            return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _rank_events(events: KvEventsSpec | None, rank: int) -> KvEventsSpec | None:
    if events is None:
        return None
    replay = events.replay_endpoint
    return replace(
        events,
        endpoint=offset_endpoint(events.endpoint, rank),
        replay_endpoint=offset_endpoint(replay, rank) if replay else None,
    )


def expand_ranks(spec: WorkerSpec) -> list[WorkerSpec]:
    """The placement targets of one worker entry: itself, or one per data-parallel rank."""
    if spec.dp_size <= 1 or spec.dp_rank is not None:
        return [spec]
    return [
        replace(
            spec,
            id=rank_id(spec.id, rank),
            dp_rank=rank,
            dp_parent=spec.id,
            kv_events=_rank_events(spec.kv_events, rank),
        )
        for rank in range(spec.dp_size)
    ]
