"""Bearer-token checks for the client API keys and the admin tokens: one parser, constant time,
and who may see what.

    generation routes, passthrough      a client key once any is configured (`auth.api_keys`, a
                                        tenant's keys: router/tenants.py), which names the
                                        request's tenant (`client_tenant`, at the front door:
                                        router/edge/front_door.py); none configured: anyone, as the
                                        `default` tenant
    admin GETs (state, workers,         the admin token or `admin_read_token`, once client keys
      scaling, roles)                   are configured or `admin_read_token` is set; else open
    admin writes (register, delete,     the admin token (`auth.admin_token`); none configured: 403
      drain, undrain, role, tenants'
      keys)
    /metrics, /openapi.json             open while `public_metrics` / `public_openapi` (the
                                        default); else any of the above credentials

401 when no credential or a wrong one comes (with `WWW-Authenticate`), 403 when a valid one
comes that does not allow the call (a client key or the read-only token on the admin write
side), or when no credential could (the feature's token is not configured).

Client keys are looked up by their hash (router/tenants.py `Keyring`: why that leaks no timing);
the admin tokens are compared in constant time, every candidate each time (`token_matches`).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from aiohttp import web

from router.config import Settings
from router.errors import Forbidden, Unauthorized
from router.tenants import KEYRING, Keyring, TenantSpec

__all__ = [
    "bearer_token",
    "token_matches",
    "client_tenant",
    "check_admin_read",
    "check_admin_write",
    "check_scrape",
]


def bearer_token(request: web.Request) -> str:
    """The token of `Authorization: Bearer <token>`, or "" when there is none, or when it is
    not text: bytes that are not UTF-8 arrive from aiohttp's parser as lone surrogates, which no
    key is spelled with and which neither the hash nor the comparison could encode."""
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer":
        return ""
    token = token.strip()
    if not token.isascii():  # the common case costs one scan, in C
        try:
            token.encode()
        except UnicodeEncodeError:
            return ""
    return token


def token_matches(given: str, accepted: Iterable[str]) -> bool:
    """Whether `given` is one of `accepted`, compared in constant time (no timing oracle)."""
    raw = given.encode()
    found = False
    for token in accepted:
        # Every candidate is compared, so the time taken does not tell which one matched.
        # (A Secret prints ***; its encode() is its value.)
        found |= bool(token) and hmac.compare_digest(raw, token.encode())
    return found


def client_tenant(keyring: Keyring, request: web.Request) -> TenantSpec:
    """The request's tenant, by its client API key once keys are configured (else anyone is
    served, as the `default` tenant); 401 for a missing, unknown or revoked key."""
    token = bearer_token(request)
    tenant = keyring.identify(token)
    if tenant is None:
        raise Unauthorized("a valid API key is required (Authorization: Bearer ...)")
    return tenant


def _is_client_key(request: web.Request, given: str) -> bool:
    keyring = request.app.get(KEYRING)
    return keyring is not None and keyring.lookup(given) is not None


def admin_reads_protected(settings: Settings) -> bool:
    """The admin GETs reveal worker URLs and topology: closed once clients need a key (or
    the operator set a read token); in open mode they answer anyone, as they always have."""
    return bool(settings.client_keys or settings.auth.admin_read_token)


def check_admin_read(settings: Settings, request: web.Request) -> None:
    if not admin_reads_protected(settings):
        return
    given = bearer_token(request)
    if token_matches(given, (settings.auth.admin_token, settings.auth.admin_read_token)):
        return
    if not (settings.auth.admin_token or settings.auth.admin_read_token):
        raise Forbidden(
            "the admin API's read side needs auth.admin_token or auth.admin_read_token set "
            "(client keys are configured, so it is not public)"
        )
    if given and _is_client_key(request, given):
        raise Forbidden(
            "a client API key cannot read the admin API: use the admin token or admin_read_token"
        )
    raise Unauthorized(
        "the admin token or the read-only admin token is required (Authorization: Bearer ...)"
    )


def check_admin_write(settings: Settings, request: web.Request) -> None:
    token = settings.auth.admin_token
    if not token:
        raise Forbidden("the admin API's write side is disabled: set auth.admin_token to enable it")
    given = bearer_token(request)
    if token_matches(given, (token,)):
        return
    if given and (
        token_matches(given, (settings.auth.admin_read_token,)) or _is_client_key(request, given)
    ):
        raise Forbidden("this token may not change the pools: the admin token is required")
    raise Unauthorized("a valid admin token is required (Authorization: Bearer ...)")


def check_scrape(settings: Settings, request: web.Request, public: bool) -> None:
    """/metrics and /openapi.json: open when `public`, else any credential the router knows."""
    if public:
        return
    given = bearer_token(request)
    accepted = (settings.auth.admin_token, settings.auth.admin_read_token)
    if not (token_matches(given, accepted) or _is_client_key(request, given)):
        raise Unauthorized(
            "a client API key or an admin token is required (Authorization: Bearer ...)"
        )
