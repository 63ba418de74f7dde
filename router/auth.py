"""Bearer-token checks for the client API keys and the admin token: one parser, constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from aiohttp import web

__all__ = ["bearer_token", "token_matches"]


def bearer_token(request: web.Request) -> str:
    """The token of `Authorization: Bearer <token>`, or "" when there is none."""
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def token_matches(given: str, accepted: Iterable[str]) -> bool:
    """Whether `given` is one of `accepted`, compared in constant time (no timing oracle)."""
    raw = given.encode()
    found = False
    for token in accepted:
        # Every candidate is compared, so the time taken does not tell which one matched.
        found |= bool(token) and hmac.compare_digest(raw, str(token).encode())
    return found
