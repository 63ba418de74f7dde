"""vLLM with the Mooncake connector: both legs at once, the decode names the transfer.

At start-up the router asks each prefill's bootstrap server (`GET http://<host>:<port>/query`,
port 8998 unless configured, `VLLM_MOONCAKE_BOOTSTRAP_PORT` on the worker) for its engine id per
data-parallel rank: `{"0": {"engine_id": ...}, ...}`. Per request, with one transfer id:

    prefill: client body, `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when
             present), `min_tokens`/`min_completion_tokens`/`stream_options` removed,
             `kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false, transfer_id}`
    decode:  client body + `kv_transfer_params: {do_remote_decode: false, do_remote_prefill: true,
             remote_bootstrap_addr: "http://host:port", remote_engine_id, transfer_id}`

Both are sent at the same time: the decode waits inside vLLM for the KV of that transfer id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import aiohttp

from router.adapters.base import PrefillTarget, ProtocolViolation
from router.adapters.vllm import VllmNixlAdapter

__all__ = ["MooncakeAdapter", "DEFAULT_BOOTSTRAP_PORT", "query_engine_ids", "parse_query"]

DEFAULT_BOOTSTRAP_PORT = 8998


def bootstrap_addr(prefill: PrefillTarget) -> str:
    host = f"[{prefill.host}]" if ":" in prefill.host else prefill.host
    return f"http://{host}:{prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT}"


def parse_query(data: Any) -> dict[int, str]:
    """Engine ids by data-parallel rank from a bootstrap server's `/query` answer."""
    if not isinstance(data, Mapping) or not data:
        raise ProtocolViolation("the Mooncake bootstrap /query answer is not a non-empty object")
    out: dict[int, str] = {}
    for rank, entry in data.items():
        engine_id = entry.get("engine_id") if isinstance(entry, Mapping) else None
        try:
            out[int(rank)] = str(engine_id) if engine_id is not None else ""
        except ValueError as exc:
            raise ProtocolViolation(f"bad data-parallel rank {rank!r} in /query") from exc
        if not out[int(rank)]:
            raise ProtocolViolation(f"rank {rank} of /query has no engine_id")
    return out


async def query_engine_ids(
    session: aiohttp.ClientSession, prefill: PrefillTarget
) -> dict[int, str]:
    """`GET <bootstrap>/query` of one prefill worker (raises ProtocolViolation, ClientError)."""
    async with session.get(bootstrap_addr(prefill) + "/query") as resp:
        if resp.status != 200:
            raise ProtocolViolation(f"Mooncake bootstrap /query answered {resp.status}")
        return parse_query(await resp.json(content_type=None))


class MooncakeAdapter:
    name = "mooncake"
    concurrent_legs: Literal[True] = True

    def legs(
        self, body: dict[str, Any], prefill: PrefillTarget, request_id: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        if not prefill.engine_id:
            raise ProtocolViolation(
                "no engine id for this Mooncake prefill worker: query its bootstrap /query first"
            )
        transfer_id = f"xfer-{request_id}"
        # The prefill leg is shaped as in NIXL mode; only the KV handle differs.
        p = VllmNixlAdapter().prefill_body(body)
        p["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        }
        d = dict(body)
        d["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": bootstrap_addr(prefill),
            "remote_engine_id": prefill.engine_id,
            "transfer_id": transfer_id,
        }
        return p, d

    def __repr__(self) -> str:
        return "MooncakeAdapter()"
