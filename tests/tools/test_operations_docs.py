"""The operator's material names what the connector exports: the Grafana dashboard and docs/operations.md.

The series names come from the connector's own tables
(vllm_kvcodec/connector/prom_metrics.py), so a renamed or removed metric
fails here instead of leaving a dashboard panel empty.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from vllm_kvcodec.connector.prom_metrics import COUNTERS, HISTOGRAMS, PREFIX, exported_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana_kvcodec.json"
METRIC = re.compile(r"vllm:[a-z_:]+")


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variable queries."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        exprs += [query["query"]] if isinstance(query, dict) else []
    return exprs


def test_the_dashboard_is_valid_json_whose_queries_name_only_exported_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"])
    named = {m for e in queries(dashboard) for m in METRIC.findall(e)}
    assert named and named <= exported_names(), named - exported_names()
    for needed in ("hit_chunks_total", "lookup_chunks_total", "saved_raw_bytes_total", "load_failures_total",
                   "lookups_given_up_total", "prefetch_used_bytes_total", "prefetch_wasted_bytes_total"):
        assert PREFIX + needed in named  # hit rate, bytes saved, load-failure rate, lookups given up, prefetch use


def test_the_operations_page_describes_every_series_and_queries_only_exported_ones() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    for name in [f"{PREFIX}{c.name}_total" for c in COUNTERS] + [PREFIX + h.name for h in HISTOGRAMS]:
        assert f"`{name}`" in page, f"{name} is exported but not described in docs/operations.md"
    promql = "\n".join(re.findall(r"```promql\n(.*?)```", page, re.S))
    named = set(METRIC.findall(promql))
    assert named and named <= exported_names(), named - exported_names()
