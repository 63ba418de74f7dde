"""SGLang PD (docs/design.md §3): bootstrap rooms, both legs at once.

Both workers get the client's body unchanged plus `bootstrap_host` (the prefill's host, as the
decode reaches it), `bootstrap_port` (the prefill's bootstrap server; null when it has none) and
`bootstrap_room` (a random 63-bit id the two meet under). A batch request gets one room per
item, and host and port repeated per item, as SGLang expects arrays of the batch's length.
Paths: `/generate` (native) and the OpenAI `/v1/completions`, `/v1/chat/completions`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Literal

from router.adapters.base import PrefillTarget

__all__ = ["SglangAdapter", "batch_size", "room_on_rank"]

ROOM_BITS = 63  # SGLang's rooms are non-negative signed 64-bit integers


def _is_id_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    )


def batch_size(body: Mapping[str, Any]) -> int | None:
    """The number of prompts in a batch request, or None for a single one.

    `/generate`: `text` as a list of strings, or `input_ids` as a list of id lists;
    `/v1/completions`: `prompt` as a list of several strings or id lists (a list of ids alone,
    or of one prompt, is a single prompt).
    """
    text = body.get("text")
    if isinstance(text, list):
        return len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return len(ids)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not _is_id_list(prompt):
        return len(prompt)
    return None


def room_on_rank(draw: int, rank: int, dp_size: int) -> int:
    """A room with `room % dp_size == rank`, from a random `draw` (< 2**52: dp_size is at most
    1024, so the room stays within SGLang's 63 bits)."""
    return draw * dp_size + rank


class SglangAdapter:
    name = "sglang"
    concurrent_legs: Literal[True] = True

    def __init__(self, rng: random.Random | None = None) -> None:
        # Injectable so tests can predict rooms; SystemRandom by default, so replicas sharing a
        # seed can never hand two requests the same room on one prefill worker.
        self._rng = rng if rng is not None else random.SystemRandom()

    def room(self, prefill: PrefillTarget | None = None) -> int:
        """A random room; for a data-parallel prefill one that falls on its rank: SGLang's
        decode finds the prefill rank holding the KV as `bootstrap_room % dp_size`
        (router/adapters/dp_rank.py), and so does its prefill under follow_bootstrap_room."""
        if prefill is None or prefill.dp_rank is None or prefill.dp_size <= 1:
            return self._rng.getrandbits(ROOM_BITS)
        draw = self._rng.getrandbits(ROOM_BITS - 11)
        return room_on_rank(draw, prefill.dp_rank, prefill.dp_size)

    def legs(
        self, body: dict[str, Any], prefill: PrefillTarget, request_id: str = ""
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        n = batch_size(body)
        out = dict(body)
        if n is None:
            out["bootstrap_host"] = prefill.host
            out["bootstrap_port"] = prefill.bootstrap_port
            out["bootstrap_room"] = self.room(prefill)
        else:
            out["bootstrap_host"] = [prefill.host] * n
            out["bootstrap_port"] = [prefill.bootstrap_port] * n
            out["bootstrap_room"] = [self.room(prefill) for _ in range(n)]
        return out, dict(out)

    def __repr__(self) -> str:
        return "SglangAdapter()"
