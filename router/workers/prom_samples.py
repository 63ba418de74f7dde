"""The few samples a load poll reads from a Prometheus text, found by name.

A vLLM worker's `/metrics` is tens of kilobytes (histograms of every latency, bucket by
bucket); the load poll needs four gauges of it, once a second per worker while the router
serves. `prometheus_client`'s parser builds every family and sample of the text first: ~130 µs
for a ten-line text, ~7.7 ms for a 36 KB one shaped as vLLM's. Here one regular expression,
run by `re`'s C engine, finds only the lines of the names asked for (~50 µs on that text;
`python scripts/load_parse_cost.py`, docs/benchmarks-overhead.md).

What a sample line is (the text exposition format, version 0.0.4):

    name{label="value",...} value [timestamp]      or      name value [timestamp]

Label values are quoted, with `\\`, `\"` and `\n` escaped, so a `}` or `,` inside one does not
end the labels. Lines of other names, comments and blank lines are skipped unread.
tests/router/workers/test_prom_samples.py checks that this reads what `prometheus_client`'s
parser reads, on texts that library writes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

__all__ = ["Sample", "label_value", "samples"]

# A quoted label value: anything but a quote or a backslash, or a backslash escape. Written as
# runs between escapes ("unrolled"), not as an alternation tried character by character: `re`
# matches a run of a character class in one step, 3-5 x faster on vLLM's 1 KB info label set.
_QUOTED = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'
_UNESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"n": "\n", "\\": "\\", '"': '"'}


class Sample(NamedTuple):
    name: str
    labels: str  # what is between the braces, as written ("" without labels)
    value: float


def _pattern(names: Iterable[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    # A line start is a newline (the text gets one in front): a literal the engine searches
    # for quickly, where a multiline `^` is tried at every character (5 × slower on a vLLM
    # text: scripts/load_parse_cost.py).
    labels = rf'[^"}}\n]*(?:{_QUOTED}[^"}}\n]*)*'  # unquoted runs and quoted values, unrolled
    return re.compile(rf"\n({alternatives})(?:\{{({labels})\}})?[ \t]+([^ \t\n]+)")


_PATTERNS: dict[frozenset[str], re.Pattern[str]] = {}


def samples(text: str, names: frozenset[str]) -> Iterator[Sample]:
    """The samples of `names` in `text`, in order; a value that is not a number is skipped
    (the full parser refuses the whole text for it: one bad line from a worker should not
    cost the other readings)."""
    pattern = _PATTERNS.get(names)
    if pattern is None:
        pattern = _PATTERNS[names] = _pattern(names)
    for match in pattern.finditer("\n" + text):
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        yield Sample(match.group(1), match.group(2) or "", value)


_LABEL = re.compile(rf"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*({_QUOTED})\s*,?")


def label_value(labels: str, name: str) -> str | None:
    """The value of label `name` in a sample's labels (unescaped), None when it has none. The
    pairs are read in order from the first, so a value that quotes `name="..."` is not taken
    for the label."""
    for match in _LABEL.finditer(labels):
        if match.group(1) == name:
            return _UNESCAPE.sub(_unescaped, match.group(2)[1:-1])
    return None


def _unescaped(match: re.Match[str]) -> str:
    return _UNESCAPED.get(match.group(1), "\\" + match.group(1))
