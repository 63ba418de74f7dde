"""Injected faults, and the vLLM-style error bodies the simulated worker answers with.

A FaultConfig is the frozen description (CLI flags, or `POST /sim/faults` JSON); a FaultState is
its live counterpart in one worker: the seeded RNG for `error_rate` and, when `count` is set, how
many more times each fault may still fire — so a test can fail exactly the next request.

Garbage (`garbage`: a shape of GARBAGE_SHAPES, on the legs `garbage_leg` names and the endpoint
`garbage_path`, or every one) is a worker whose `/health` is fine but whose answers are not:
a 200 that does not parse, parses to the wrong shape, stops mid-body, or a prefill's answer
without its KV handle (rendered by disagg_tools/sim/garbage.py). `hang` accepts a request and never
answers;
`hang_after_tokens` streams that many tokens, then goes silent without closing.
`role_switch_fail` is the probability that a `POST /pd_role_switch` fails after its teardown,
leaving the instance unhealthy as SGLang does (sim.role_switch); seeded, limited by `count`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

import orjson
from aiohttp import web

__all__ = [
    "FaultConfig",
    "FaultState",
    "ERROR_STATUSES",
    "GARBAGE_LEGS",
    "GARBAGE_SHAPES",
    "error_body",
    "error_response",
]

ERROR_STATUSES: tuple[int | str, ...] = (500, 503, 429, "malformed")

# What a broken worker's 200 may hold (disagg_tools/sim/garbage.py renders each, streamed and
# whole).
GARBAGE_SHAPES: tuple[str, ...] = (
    "not_json",  # an HTML error page where JSON (or SSE JSON events) should be
    "wrong_shape",  # JSON, but not an answer: {"status": "ok"}
    "no_framing",  # a streamed body with no SSE framing at all (plain lines)
    "truncated",  # the first tokens, then the body stops mid-event (chunked, never terminated)
    "junk_after_tokens",  # the first tokens, then events that do not parse, then [DONE]
    "no_kv_params",  # prefill: a well-formed answer without kv_transfer_params
)
# Which legs garbage fires on: a prefill (do_remote_decode), a decode (remote or local), any.
GARBAGE_LEGS: tuple[str, ...] = ("any", "prefill", "decode")

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# Faults that fire once per request, limited by `count`; slow_factor is a level, not an event.
_EVENTS = (
    "prefill_fail",
    "prefill_die_after_kv",
    "decode_fail_before_first",
    "decode_die_after_tokens",
    "decode_die_after_last_token",
    "decode_error_event_after_tokens",
    "decode_stall_after_headers",
    "hang",
    "hang_after_tokens",
    "garbage",
    "error",
    "role_switch_fail",
)


@dataclass(frozen=True, slots=True)
class FaultConfig:
    prefill_fail: bool = False  # 500 before the KV is ready
    prefill_die_after_kv: bool = False  # KV entry created, then the connection drops: stranded KV
    decode_fail_before_first: bool = False  # 500 before any token
    decode_die_after_tokens: int | None = None  # drop the connection after N tokens
    # The last token sent without its finish, then the connection drops: the answer is whole but
    # its stream never ended (a router that preempts there meets the same).
    decode_die_after_last_token: bool = False
    # As vLLM reports a failed generation (e.g. a KV pull that failed): 200, N tokens, then
    # `data: {"error": {"message": "Internal server error", ..., "code": 500}}` and [DONE].
    decode_error_event_after_tokens: int | None = None
    # As vLLM while a KV pull hangs: a streaming decode sends its headers, then nothing.
    decode_stall_after_headers: bool = False
    hang: bool = False  # accept and never answer, until the client goes away
    hang_after_tokens: int | None = None  # stream N tokens, then silence (the socket stays open)
    garbage: str | None = None  # a 200 of this shape (GARBAGE_SHAPES) instead of the answer
    garbage_leg: str = "any"  # on which legs (GARBAGE_LEGS)
    garbage_path: str | None = None  # on this endpoint only (e.g. "/v1/chat/completions")
    garbage_after_tokens: int = 3  # the valid tokens before a mid-body shape breaks
    slow_factor: float = 1.0  # multiplies every simulated duration
    error_rate: float = 0.0  # fraction of generation requests answered with error_status
    error_status: int | str = 500  # 500, 503, 429 or "malformed" (200 with invalid JSON)
    role_switch_fail: float = 0.0  # probability a role switch's rebuild fails (sim.role_switch)
    seed: int = 0
    count: int | None = None  # each fault fires at most this many times (None = always)

    def __post_init__(self) -> None:
        if self.slow_factor <= 0:
            raise ValueError("slow_factor must be > 0")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
        if not 0.0 <= self.role_switch_fail <= 1.0:
            raise ValueError("role_switch_fail must be within [0, 1]")
        if self.error_status not in ERROR_STATUSES:
            raise ValueError(f"error_status must be one of {ERROR_STATUSES}")
        if self.garbage is not None and self.garbage not in GARBAGE_SHAPES:
            raise ValueError(f"garbage must be one of {GARBAGE_SHAPES}")
        if self.garbage_leg not in GARBAGE_LEGS:
            raise ValueError(f"garbage_leg must be one of {GARBAGE_LEGS}")
        for name in (
            "decode_die_after_tokens",
            "decode_error_event_after_tokens",
            "hang_after_tokens",
            "garbage_after_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.count is not None and self.count < 0:
            raise ValueError("count must be >= 0")

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> FaultConfig:
        """Build from JSON; unknown keys and wrong types raise ValueError (a 400, not a 500)."""
        if not isinstance(data, Mapping):
            raise ValueError("fault config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = set(data) - set(known)
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}; known: {sorted(known)}")
        for name, value in data.items():
            _check_type(name, value)
        # JSON in, fields out: each key is a field and each value its field's type, checked
        # just above, which the type checker cannot follow through `_check_type`.
        checked = cast("Mapping[str, Any]", data)
        try:
            return cls(**checked)
        except TypeError as exc:
            raise ValueError(str(exc)) from exc

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _check_type(name: str, value: object) -> None:
    if name in (
        "prefill_fail",
        "prefill_die_after_kv",
        "decode_fail_before_first",
        "decode_die_after_last_token",
        "decode_stall_after_headers",
        "hang",
    ):
        ok = isinstance(value, bool)
    elif name in (
        "decode_die_after_tokens",
        "decode_error_event_after_tokens",
        "hang_after_tokens",
        "count",
    ):
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
    elif name == "garbage_after_tokens":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif name in ("garbage", "garbage_path"):
        ok = value is None or isinstance(value, str)
    elif name == "garbage_leg":
        ok = isinstance(value, str)
    elif name in ("slow_factor", "error_rate", "role_switch_fail"):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif name == "seed":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:  # error_status
        ok = value in ERROR_STATUSES and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"bad value for fault field {name!r}: {value!r}")


class FaultState:
    """One worker's live faults: decides, per request, which fault (if any) fires."""

    def __init__(self, config: FaultConfig | None = None) -> None:
        self.replace(config or FaultConfig())

    def replace(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        # Its own stream, so switches do not shift which requests error_rate picks.
        self._switch_rng = random.Random(config.seed)
        self._remaining: dict[str, int | None] = {name: config.count for name in _EVENTS}

    def _take(self, name: str) -> bool:
        left = self._remaining[name]
        if left is None:
            return True
        if left <= 0:
            return False
        self._remaining[name] = left - 1
        return True

    def fire(self, name: str) -> bool:
        """Whether boolean fault `name` fires for this request (consumes one of its `count`)."""
        if not getattr(self.config, name):
            return False
        return self._take(name)

    def garbage_for(self, leg: str, path: str) -> str | None:
        """The garbage shape this request on `leg` ("prefill" or "decode") of `path` is
        answered with, or None; a shape that has no meaning on the leg (a decode answer has no
        KV handle to leave out) never fires there."""
        c = self.config
        if c.garbage is None or c.garbage_leg not in ("any", leg):
            return None
        if c.garbage_path is not None and c.garbage_path != path:
            return None
        if c.garbage == "no_kv_params" and leg != "prefill":
            return None
        return c.garbage if self._take("garbage") else None

    def hang_after(self) -> int | None:
        return self._after_tokens("hang_after_tokens", self.config.hang_after_tokens)

    def die_after_last_token(self) -> bool:
        return self.config.decode_die_after_last_token and self._take("decode_die_after_last_token")

    def die_after_tokens(self) -> int | None:
        return self._after_tokens("decode_die_after_tokens", self.config.decode_die_after_tokens)

    def error_event_after_tokens(self) -> int | None:
        n = self.config.decode_error_event_after_tokens
        return self._after_tokens("decode_error_event_after_tokens", n)

    def _after_tokens(self, name: str, n: int | None) -> int | None:
        """`n` (the fault `name`'s token count) when that fault fires for this request."""
        if n is None or not self._take(name):
            return None
        return n

    def roll_error(self) -> int | str | None:
        """The injected error status for this request, or None; seeded, so runs repeat."""
        if not self._roll("error", self.config.error_rate, self._rng):
            return None
        return self.config.error_status

    def roll_role_switch_fail(self) -> bool:
        """Whether this role switch's rebuild fails (seeded, so runs repeat)."""
        return self._roll("role_switch_fail", self.config.role_switch_fail, self._switch_rng)

    def _roll(self, name: str, rate: float, rng: random.Random) -> bool:
        """Whether probabilistic fault `name` fires (consumes one of its `count`); no draw
        while it is off or spent, so a spent fault leaves its stream where it was."""
        if rate <= 0.0 or self._remaining[name] == 0:
            return False
        if rng.random() >= rate:
            return False
        return self._take(name)

    @property
    def slow_factor(self) -> float:
        return self.config.slow_factor

    def snapshot(self) -> dict[str, object]:
        return {"config": self.config.to_dict(), "remaining": dict(self._remaining)}

    def __repr__(self) -> str:
        default = FaultConfig().to_dict()
        active = {k: v for k, v in self.config.to_dict().items() if v != default[k]}
        left = {k: v for k, v in self._remaining.items() if v is not None}
        return f"FaultState(active={active}, remaining={left})"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    """vLLM's error object: {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(error_body(status, message, param)),
        content_type="application/json",
    )
