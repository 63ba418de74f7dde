"""URLs with their credentials hidden: `mask_url` for one URL, `mask_urls` for any text.

The one implementation for every layer that prints a URL (state's errors and reprs here; the
router's start-up line, logs, error bodies, traces and admin answers through router/redact.py;
the launcher). It lives in `state`, the lowest layer that shows a URL, since state imports
nothing of the router.

The rule, the same everywhere: the password of a URL's userinfo becomes `***` (the user name
stays: it helps find the account and is no secret on its own); a userinfo without a password is
a token (`https://TOKEN@host`) and is masked whole; the value of every query or fragment
parameter whose name says secret (password, token, key, secret, auth, ...) becomes `***`.
Everything else is left byte for byte as written — no parse-and-rebuild, which would turn
`unix:///p` into `unix:/p` — and nothing here raises, whatever the input.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "mask_url", "mask_urls"]

MASK = "***"

# A parameter whose name says it holds a secret: api_key, access_token, password, pwd, sig...
_SECRET_PARAM = re.compile(
    r"(?i)(pass|pwd|secret|token|key|auth|credential|signature|^sig$|^x-amz-security)"
)
# A URL inside free text: a scheme, `://`, then up to white space or a quote or bracket.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")


def _mask_params(params: str) -> str:
    out = []
    for pair in params.split("&"):
        name, eq, value = pair.partition("=")
        if eq and value and _SECRET_PARAM.search(name):
            pair = f"{name}={MASK}"
        out.append(pair)
    return "&".join(out)


def mask_url(url: object) -> str:
    """`url` with its credentials replaced by ``***`` (see the module docstring); any object is
    taken by its str(), a malformed URL is masked as far as it can be read."""
    text = url if isinstance(url, str) else str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    # The userinfo ends at the last '@' before the query. Not at the end of the authority (the
    # first / ? #): a password with an unescaped '/' or '#' would end it early and show the
    # rest; an '@' in a path or fragment is taken for credentials (hiding more, never less).
    head, qmark, tail = rest.partition("?")
    if sep and "@" in head:
        userinfo, _, after = head.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        if "/" in user or "#" in user:  # the '@' was past a whole authority: mask it all
            user, colon = "", ""
        head = (f"{user}:{MASK}" if colon else MASK) + "@" + after
    if qmark:
        query, hashmark, fragment = tail.partition("#")
        head += "?" + _mask_params(query)
    else:
        head, hashmark, fragment = head.partition("#")
    if hashmark:
        head += "#" + _mask_params(fragment)
    return f"{scheme}://{head}" if sep else head


def mask_urls(text: str) -> str:
    """`text` with every URL in it passed through `mask_url`."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: mask_url(m.group(0)), text)
