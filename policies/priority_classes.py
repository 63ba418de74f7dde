"""Named priority classes (issue 33): `interactive`, `default`, `batch` over the integer classes
the fairness policies order by (policies/fairness.py: lower first, as vLLM's request
`priority`; a request or tenant that names none is class 0).

    interactive  -1   more urgent than an unset priority
    default       0   what every request was before classes had names (vLLM's default too)
    batch         1   less urgent

The names are a mapping onto the integers, not a second scale: every integer stays a class
(`priority: 5` in a tenant's config or a request's body is a class less urgent than batch), so
configs and clients that used integers keep their meaning. `default` is 0 so that a tenant
or request that says nothing is where it always was; the named classes sit one step either
side of it.
"""

from __future__ import annotations

__all__ = ["BATCH", "CLASS_NAMES", "DEFAULT", "INTERACTIVE", "class_name", "parse_class"]

INTERACTIVE = -1
DEFAULT = 0
BATCH = 1
CLASS_NAMES: dict[str, int] = {"interactive": INTERACTIVE, "default": DEFAULT, "batch": BATCH}
_BY_VALUE = {v: k for k, v in CLASS_NAMES.items()}
# An integer class written as text has at most this many digits (within a signed 64-bit
# integer, as vLLM's `priority` is), so a huge header is not parsed.
_MAX_DIGITS = 18


def parse_class(raw: object) -> int:
    """The class `raw` names: a class name (any case, surrounding blanks ignored), an integer,
    or an integer written in ASCII digits with an optional sign. Raises ValueError otherwise
    (a bool is not an integer here)."""
    if isinstance(raw, bool):
        raise ValueError(f"a priority class is a name ({_names()}) or an integer, not {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        text = raw.strip()
        named = CLASS_NAMES.get(text.lower())
        if named is not None:
            return named
        digits = text[1:] if text[:1] in "+-" else text
        if digits and len(digits) <= _MAX_DIGITS and digits.isascii() and digits.isdigit():
            return int(text)
    shown = repr(raw) if len(repr(raw)) <= 40 else repr(raw)[:40] + "..."
    raise ValueError(f"a priority class is a name ({_names()}) or an integer, not {shown}")


def class_name(priority: int) -> str:
    """The class's name, or its integer as text when it has none."""
    return _BY_VALUE.get(priority, str(priority))


def _names() -> str:
    return ", ".join(CLASS_NAMES)
