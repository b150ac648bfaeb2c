"""Dashboards and alert rules use only catalogue metrics, are well formed, and the alerts fire
when they should (`promtool test rules`). `make install-dev` puts promtool into the venv (from
Debian's prometheus package); these tests fail rather than skip without it."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from services.common.metrics import CATALOGUE, exported_series

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "pdserve"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
METRIC = re.compile(r"\bpdserve_[a-z0-9_]+\b")


def promtool() -> str:
    """The venv's promtool (installed by `make install-dev`), else one on PATH."""
    beside = Path(sys.executable).parent / "promtool"
    found = str(beside) if beside.exists() else shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: `make install-dev` installs it into the venv")
    return found


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        board = load(path)
        out += [(f"{path.name}: {p['title']}", t["expr"]) for p in panels(board) for t in p["targets"]]
        out += [(f"{path.name}: ${v['name']}", v["query"]) for v in board["templating"]["list"]
                if v["type"] == "query"]
    return out


def alert_rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The PrometheusRule's groups as rendered by the chart."""
    chart = helm_python.Chart.load(str(CHART))
    try:
        out = chart.render({"monitoring": {"prometheusRule": {"enabled": True}}, **(values or {})},
                           name="demo", namespace="ns")
    finally:
        chart.close()
    (rule,) = [d for d in yaml.safe_load_all(out["pdserve/templates/prometheusrule.yaml"]) if d]
    return list(rule["spec"]["groups"])


def alert_exprs() -> list[tuple[str, str]]:
    return [(r["alert"], r["expr"]) for g in alert_rules() for r in g["rules"]]


def hpa_metric_names() -> list[str]:
    text = (CHART / "templates" / "hpa.yaml").read_text()
    return re.findall(r"name: (pdserve_[a-z0-9_]+)", text)


# ---------------------------------------------------------------- catalogue references


def test_every_query_references_only_catalogue_metrics() -> None:
    exported = exported_series()
    exprs = dashboard_exprs() + alert_exprs()
    assert len(exprs) > 60
    for where, expr in exprs:
        names = set(METRIC.findall(expr))
        assert names, f"{where}: no pdserve metric in {expr!r}"
        assert names <= exported, f"{where}: unknown metrics {names - exported}"
    for name in hpa_metric_names():
        assert name in exported


def test_reference_check_catches_a_renamed_metric() -> None:
    assert not {"pdserve_scheduler_ttft_seconds_bucket"} <= exported_series()
    assert "pdserve_scheduler_time_to_first_token_seconds_bucket" in exported_series()


def test_the_dashboards_cover_the_catalogue() -> None:
    """Every catalogue metric appears on some dashboard (an unwatched metric is dead weight)."""
    used = {n for _, e in dashboard_exprs() for n in METRIC.findall(e)}
    base = {re.sub(r"_(bucket|sum|count)$", "", n) if CATALOGUE.get(n) is None else n for n in used}
    missing = set(CATALOGUE) - base
    assert not missing, f"metrics on no dashboard: {sorted(missing)}"


# ---------------------------------------------------------------- dashboard structure


