"""The data-parallel rank on the wire: how each engine is told which of its ranks serves a leg.

A server started with data parallelism is one URL with several engines behind it; the router
places on a rank (router/workers/dp_ranks.py) and says which, the way each engine reads it
(checked in their code; docs/data-parallel.md):

    vLLM (NIXL, Mooncake)  header `X-data-parallel-rank: <rank>`: the OpenAI server's
                           `_get_data_parallel_rank` (vllm/entrypoints/openai/serving_engine.py)
                           reads it and hands it to the engine client, which sends the request
                           to that engine core; without it, vLLM's own DP load balancer picks.
    SGLang                 body field `data_parallel_rank` (sglang/srt/entrypoints/openai/
                           protocol.py, GenerateReqInput in managers/io_struct.py; newer
                           versions name it `routed_dp_rank` and migrate the old name), on each
                           leg its own rank. The decode finds the prefill rank holding its KV
                           from the bootstrap room (`bootstrap_room % prefill dp_size` under
                           SGLang's follow_bootstrap_room, the rule of its DataParallelController
                           and of the decode's prefill-rank lookup), so the room is chosen to
                           fall on the prefill's rank (router/adapters/sglang.py `room_on_rank`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RANK_HEADER", "SGLANG_RANK_FIELD", "rank_body", "rank_headers"]

RANK_HEADER = "X-data-parallel-rank"
SGLANG_RANK_FIELD = "data_parallel_rank"


def rank_headers(adapter: str, rank: int | None) -> dict[str, str]:
    """The headers that carry `rank` to an engine of `adapter` (none when it has no ranks, or
    reads the rank from the body)."""
    if rank is None or adapter == "sglang":
        return {}
    return {RANK_HEADER: str(rank)}


def rank_body(adapter: str, body: dict[str, Any], rank: int | None) -> dict[str, Any]:
    """`body` with `rank` in it for an engine that reads it there (SGLang); else `body` itself."""
    if rank is None or adapter != "sglang":
        return body
    return {**body, SGLANG_RANK_FIELD: rank}
