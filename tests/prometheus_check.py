"""A real Prometheus (Debian's server; `make install-dev` puts it into the venv) over a local
cluster's /metrics, and the checks of the chart's dashboards and alert rules against it: every
panel query of helm/pdserve/dashboards/*.json, its template variables substituted, returns at
least one series; every metric a dashboard names is exported by some process; every alert rule
evaluates without error. Used by tests/e2e/test_prometheus.py (pdserve's engines) and
tests/vllm/test_vllm_serving.py (vLLM's). Fails, rather than skips, without the binary."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.local_cluster import LocalCluster, free_port

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "pdserve"
METRIC = re.compile(r"\bpdserve_[a-z0-9_]+\b")
RATE_INTERVAL = "20s"  # $__rate_interval: Grafana's 4 scrape intervals, and a few more
DOWN_FOR = "2s"  # PdserveEngineDown's `for:` here (the chart's: 1m)


def prometheus_binary() -> str:
    # beside this interpreter, or in the main venv (the vLLM suite runs in .venv-vllm)
    candidates = [Path(sys.executable).parent / "prometheus", ROOT / ".venv" / "bin" / "prometheus"]
    found = next((str(c) for c in candidates if c.exists()), None) or shutil.which("prometheus")
    if found is None:
        pytest.fail("prometheus not found: `make install-dev` installs it into the venv")
    return found


def alert_groups() -> list[dict[str, Any]]:
    """The chart's PrometheusRule groups, PdserveEngineDown's `for:` shortened."""
    import helm_python

    chart = helm_python.Chart.load(str(CHART))
    try:
        out = chart.render({"monitoring": {"prometheusRule": {"enabled": True}}}, name="demo", namespace="ns")
    finally:
        chart.close()
    (rule,) = [d for d in yaml.safe_load_all(out["pdserve/templates/prometheusrule.yaml"]) if d]
    groups = list(rule["spec"]["groups"])
    for r in (r for g in groups for r in g["rules"]):
        if r.get("alert") == "PdserveEngineDown":
            r["for"] = DOWN_FOR
    return groups


class Prometheus:
    """A Prometheus server on a free loopback port, scraping `targets` (name -> port) every second."""

    def __init__(self, workdir: Path, targets: dict[str, int]) -> None:
        self.port = free_port()
        (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": alert_groups()}))
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": ["rules.yaml"],
                  "scrape_configs": [{"job_name": "pdserve", "static_configs": [
                      {"targets": [f"127.0.0.1:{port}"], "labels": {"pod": name}} for name, port in targets.items()]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [prometheus_binary(), "--config.file", str(workdir / "prometheus.yml"), "--storage.tsdb.path",
             str(workdir / "data"), "--web.listen-address", f"127.0.0.1:{self.port}"],
            cwd=workdir, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self.proc.poll() is None, (workdir / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus not ready within 30 s"
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def firing(self, alert: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == alert and a["state"] == "firing"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}


def panel_queries(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield f"{panel['title']} [{target['refId']}]", target["expr"]


def substitutions(board: dict[str, Any], engines: dict[str, str]) -> list[dict[str, str]]:
    """Every assignment of the board's variables a user can pick here: a multi-value variable
    as All (.*) or one value, a single-value one as each value."""
    choices: dict[str, list[str]] = {"__rate_interval": [RATE_INTERVAL]}
    for var in board["templating"]["list"]:
        if var["name"] == "role":
            choices["role"] = [".*", *sorted(set(engines.values()))]
        elif var["name"] == "engine":
            choices["engine"] = ([".*"] if var["multi"] else []) + sorted(engines)
    names = list(choices)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(choices[n] for n in names))]


def substitute(expr: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${name}", values[name]).replace(f"${{{name}}}", values[name])
    assert "$" not in expr, f"an unsubstituted variable in {expr}"
    return expr


def exported_names(cluster: LocalCluster) -> set[str]:
    """Every metric name some process's /metrics declares (with samples or not)."""
    names: set[str] = set()
    for comp in cluster.components.values():
        if comp.metrics_port:
            with urllib.request.urlopen(f"http://127.0.0.1:{comp.metrics_port}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            names |= set(re.findall(r"^# TYPE (\S+)", text, re.M))
            names |= {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    return names


# Counters that only move on a failure, a refusal or a rare event (a healthy run under load
# has none): a query naming one may return nothing here — the test still requires that some
# process exports each of them.
EVENT_ONLY = {
    "pdserve_transfer_failures_total", "pdserve_transfer_transport_fallbacks_total",
    "pdserve_transfer_lease_expiries_total", "pdserve_scheduler_migrations_total",
    "pdserve_scheduler_retries_total", "pdserve_scheduler_decode_only_total",
    "pdserve_scheduler_registrations_refused_total", "pdserve_scheduler_client_refused_total",
    "pdserve_scheduler_control_reconnects_total", "pdserve_engine_control_reconnects_total",
    "pdserve_engine_preemptions_total", "pdserve_events_rejected_total", "pdserve_events_subscriber_resyncs_total",
    # Peer fetch is off by default (decision 0043): these move only when a fetch happens.
    "pdserve_kv_peer_fetch_blocks_total", "pdserve_kv_peer_fetch_bytes_total", "pdserve_kv_peer_fetch_failures_total",
    "pdserve_kv_peer_fetch_duration_seconds",
}


def check_dashboards(cluster: LocalCluster, prometheus: Prometheus, known_gaps: frozenset[str] = frozenset()) -> None:
    """Every panel query returns a series, but those of EVENT_ONLY metrics; `known_gaps`: metrics
    this cluster's engines are known not to feed yet — their queries must be exactly the empty
    rest (a new gap fails, and so does a gap that closed: the list must shrink with it)."""
    engines = {r["metric"]["engine"]: r["metric"]["role"] for r in prometheus.query("pdserve_engine_info")}
    assert set(engines.values()) == {"decode", "prefill"}, engines

    exported = exported_names(cluster)
    histogram_parts = re.compile(r"_(bucket|sum|count)$")
    empty: list[str] = []
    allowed: list[str] = []
    unexported: list[str] = []
    for name, board in dashboards().items():
        assignments = substitutions(board, engines)
        for where, expr in panel_queries(board):
            for metric in METRIC.findall(expr):
                if metric not in exported and histogram_parts.sub("", metric) not in exported:
                    unexported.append(f"{name}: {where}: {metric}")
            if not any(prometheus.query(substitute(expr, values)) for values in assignments):
                (allowed if {histogram_parts.sub("", m) for m in METRIC.findall(expr)} & EVENT_ONLY else empty).append(f"{name}: {where}: {expr}")
    assert not unexported, "dashboards name metrics no process exports:\n" + "\n".join(unexported)
    gaps = {histogram_parts.sub("", m) for line in empty for m in METRIC.findall(line)}
    if known_gaps:
        assert gaps == set(known_gaps), f"known gaps {sorted(known_gaps)}, found {sorted(gaps)}:\n" + "\n".join(empty)
        return
    assert not empty, f"{len(empty)} panel queries return no series:\n" + "\n".join(empty)
    print(f"\n{len(allowed)} queries of failure-only counters returned no series (none failed):\n"
          + "\n".join(allowed))


def wait_for(condition: Any, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.5)


def check_rules_evaluate(prometheus: Prometheus) -> None:
    """Every rule of the chart is loaded and evaluates without error."""
    rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert len(rules) == sum(len(g["rules"]) for g in alert_groups())
    broken = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not broken, broken


def subscriber(cluster: LocalCluster) -> subprocess.Popen[bytes]:
    """A KV-event subscriber (`pdserve events`): the subscriber gauges exist while it is connected."""
    return subprocess.Popen([sys.executable, "-m", "services.common.cli", "events", "--target",
                             cluster.events_target], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def scraping(cluster: LocalCluster, workdir: Path) -> Prometheus:
    """A Prometheus scraping every component of `cluster` that serves /metrics."""
    targets = {name: comp.metrics_port for name, comp in cluster.components.items() if comp.metrics_port}
    return Prometheus(workdir, targets)