def test_dashboards_are_generated_and_in_sync() -> None:
    spec = importlib.util.spec_from_file_location("gen_dashboards", ROOT / "helm" / "gen_dashboards.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert {p.name: p.read_text() for p in DASHBOARDS} == gen.render_all(), \
        "dashboards drifted: run python helm/gen_dashboards.py"


def test_dashboard_structure() -> None:
    assert {p.name for p in DASHBOARDS} == {"pdserve-overview.json", "pdserve-disaggregation.json",
                                           "pdserve-kv-events.json", "pdserve-engine.json"}
    uids = set()
    for path in DASHBOARDS:
        board = load(path)
        assert board["uid"] not in uids and len(board["uid"]) <= 40
        uids.add(board["uid"])
        assert board["title"] and isinstance(board["schemaVersion"], int)
        variables = {v["name"]: v for v in board["templating"]["list"]}
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        cells: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, (path.name, panel["title"])
            covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
            assert not covered & cells, f"{path.name}: {panel['title']} overlaps another panel"
            cells |= covered
        for panel in panels(board):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["type"] in ("timeseries", "stat", "table"), panel["type"]
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                for var in re.findall(r"\$(\w+)", target["expr"]):
                    assert var.startswith("__") or var in variables, f"{path.name}: undefined ${var}"


def test_engine_and_role_variables_and_the_pair_matrix() -> None:
    for name in ("pdserve-kv-events.json", "pdserve-engine.json"):
        variables = {v["name"]: v for v in load(CHART / "dashboards" / name)["templating"]["list"]}
        assert {"role", "engine"} <= set(variables)
        assert "pdserve_engine_info" in variables["engine"]["query"]
    board = load(CHART / "dashboards" / "pdserve-disaggregation.json")
    matrices = [p for p in panels(board) if p["type"] == "table"]
    assert len(matrices) == 3
    for panel in matrices:
        (transform,) = panel["transformations"]
        assert transform["id"] == "groupingToMatrix"
        assert (transform["options"]["rowField"], transform["options"]["columnField"]) == ("src_engine", "dst_engine")
        assert "by (src_engine, dst_engine" in panel["targets"][0]["expr"] or \
            "le, src_engine, dst_engine" in panel["targets"][0]["expr"]
        assert panel["targets"][0]["instant"] is True


# ---------------------------------------------------------------- promtool


def _write_rules(tmp_path: Path, groups: list[dict[str, Any]]) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_promtool_accepts_alerts_and_every_dashboard_query(tmp_path: Path) -> None:
    tool = promtool()
    rules = _write_rules(tmp_path, alert_rules())
    subprocess.run([tool, "check", "rules", str(rules)], check=True, capture_output=True, timeout=60)
    # dashboard queries as recording rules: promtool parses each one
    substitutions = {"$__rate_interval": "5m", '"$engine"': '"prefill-0"', '"$role"': '"prefill"'}
    recording = []
    for i, (_, expr) in enumerate(dashboard_exprs()):
        for old, new in substitutions.items():
            expr = expr.replace(old, new)
        if expr.startswith("label_values("):
            expr = expr[len("label_values("):].rsplit(",", 1)[0]
        recording.append({"record": f"pdserve:dashboard_query_{i}", "expr": expr})
    (tmp_path / "dash").mkdir()
    dash = _write_rules(tmp_path / "dash", [{"name": "dashboards", "rules": recording}])
    result = subprocess.run([tool, "check", "rules", str(dash)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


ALERT_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'pdserve_scheduler_time_to_first_token_seconds_bucket{le="2.5", path="disaggregated"}'
        values: '0x40'
      - series: 'pdserve_scheduler_time_to_first_token_seconds_bucket{le="5.0", path="disaggregated"}'
        values: '0+10x40'
      - series: 'pdserve_scheduler_time_to_first_token_seconds_bucket{le="+Inf", path="disaggregated"}'
        values: '0+10x40'
      - series: 'pdserve_scheduler_aggregator_oldest_pending_age_seconds{engine="prefill-0"}'
        values: '45x40'
      - series: 'pdserve_scheduler_aggregator_oldest_pending_age_seconds{engine="prefill-1"}'
        values: '0x40'
      - series: 'pdserve_transfer_operations_total{src_engine="prefill-0", dst_engine="decode-0", rank="0"}'
        values: '0+10x40'
      - series: 'pdserve_transfer_failures_total{src_engine="prefill-0", dst_engine="decode-0", reason="timeout", rank="0"}'
        values: '0+2x40'
      - series: 'pdserve_engine_prompt_tokens_total{engine="prefill-0", role="prefill"}'
        values: '0+100x40'
      - series: 'pdserve_engine_prompt_tokens_total{engine="prefill-1", role="prefill"}'
        values: '0+100x40'
      - series: 'pdserve_events_received_total{engine="prefill-1", type="BlockStored", medium="GPU"}'
        values: '0+5x40'
      - series: 'pdserve_scheduler_requests_in_flight'
        values: '1x40'
      - series: 'pdserve_scheduler_registered_engines{role="decode", state="unhealthy"}'
        values: '1x40'
      - series: 'pdserve_scheduler_registered_engines{role="prefill", state="routable"}'
        values: '1x40'
    alert_rule_test:
      - {eval_time: 30m, alertname: PdserveEngineDown, exp_alerts: [{exp_labels: {severity: critical, role: decode}}]}
      - {eval_time: 30m, alertname: PdserveTTFTAboveSLO, exp_alerts: [{exp_labels: {severity: warning}}]}
      - {eval_time: 30m, alertname: PdserveRankPendingTooLong,
         exp_alerts: [{exp_labels: {severity: critical, engine: prefill-0}}]}
      - {eval_time: 30m, alertname: PdserveTransferFailuresRising,
         exp_alerts: [{exp_labels: {severity: warning, src_engine: prefill-0, dst_engine: decode-0}}]}
      - {eval_time: 30m, alertname: PdserveEngineSendsNoEvents,
         exp_alerts: [{exp_labels: {severity: warning, engine: prefill-0}}]}
      - {eval_time: 30m, alertname: PdserveSchedulerAbsent, exp_alerts: []}
  - interval: 1m
    input_series:
      - series: 'pdserve_scheduler_time_to_first_token_seconds_bucket{le="0.25", path="disaggregated"}'
        values: '0+10x40'
      - series: 'pdserve_scheduler_time_to_first_token_seconds_bucket{le="+Inf", path="disaggregated"}'
        values: '0+10x40'
      - series: 'pdserve_events_subscriber_lag_batches{transport="grpc"}'
        values: '600x40'
      - series: 'pdserve_transfer_operations_total{src_engine="prefill-0", dst_engine="decode-0"}'
        values: '0+10x40'
      - series: 'pdserve_transfer_failures_total{src_engine="prefill-0", dst_engine="decode-0", reason="timeout"}'
        values: '0x40'
    alert_rule_test:
      - {eval_time: 30m, alertname: PdserveTTFTAboveSLO, exp_alerts: []}
      - {eval_time: 30m, alertname: PdserveTransferFailuresRising, exp_alerts: []}
      - {eval_time: 30m, alertname: PdserveEngineDown, exp_alerts: []}
      - {eval_time: 30m, alertname: PdserveSubscriberLagging,
         exp_alerts: [{exp_labels: {severity: warning, transport: grpc}}]}
      - {eval_time: 30m, alertname: PdserveSchedulerAbsent, exp_alerts: [{exp_labels: {severity: critical}}]}
"""


def _strip_annotations(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """promtool compares annotations exactly; these tests are about when alerts fire."""
    return [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
            for g in groups]


def test_alerts_fire_when_they_should(tmp_path: Path) -> None:
    tool = promtool()
    _write_rules(tmp_path, _strip_annotations(alert_rules()))
    (tmp_path / "alerts_test.yaml").write_text(ALERT_TESTS)
    result = subprocess.run([tool, "test", "rules", "alerts_test.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_thresholds_come_from_values() -> None:
    """The SLO in values reaches the rendered rule."""
    groups = alert_rules({"monitoring": {"prometheusRule": {"enabled": True, "thresholds": {"ttftP99Seconds": 12.5}}}})
    (ttft,) = [r for g in groups for r in g["rules"] if r["alert"] == "PdserveTTFTAboveSLO"]
    assert ttft["expr"].split()[-2:] == [">", "12.5"]
