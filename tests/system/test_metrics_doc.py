"""docs/metrics.md stays true to router/metrics.py: every metric of RouterMetrics has a row with
its exposed name, type and labels, and every row names a metric that exists."""

from __future__ import annotations

import re

from prometheus_client.metrics import MetricWrapperBase

from router.metrics import RouterMetrics
from tests.compose_services import ROOT

METRICS_DOC = ROOT / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `(?P<name>[a-z_:]+)` \| (?P<type>\w+) \| (?P<labels>[^|]*) \| .+ \|$")


def _documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, labels) from the rows of docs/metrics.md's table."""
    rows: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in METRICS_DOC.read_text().splitlines():
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


def test_every_router_metric_is_in_the_metrics_doc() -> None:
    exported, documented = _exported(), _documented()
    assert len(exported) >= 30, len(exported)
    missing = sorted(set(exported) - set(documented))
    assert not missing, f"add these to the table of docs/metrics.md: {missing}"


def test_every_metrics_doc_row_is_a_router_metric_with_its_type_and_labels() -> None:
    exported, documented = _exported(), _documented()
    stale = sorted(set(documented) - set(exported))
    assert not stale, f"docs/metrics.md lists metrics router/metrics.py does not have: {stale}"
    wrong = {n: (documented[n], exported[n]) for n in documented if documented[n] != exported[n]}
    assert not wrong, f"docs/metrics.md (type, labels) vs code: {wrong}"
