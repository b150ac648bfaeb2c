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
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from e2e_cluster import PROMPT_TEXTS, start_cluster

from services.client import Client
from services.local_cluster import LocalCluster
from tests.prometheus_check import (
    Prometheus,
    check_dashboards,
    check_rules_evaluate,
    scraping,
    subscriber,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # The planner advises (it changes nothing) so that its gauges, which the overview dashboard
    # plots, have values to scrape.
    c = start_cluster(tmp_path_factory, "prometheus", metrics=True, scheduler_args=["--planner", "advise"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def prometheus(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    p = scraping(cluster, tmp_path_factory.mktemp("prometheus"))
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


def check_alerts(cluster: LocalCluster, prometheus: Prometheus) -> None:
    check_rules_evaluate(prometheus)

    decode = next(n for n in cluster.component_names() if n.startswith("decode"))
    cluster.kill(decode)
    wait_for(lambda: prometheus.firing("PdserveEngineDown"), 30, "PdserveEngineDown did not fire")
    [alert] = prometheus.firing("PdserveEngineDown")
    assert alert["labels"]["role"] == "decode"
    cluster.restart(decode)
    cluster.wait_ready(1, 1)
    wait_for(lambda: not prometheus.firing("PdserveEngineDown"), 60, "PdserveEngineDown did not resolve")


