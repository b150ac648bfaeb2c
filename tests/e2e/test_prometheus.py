"""The chart's dashboards and alert rules in a real Prometheus (Debian's server; `make
install-dev` puts it into the venv): it scrapes a local cluster with `--metrics` (what `pdserve up
--metrics` starts) under load; every panel query of helm/pdserve/dashboards/*.json, its template
variables substituted, returns at least one series; every metric a dashboard names is exported
by some process; every alert rule evaluates without error; killing the decode engine fires
PdserveEngineDown (its `for:` shortened) and restarting it resolves the alert. Fails, rather than
skips, without the prometheus binary."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_cluster import PROMPT_TEXTS, start_cluster

from services.client import Client
from services.local_cluster import LocalCluster, free_port

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
METRIC = re.compile(r"\bpdserve_[a-z0-9_]+\b")
RATE_INTERVAL = "20s"  # $__rate_interval: Grafana's 4 scrape intervals, and a few more
DOWN_FOR = "2s"  # PdserveEngineDown's `for:` here (the chart's: 1m)


def prometheus_binary() -> str:
    beside = Path(sys.executable).parent / "prometheus"
    found = str(beside) if beside.exists() else shutil.which("prometheus")
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # The planner advises (it changes nothing) so that its gauges, which the overview dashboard
    # plots, have values to scrape.
    c = start_cluster(tmp_path_factory, "prometheus", metrics=True, scheduler_args=["--planner", "advise"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def prometheus(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    targets = {name: comp.metrics_port for name, comp in cluster.components.items() if comp.metrics_port}
    assert len(targets) == 3, targets
    p = Prometheus(tmp_path_factory.mktemp("prometheus"), targets)
    yield p
    p.close()


def http_requests(cluster: LocalCluster) -> None:
    """OpenAI completions through the HTTP API, and one it refuses (400)."""
    with urllib.request.urlopen(f"{cluster.http_url}/models", timeout=30) as reply:
        [card] = json.loads(reply.read())["data"]
    model = card["id"]
    for body in ({"model": model, "prompt": PROMPT_TEXTS[0], "max_tokens": 4}, {"model": model, "prompt": 7}):
        request = urllib.request.Request(f"{cluster.http_url}/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=60).close()
        except urllib.error.HTTPError as e:
            assert e.code == 400, e


def subscriber(cluster: LocalCluster) -> subprocess.Popen[bytes]:
    """A KV-event subscriber (`pdserve events`): the subscriber gauges exist while it is connected."""
    return subprocess.Popen([sys.executable, "-m", "services.common.cli", "events", "--target",
                             cluster.events_target], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# Several KV blocks every prompt shares: routing finds them in the prefix index (prefix hits).
SHARED_PREFIX = "You are a helpful assistant. Answer briefly, in plain words, and do not repeat the question. " * 3


def load(cluster: LocalCluster, seconds: float) -> None:
    """Requests from two threads for `seconds` (a shared prefix: prefix hits) and through the
    HTTP API."""
    http_requests(cluster)
    deadline = time.monotonic() + seconds

    def worker(offset: int) -> None:
        with Client(cluster.target) as client:
            for i in itertools.count(offset):
                if time.monotonic() > deadline:
                    return
                client.generate(SHARED_PREFIX + PROMPT_TEXTS[i % len(PROMPT_TEXTS)], max_tokens=8, temperature=0.0)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


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


def test_dashboards_and_alerts_in_prometheus(cluster: LocalCluster, prometheus: Prometheus) -> None:
    events = subscriber(cluster)
    try:
        load(cluster, 25.0)
        time.sleep(2.0)  # the last scrape after the load
        check_dashboards(cluster, prometheus)
    finally:
        events.terminate()
        events.wait(timeout=30)
    check_alerts(cluster, prometheus)


def check_dashboards(cluster: LocalCluster, prometheus: Prometheus) -> None:
    engines = {r["metric"]["engine"]: r["metric"]["role"] for r in prometheus.query("pdserve_engine_info")}
    assert sorted(engines.values()) == ["decode", "prefill"], engines

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
    assert not empty, f"{len(empty)} panel queries return no series:\n" + "\n".join(empty)
    print(f"\n{len(allowed)} queries of failure-only counters returned no series (none failed):\n"
          + "\n".join(allowed))


def check_alerts(cluster: LocalCluster, prometheus: Prometheus) -> None:
    rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert len(rules) == sum(len(g["rules"]) for g in alert_groups())
    broken = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not broken, broken

    decode = next(n for n in cluster.component_names() if n.startswith("decode"))
    cluster.kill(decode)
    wait_for(lambda: prometheus.firing("PdserveEngineDown"), 30, "PdserveEngineDown did not fire")
    [alert] = prometheus.firing("PdserveEngineDown")
    assert alert["labels"]["role"] == "decode"
    cluster.restart(decode)
    cluster.wait_ready(1, 1)
    wait_for(lambda: not prometheus.firing("PdserveEngineDown"), 60, "PdserveEngineDown did not resolve")


def wait_for(condition: Any, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.5)
