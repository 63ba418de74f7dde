"""The README's metrics table stays true to router/metrics.py: every metric of RouterMetrics has
a row with its exposed name, type and labels, and every row names a metric that exists."""

from __future__ import annotations

import re

from prometheus_client.metrics import MetricWrapperBase

from router.metrics import RouterMetrics
from tests.compose_services import ROOT

_ROW = re.compile(r"^\| `(?P<name>[a-z_:]+)` \| (?P<type>\w+) \| (?P<labels>[^|]*) \| .+ \|$")


def _documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, labels) from the rows of the README's "## Metrics" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m is None:
            continue
        assert m["name"] not in rows, f"{m['name']} is listed twice"
        labels = tuple(re.findall(r"`([a-z_]+)`", m["labels"]))
        rows[m["name"]] = (m["type"], labels)
    return rows


def _exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, labels) of every metric RouterMetrics registers, as exposed."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for metric in vars(RouterMetrics()).values():
        if isinstance(metric, MetricWrapperBase):
            kind = metric._type  # prometheus_client keeps these as plain attributes
            name = metric._name + ("_total" if kind == "counter" else "")
            out[name] = (str(kind), tuple(metric._labelnames))
    return out


def test_every_router_metric_is_in_the_readme() -> None:
    exported, documented = _exported(), _documented()
    assert len(exported) >= 30, len(exported)
    missing = sorted(set(exported) - set(documented))
    assert not missing, f"add these to the README's Metrics table: {missing}"


def test_every_readme_row_is_a_router_metric_with_its_type_and_labels() -> None:
    exported, documented = _exported(), _documented()
    stale = sorted(set(documented) - set(exported))
    assert not stale, f"the README lists metrics router/metrics.py does not have: {stale}"
    wrong = {n: (documented[n], exported[n]) for n in documented if documented[n] != exported[n]}
    assert not wrong, f"README (type, labels) vs code: {wrong}"
