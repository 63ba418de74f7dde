"""Label and field selectors, parsed and matched as the Kubernetes API does.

Label selectors (apimachinery `labels.Parse`): requirements joined by commas, all of which must
hold. `key`, `!key`, `key=v`, `key==v`, `key!=v`, `key in (a,b)`, `key notin (a,b)`, `key>n`,
`key<n`. `!=` and `notin` also match an object that lacks the label; `in` needs a non-empty set.

Field selectors (`fields.ParseSelector`): `field=v`, `field==v`, `field!=v` joined by commas, over
the fields a resource supports (`metadata.name`, `metadata.namespace` for every resource; pods
add the ones their registry indexes). An unsupported field is a 400, as on a real API server.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FieldSelector",
    "LabelSelector",
    "SelectorError",
    "parse_field_selector",
    "parse_label_selector",
]

Obj = dict[str, Any]

_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


class SelectorError(ValueError):
    """A selector the API server would refuse with 400 BadRequest."""


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    op: str  # "exists", "!", "=", "!=", "in", "notin", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key, "")
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        # gt / lt: the label must be an integer; a non-integer never matches.
        if not present or not re.fullmatch(r"-?\d+", value):
            return False
        bound = int(self.values[0])
        return int(value) > bound if self.op == "gt" else int(value) < bound


@dataclass(frozen=True, slots=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        return all(r.matches(labels or {}) for r in self.requirements)


_TOKEN = re.compile(r"\s*(==|!=|=|>|<|\(|\)|,|!|[^\s=!<>(),]+)")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:  # pragma: no cover - the pattern matches any non-blank character
            raise SelectorError(f"unable to parse requirement: {text[pos:]!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


def _check_key(key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if not _NAME.match(name) or (prefix and (len(prefix) > 253 or not _PREFIX.match(prefix))):
        raise SelectorError(f"unable to parse requirement: invalid label key {key!r}")


def _check_value(value: str) -> None:
    if not _VALUE.match(value):
        raise SelectorError(f"unable to parse requirement: invalid label value {value!r}")


_OPERATORS = {"=": "=", "==": "=", "!=": "!=", "in": "in", "notin": "notin", ">": "gt", "<": "lt"}


def parse_label_selector(text: str | None) -> LabelSelector:
    """`text` as a label selector; empty or None selects everything."""
    toks = _tokens(text or "")
    reqs: list[Requirement] = []
    i = 0

    def take() -> str:
        nonlocal i
        if i >= len(toks):
            raise SelectorError(f"unable to parse requirement: {text!r} ends early")
        i += 1
        return toks[i - 1]

    while i < len(toks):
        tok = take()
        if tok == "!":
            key = take()
            _check_key(key)
            reqs.append(Requirement(key, "!"))
        else:
            key = tok
            _check_key(key)
            if i >= len(toks) or toks[i] == ",":
                reqs.append(Requirement(key, "exists"))
            else:
                op = _OPERATORS.get(take())
                if op is None:
                    raise SelectorError(f"unable to parse requirement: bad operator in {text!r}")
                if op in ("in", "notin"):
                    if take() != "(":
                        raise SelectorError(f"unable to parse requirement: '(' expected: {text!r}")
                    values: list[str] = []
                    while (tok := take()) != ")":
                        if tok == ",":
                            continue
                        _check_value(tok)
                        values.append(tok)
                    if not values:
                        raise SelectorError(
                            "for 'in', 'notin' operators, values set can't be empty"
                        )
                    reqs.append(Requirement(key, op, tuple(values)))
                else:
                    # `key=` selects the empty value: the next token is a comma or the end.
                    value = "" if i >= len(toks) or toks[i] == "," else take()
                    if op in ("gt", "lt") and not re.fullmatch(r"-?\d+", value):
                        raise SelectorError(f"unable to parse requirement: {value!r} not an int")
                    if op not in ("gt", "lt"):
                        _check_value(value)
                    reqs.append(Requirement(key, op, (value,)))
        if i < len(toks):
            if take() != ",":
                raise SelectorError(f"unable to parse requirement: ',' expected in {text!r}")
            if i >= len(toks):
                raise SelectorError(f"unable to parse requirement: {text!r} ends in a comma")
    return LabelSelector(tuple(reqs))


# ── field selectors ───────────────────────────────────────────────────────────────────────────


def _path(*keys: str) -> Callable[[Obj], str]:
    def read(obj: Obj) -> str:
        node: Any = obj
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, bool):
            return "true" if node else "false"
        return "" if node is None else str(node)

    return read


_COMMON_FIELDS = {
    "metadata.name": _path("metadata", "name"),
    "metadata.namespace": _path("metadata", "namespace"),
}
# The fields the pod registry indexes (pkg/registry/core/pod/strategy.go, ToSelectableFields).
POD_FIELDS = {
    **_COMMON_FIELDS,
    "spec.nodeName": _path("spec", "nodeName"),
    "spec.restartPolicy": _path("spec", "restartPolicy"),
    "spec.schedulerName": _path("spec", "schedulerName"),
    "spec.serviceAccountName": _path("spec", "serviceAccountName"),
    "spec.hostNetwork": _path("spec", "hostNetwork"),
    "status.phase": _path("status", "phase"),
    "status.podIP": _path("status", "podIP"),
    "status.nominatedNodeName": _path("status", "nominatedNodeName"),
}
COMMON_FIELDS = _COMMON_FIELDS


@dataclass(frozen=True, slots=True)
class FieldSelector:
    terms: tuple[tuple[Callable[[Obj], str], bool, str], ...] = ()  # (reader, equal?, value)

    def matches(self, obj: Obj) -> bool:
        return all((read(obj) == value) == equal for read, equal, value in self.terms)


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, cur, escaped = [], "", False
    for ch in text:
        if escaped:
            cur += ch
            escaped = False
        elif ch == "\\":
            cur += ch
            escaped = True
        elif ch == sep:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def parse_field_selector(
    text: str | None, fields: Mapping[str, Callable[[Obj], str]]
) -> FieldSelector:
    """`text` as a field selector over `fields`; empty or None selects everything."""
    terms = []
    for part in _split_unescaped(text or "", ","):
        if not part.strip():
            continue
        m = re.match(r"^([^=!]+?)\s*(==|!=|=)\s*(.*)$", part.strip())
        if m is None:
            raise SelectorError(f"invalid selector: {part!r}; can't understand {part!r}")
        name, op, value = m.groups()
        reader = fields.get(name.strip())
        if reader is None:
            raise SelectorError(f"field label not supported: {name.strip()}")
        terms.append((reader, op != "!=", _unescape(value)))
    return FieldSelector(tuple(terms))
