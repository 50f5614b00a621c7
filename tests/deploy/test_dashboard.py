"""deploy/grafana: the dashboard's PromQL names only metrics our code exports (the gateway's and the
fleet's registries, as Prometheus sees them: counters with _total, histograms with _bucket/_sum/
_count) and groups by labels they carry, so the dashboard cannot drift from the code."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.backends.fleet.metrics import FleetMetrics
from gateway.ops.metrics import Metrics
from shared.engine_types import EngineStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ctxfuse-dashboard.json"
# labels Prometheus adds to every scraped series (ServiceMonitor target labels)
TARGET_LABELS = {"pod", "namespace", "instance", "job", "service", "container", "endpoint"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> tuple[set[str], set[str]]:
    """(series names, label names) our gateway (engine stats included) and router export."""
    stats = EngineStats(1, 0, 10, 20, 0.5, 64.0, 100, 40)
    metrics = Metrics(lambda: stats)
    FleetMetrics(metrics.registry)
    registry: CollectorRegistry = metrics.registry
    names: set[str] = set()
    labels: set[str] = {"le"}
    for family in registry.collect():
        names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
    for collector in list(registry._collector_to_names):  # labelled metrics show no sample until used
        labels |= set(getattr(collector, "_labelnames", ()))
    return names, labels


def expressions(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    out += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return out


def unknown_names(exprs: list[str], known: set[str]) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\bctxfuse_[a-z0-9_]+", e)} - known


def unknown_labels(exprs: list[str], known: set[str]) -> set[str]:
    grouped = {
        label.strip()
        for e in exprs
        for group in re.findall(r"\bby \(([^)]*)\)", e)
        for label in group.split(",")
    }
    matched = {m for e in exprs for m in re.findall(r"[{,]([a-z_]+)=~?\"", e)}
    return (grouped | matched) - known - TARGET_LABELS


def test_every_metric_the_dashboard_queries_is_one_our_code_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names, _ = exported()
    exprs = expressions(dashboard)
    used = {m for e in exprs for m in re.findall(r"\bctxfuse_[a-z0-9_]+", e)}
    assert len(used) >= 15 and unknown_names(exprs, names) == set()
    # what the dashboard is for: TTFT, ITL, queue, KV usage, prefix hits, errors, circuits, canary
    for wanted in (
        "time_to_first_token",
        "inter_token",
        "queue",
        "kv_cache_usage",
        "prefix_cache_hits",
        "backend_errors",
        "circuit_state",
        "canary_weight",
    ):
        assert any(wanted in m for m in used), wanted


def test_every_label_the_dashboard_groups_by_is_one_the_metrics_carry() -> None:
    _, labels = exported()
    assert unknown_labels(expressions(json.loads(DASHBOARD.read_text())), labels) == set()


def test_a_metric_or_label_our_code_does_not_export_is_caught() -> None:
    names, labels = exported()
    assert unknown_names(["rate(ctxfuse_made_up_tokens_total[5m])"], names) == {
        "ctxfuse_made_up_tokens_total"
    }
    assert unknown_names(["ctxfuse_kv_cache_usage_ratio_total"], names) == {
        "ctxfuse_kv_cache_usage_ratio_total"
    }
    assert unknown_labels(['sum by (colour) (ctxfuse_prompt_tokens_total{model="x"})'], labels) == {
        "colour",
        "model",
    }


def test_every_panel_has_a_unique_id_a_query_and_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in dashboard["panels"]:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
