"""What the router prints never shows a secret: `Redactor` scrubs text, `secrets_of` lists the
configured secrets, `mask_url` (from state/redact.py: one rule for every layer) hides a URL's
credentials.

A `Redactor` replaces, in any text: the configured secret values it was given (client API keys,
the admin token, workers' API keys, the passwords of the Redis and worker URLs), whatever
follows `Bearer ` or `Basic ` (an aiohttp error's repr carries the request's headers, and a
URL's credentials travel as `Basic base64(user:pw)`), the value of an `Authorization`,
`x-api-key` or `api-key` shown with its name under any scheme, and the credentials of every URL.
The logs (router/logs.py) use one with the configured secrets; error bodies, traces and the
start-up line one without (`scrub`), which still hides headers and URL credentials.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote

from state.redact import MASK, mask_url, mask_urls

__all__ = [
    "MASK",
    "Redactor",
    "mask_url",
    "mask_urls",
    "masked_repr",
    "scrub",
    "secrets_of",
    "url_secrets",
]

# The credential after an Authorization scheme, wherever the header shows up (a repr of a
# request's headers, a forwarded header echoed by a worker).
_AUTH_SCHEME = re.compile(r"\b([Bb]earer|BEARER|Basic|BASIC|basic)(\s+)[A-Za-z0-9+/=._~\-]{4,}")
# A credential header shown with its name, whatever its scheme (`Token`, `ApiKey`, none): in a
# repr of headers ('Authorization': '...'), a header line (x-api-key: ...), a query (api-key=).
_CREDENTIAL_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization|x-api-key|api[-_]key)(['\"]?\s*[:=]\s*['\"]?)"
    r"([^'\"\s,}>&)]+(?:[ \t]+[^'\"\s,}>&)]+)?)"
)
# A scheme is letters (Bearer, Token, ApiKey, Digest): shown, as the `Bearer ` rule shows it.
_SCHEME_WORD = re.compile(r"[A-Za-z]{1,20}")
# Shorter values are not searched for: masking every "ab" in a line helps nobody.
_MIN_SECRET_LEN = 4


class Redactor:
    """Scrubs text of the secrets it knows and of every credential it can recognise."""

    __slots__ = ("secrets",)

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values: set[str] = set()
        for s in secrets:
            value = str.__str__(s) if isinstance(s, str) else str(s)  # a Secret's own value
            if len(value) >= _MIN_SECRET_LEN:
                # As configured, and as it appears inside a URL (percent-encoded).
                values |= {value, quote(value, safe=""), quote(value)}
        # Longest first, so that a secret containing another is masked whole.
        self.secrets = sorted(values, key=len, reverse=True)

    def __repr__(self) -> str:
        return f"Redactor({len(self.secrets)} secret forms)"

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return scrub(text)


def scrub(text: str) -> str:
    """`text` with Authorization credentials and URL credentials masked (no configured
    secrets needed): for error bodies, traces, anything printed before settings exist."""
    if "earer" in text or "asic" in text or "EARER" in text or "ASIC" in text:  # cheap first
        text = _AUTH_SCHEME.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    if "uthoriz" in text or "UTHORIZ" in text or "pi-" in text or "PI-" in text:
        text = _CREDENTIAL_HEADER.sub(_mask_credential_header, text)
    return mask_urls(text)


def _mask_credential_header(m: re.Match[str]) -> str:
    value = m.group(3)
    scheme, space, rest = value.partition(" ")
    if not space:
        scheme, space, rest = value.partition("\t")
    if not (space and _SCHEME_WORD.fullmatch(scheme)):
        scheme, space, rest = "", "", value  # no scheme: the whole value is the credential
    # What is hidden must look like a value: our own messages say "(Authorization: Bearer ...)".
    if sum(c.isalnum() for c in rest) < _MIN_SECRET_LEN:
        return m.group(0)
    return m.group(1) + m.group(2) + scheme + space + MASK


def url_secrets(url: str | None) -> list[str]:
    """The secret parts of one URL: its password (or a lone user name, a token), and the values
    of its secret query parameters — each as written and decoded."""
    if not url:
        return []
    found: list[str] = []
    masked = mask_url(url)
    if masked == url:
        return found
    # Read them off the difference between the URL and its masked form: the same rule, no
    # second parser that could disagree with it.
    for piece in re.split(r"[@:/?&#=]", url):
        if piece and piece not in masked:
            found += [piece, unquote(piece)]
    return found


def secrets_of(settings: object) -> list[str]:
    """Every secret value a Settings object holds (duck-typed: no import of the config)."""
    auth = getattr(settings, "auth", None)
    found: list[str] = list(getattr(auth, "api_keys", ()))
    found.append(getattr(auth, "admin_token", ""))
    found.append(getattr(auth, "admin_read_token", ""))
    for w in getattr(settings, "workers", ()):
        found.append(getattr(w, "api_key", ""))
        found += url_secrets(getattr(w, "url", None))
    found += url_secrets(getattr(getattr(settings, "store", None), "url", None))
    return [str.__str__(s) for s in found if s]


def masked_repr(obj: Any) -> str:
    """A dataclass's repr with the credentials of its URLs masked (its Secrets mask
    themselves): the `__repr__` of the settings and of a worker's spec, which carry URLs."""
    shown = ", ".join(
        f"{f.name}={getattr(obj, f.name)!r}" for f in dataclasses.fields(obj) if f.repr
    )
    return scrub(f"{type(obj).__qualname__}({shown})")
