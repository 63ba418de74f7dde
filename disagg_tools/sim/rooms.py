"""Bootstrap rooms of SGLang PD (see `disagg_tools.sim.bootstrap`): where a prefill's KV waits for
its decode."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

__all__ = ["RoomKv", "RoomTable"]


@dataclass(slots=True)
class RoomKv:
    prompt_state: int
    prompt_tokens: int
    blocks: list[int]


@dataclass(slots=True)
class _Room:
    kv: asyncio.Future[RoomKv] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    taken: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class RoomTable:
    """Rooms by id; whichever side arrives first creates the room, the other finds it."""

    def __init__(self) -> None:
        self._rooms: dict[int, _Room] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, room_id: int) -> _Room:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = _Room()
        return room

    def drop(self, room_id: int, room: _Room) -> None:
        if self._rooms.get(room_id) is room:
            del self._rooms[room_id]

    def __repr__(self) -> str:
        return f"RoomTable(rooms={len(self._rooms)})"
