"""Generates the Grafana dashboards in helm/pdserve/dashboards/ (checked in; a test fails on drift).

Every query uses metric names from services/common/metrics.py's catalogue only. Each dashboard
has a Prometheus datasource variable; engine and role variables come from `pdserve_engine_info`.

    python helm/gen_dashboards.py           # rewrite the JSON files
    python helm/gen_dashboards.py --check   # exit 1 when a checked-in dashboard drifted
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "pdserve" / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
ENG = 'engine=~"$engine"'
ROLE = 'role=~"$role"'


def q(expr: str, legend: str = "", *, instant: bool = False) -> dict[str, Any]:
    target: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        target.update(instant=True, range=False, format="table")
    return target


def pct(quantile: float, metric: str, by: str = "", selector: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return (f"histogram_quantile({quantile}, sum by ({group}) "
            f"(rate({metric}_bucket{{{selector}}}[{RI}])))")


class Board:
    """Lays panels out left to right, 24 columns wide, and numbers them."""

    def __init__(self, uid: str, title: str, description: str, variables: list[dict[str, Any]]) -> None:
        self.uid, self.title, self.description = uid, title, description
        self.variables = variables
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = self.row_h = 0

    def _place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.panels.append({"id": len(self.panels) + 1, "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def panel(self, kind: str, title: str, targets: list[dict[str, Any]], unit: str = "short", *,
              w: int = 12, h: int = 8, description: str = "", transformations: list[dict[str, Any]] | None = None,
              options: dict[str, Any] | None = None) -> None:
        for i, t in enumerate(targets):
            t["refId"] = chr(ord("A") + i)
        panel: dict[str, Any] = {
            "id": len(self.panels) + 1, "type": kind, "title": title, "description": description,
            "datasource": DS, "gridPos": self._place(w, h), "targets": targets,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": options or {},
        }
        if transformations:
            panel["transformations"] = transformations
        self.panels.append(panel)

    def ts(self, title: str, targets: list[dict[str, Any]], unit: str = "short", **kw: Any) -> None:
        self.panel("timeseries", title, targets, unit,
                   options={"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
                            "tooltip": {"mode": "multi", "sort": "desc"}}, **kw)

    def stat(self, title: str, expr: str, unit: str = "short", **kw: Any) -> None:
        self.panel("stat", title, [q(expr)], unit, w=kw.pop("w", 6), h=kw.pop("h", 4),
                   options={"reduceOptions": {"calcs": ["lastNotNull"], "values": False, "fields": ""},
                            "colorMode": "value", "graphMode": "area"}, **kw)

    def matrix(self, title: str, expr: str, unit: str, **kw: Any) -> None:
        """A prefill (rows) × decode (columns) table from an instant query by src/dst engine."""
        self.panel("table", title, [q(expr, instant=True)], unit, w=kw.pop("w", 8), h=kw.pop("h", 9),
                   transformations=[{"id": "groupingToMatrix", "options": {
                       "rowField": "src_engine", "columnField": "dst_engine", "valueField": "Value",
                       "emptyValue": "null"}}],
                   options={"showHeader": True, "cellHeight": "sm"}, **kw)

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "title": self.title, "description": self.description,
            "tags": ["pdserve"], "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
            "annotations": {"list": []}, "links": [
                {"type": "dashboards", "tags": ["pdserve"], "asDropdown": True, "title": "pdserve",
                 "includeVars": True, "keepTime": True}],
            "templating": {"list": self.variables}, "panels": self.panels,
        }


def datasource_var() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}


def label_var(name: str, label: str, query: str, *, multi: bool = True) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
            "refresh": 2, "sort": 1, "multi": multi, "includeAll": multi,
            "allValue": ".*" if multi else None, "current": {}, "hide": 0, "options": [], "regex": ""}


ROLE_VAR = label_var("role", "Role", "label_values(pdserve_engine_info, role)")
ENGINE_VAR = label_var("engine", "Engine", 'label_values(pdserve_engine_info{role=~"$role"}, engine)')


def overview() -> Board:
    b = Board("pdserve-overview", "pdserve / Overview", "Traffic, latency percentiles and errors at the scheduler.",
              [datasource_var()])
    b.stat("Requests / s", f"sum(rate(pdserve_scheduler_requests_total[{RI}]))", "reqps")
    b.stat("In flight", "sum(pdserve_scheduler_requests_in_flight)")
    b.stat("Error ratio", f'sum(rate(pdserve_scheduler_requests_total{{outcome="error"}}[{RI}])) '
                          f"/ sum(rate(pdserve_scheduler_requests_total[{RI}]))", "percentunit")
    b.stat("TTFT p99", pct(0.99, "pdserve_scheduler_time_to_first_token_seconds"), "s")
    b.row("Traffic")
    b.ts("Requests by outcome", [q(f"sum by (outcome) (rate(pdserve_scheduler_requests_total[{RI}]))",
                                   "{{outcome}}")], "reqps")
    b.ts("Tokens / s", [q(f"sum(rate(pdserve_scheduler_prompt_tokens_total[{RI}]))", "prompt"),
                        q(f"sum(rate(pdserve_scheduler_generation_tokens_total[{RI}]))", "generated")])
    b.row("Latency")
    b.ts("Time to first token", [q(pct(p, "pdserve_scheduler_time_to_first_token_seconds", "path"),
                                   f"p{int(p * 100)} {{{{path}}}}") for p in (0.5, 0.9, 0.99)], "s")
    b.ts("Inter-token latency", [q(pct(p, "pdserve_scheduler_inter_token_latency_seconds"), f"p{int(p * 100)}")
                                 for p in (0.5, 0.9, 0.99)], "s")
    b.ts("End-to-end latency", [q(pct(p, "pdserve_scheduler_e2e_request_latency_seconds", "path"),
                                  f"p{int(p * 100)} {{{{path}}}}") for p in (0.5, 0.99)], "s")
    b.ts("Queue time", [q(pct(p, "pdserve_scheduler_queue_time_seconds"), f"p{int(p * 100)}")
                        for p in (0.5, 0.99)], "s")
    b.row("Routing and recovery")
    b.ts("Routing decisions", [q(f"sum by (role, policy, reason) (rate(pdserve_scheduler_routing_decisions_total[{RI}]))",
                                 "{{role}} {{policy}}/{{reason}}")], "ops")
    b.ts("Path decisions by reason", [
        q(f"sum by (reason) (rate(pdserve_scheduler_path_decisions_total[{RI}]))", "{{reason}}")], "ops")
    b.ts("Path TTFT prediction error (|predicted - actual| / actual)", [
        q(pct(p, "pdserve_scheduler_path_ttft_prediction_error_ratio", "path"), f"p{int(p * 100)} {{{{path}}}}")
        for p in (0.5, 0.9)], "percentunit")
    b.ts("Prompt tokens: transferred vs total", [
        q(f"sum(rate(pdserve_scheduler_transferred_tokens_total[{RI}]))", "transferred (pulled by decode)"),
        q(f"sum(rate(pdserve_scheduler_prompt_tokens_total[{RI}]))", "prompt")])
    b.ts("KV hit rate by tier: own cache, peer fetch, recomputed", [
        q(f"sum by (tier) (rate(pdserve_kv_prompt_tokens_by_tier_total[{RI}])) / ignoring(tier) group_left "
          f"sum(rate(pdserve_kv_prompt_tokens_by_tier_total[{RI}]))", "{{tier}}")], "percentunit")
    b.ts("Peer fetches: blocks / s, failures / s, p90 duration", [
        q(f"sum by (source, target) (rate(pdserve_kv_peer_fetch_blocks_total[{RI}]))", "blocks {{source}} -> {{target}}"),
        q(f"sum by (reason) (rate(pdserve_kv_peer_fetch_failures_total[{RI}]))", "failed {{reason}}"),
        q(f"sum by (source, target) (rate(pdserve_kv_peer_fetch_bytes_total[{RI}])) / 1e6", "MB/s {{source}} -> {{target}}"),
        q(pct(0.9, "pdserve_kv_peer_fetch_duration_seconds"), "p90 duration (s)")])
    b.ts("Decode-only, migrations, retries", [
        q(f"sum by (reason) (rate(pdserve_scheduler_decode_only_total[{RI}]))", "decode-only {{reason}}"),
        q(f"sum by (reason) (rate(pdserve_scheduler_migrations_total[{RI}]))", "migration {{reason}}"),
        q(f"sum by (role, reason) (rate(pdserve_scheduler_retries_total[{RI}]))", "retry {{role}} {{reason}}")], "ops")
    b.ts("Engines by role and state", [q("sum by (role, state) (pdserve_scheduler_registered_engines)",
                                         "{{role}} {{state}}")])
    b.ts("Refused registrations", [q(f"sum by (reason) (rate(pdserve_scheduler_registrations_refused_total[{RI}]))",
                                     "{{reason}}")], "ops")
    b.row("Roles and the planner")
    b.ts("Engines serving each role", [q("sum by (role) (max by (engine_id, role) (pdserve_engine_role))",
                                         "{{role}}")])
    b.ts("Planner: desired engines per role", [q("max by (role) (pdserve_planner_desired_engines)", "{{role}}")])
    b.ts("Planner: goodput predicted and observed", [
        q("max by (split) (pdserve_planner_predicted_goodput_rps)", "predicted {{split}}"),
        q("max(pdserve_planner_observed_goodput_rps)", "observed")], "reqps")
    b.row("Scheduler replicas")
    b.ts("Requests / s per replica", [q(f"sum by (pod) (rate(pdserve_scheduler_requests_total[{RI}]))", "{{pod}}")],
         "reqps")
    b.ts("Routable engines per replica", [
        q('sum by (pod) (pdserve_scheduler_registered_engines{state="routable"})', "{{pod}}")])
    b.ts("Prefix index blocks per replica", [q("sum by (pod) (pdserve_events_index_blocks)", "{{pod}}")])
    b.ts("Index converged per replica (0: converging after a restart)", [
        q("max by (pod) (pdserve_scheduler_index_converged)", "{{pod}}")])
    b.row("Auth and limits")
    b.ts("Refused client calls (auth, rate, streams)", [
        q(f"sum by (reason) (rate(pdserve_scheduler_client_refused_total[{RI}]))", "{{reason}}")], "ops")
    b.ts("Open client streams", [q("sum(pdserve_scheduler_client_streams)", "streams")])
    b.row("OpenAI-compatible HTTP API")
    b.ts("HTTP requests by endpoint and status", [
        q(f"sum by (endpoint, code) (rate(pdserve_scheduler_http_requests_total[{RI}]))", "{{endpoint}} {{code}}")],
        "reqps")
    b.ts("HTTP error ratio (status >= 400)", [
        q(f'sum(rate(pdserve_scheduler_http_requests_total{{code=~"[45].."}}[{RI}])) '
          f"/ sum(rate(pdserve_scheduler_http_requests_total[{RI}]))", "errors")], "percentunit")
    return b


def disaggregation() -> Board:
    b = Board("pdserve-disaggregation", "pdserve / Disaggregation",
              "KV transfer per prefill→decode pair, failures, leases and per-rank aggregation.", [datasource_var()])
    pair = "src_engine, dst_engine"
    b.matrix("Bandwidth (prefill × decode)", f"sum by ({pair}) (rate(pdserve_transfer_bytes_total[{RI}]))", "Bps")
    b.matrix("Pull latency p95 (prefill × decode)", pct(0.95, "pdserve_transfer_duration_seconds", pair), "s")
    b.matrix("Failure ratio (prefill × decode)",
             f"sum by ({pair}) (rate(pdserve_transfer_failures_total[{RI}])) "
             f"/ sum by ({pair}) (rate(pdserve_transfer_operations_total[{RI}]))", "percentunit")
    b.row("Transfers over time")
    b.ts("Bandwidth by pair", [q(f"sum by ({pair}) (rate(pdserve_transfer_bytes_total[{RI}]))",
                                 "{{src_engine}} → {{dst_engine}}")], "Bps")
    b.ts("Bandwidth by UCX transport (what really carried the KV)", [
        q(f"sum by ({pair}, transport) (rate(pdserve_transfer_bytes_total[{RI}]))",
          "{{src_engine}} → {{dst_engine}} over {{transport}}")], "Bps")
    b.ts("Pulls slower than the expected transport (fallbacks)", [
        q(f"sum by ({pair}, expected, actual) (rate(pdserve_transfer_transport_fallbacks_total[{RI}]))",
          "{{src_engine}} → {{dst_engine}}: {{actual}} (expected {{expected}})")], "ops")
    b.ts("Pull latency", [q(pct(p, "pdserve_transfer_duration_seconds"), f"p{int(p * 100)}") for p in (0.5, 0.99)],
         "s")
    b.ts("Failures by reason", [q(f"sum by (reason) (rate(pdserve_transfer_failures_total[{RI}]))", "{{reason}}")],
         "ops")
    b.ts("Pulls in flight", [q("sum by (engine) (pdserve_transfer_inflight_operations)", "{{engine}}")])
    b.ts("Blocks / s by pair", [q(f"sum by ({pair}) (rate(pdserve_transfer_blocks_total[{RI}]))",
                                  "{{src_engine}} → {{dst_engine}}")])
    b.ts("KV memory registered with the data plane (mirror: --kv-staging host copies)", [
        q("sum by (engine) (pdserve_engine_kv_bytes_registered)", "{{engine}} registered"),
        q("sum by (engine) (pdserve_engine_kv_mirror_bytes)", "{{engine}} mirror")], "bytes")
    b.ts("KV holds: how they ended", [
        q(f"sum by (outcome) (rate(pdserve_scheduler_lease_outcomes_total[{RI}]))", "{{outcome}}"),
        q(f"sum(rate(pdserve_transfer_lease_expiries_total[{RI}]))", "expired (prefill side)")], "ops")
    b.row("Ranks and aggregation")
    b.ts("Pending per-rank reports", [q("sum by (engine) (pdserve_scheduler_aggregator_pending_reports)",
                                        "{{engine}}")])
    b.ts("Oldest pending report age", [q("max by (engine) (pdserve_scheduler_aggregator_oldest_pending_age_seconds)",
                                         "{{engine}}")], "s")
    b.ts("Step reports / s by kind (rank: one rank's events; merged: several ranks')", [
        q(f"sum by (kind) (rate(pdserve_scheduler_rank_reports_total[{RI}]))", "{{kind}}")], "ops")
    b.ts("Ranks by role and state", [q("sum by (role, state) (pdserve_scheduler_registered_ranks)",
                                       "{{role}} {{state}}")])
    b.ts("Control-stream reconnects", [
        q(f"sum by (engine) (increase(pdserve_scheduler_control_reconnects_total[{RI}]))", "{{engine}} (scheduler)"),
        q(f"sum by (engine) (increase(pdserve_engine_control_reconnects_total[{RI}]))", "{{engine}} (engine)")])
    b.ts("Decode-only ratio", [q(f"sum(rate(pdserve_scheduler_decode_only_total[{RI}])) "
                                f"/ sum(rate(pdserve_scheduler_requests_total[{RI}]))", "decode-only")],
         "percentunit")
    return b


def kv_events() -> Board:
    b = Board("pdserve-kv-events", "pdserve / KV cache and events",
              "KV usage, prefix-cache hit rates by medium, the event plane and its subscribers.",
              [datasource_var(), ROLE_VAR, ENGINE_VAR])
    b.ts("KV cache usage", [q(f"max by (engine) (pdserve_engine_kv_cache_usage_ratio{{{ROLE}, {ENG}}})",
                              "{{engine}}")], "percentunit")
    b.ts("Preemptions", [q(f"sum by (engine) (rate(pdserve_engine_preemptions_total{{{ROLE}, {ENG}}}[{RI}]))",
                           "{{engine}}")], "ops")
    b.ts("Routing-time prefix hit rate by medium", [
        q(f"sum by (medium) (rate(pdserve_scheduler_prefix_hit_tokens_total[{RI}])) "
          f"/ ignoring (medium) group_left sum(rate(pdserve_scheduler_prompt_tokens_total[{RI}]))", "{{medium}}")],
         "percentunit")
    b.ts("Engine prefix-cache hit rate", [
        q(f"sum by (engine) (rate(pdserve_engine_prefix_cache_hits_tokens_total{{{ROLE}, {ENG}}}[{RI}])) "
          f"/ sum by (engine) (rate(pdserve_engine_prefix_cache_queries_tokens_total{{{ROLE}, {ENG}}}[{RI}]))",
          "{{engine}}")], "percentunit")
    b.row("Event plane")
    b.ts("Events received by type and medium", [
        q(f"sum by (type, medium) (rate(pdserve_events_received_total{{{ENG}}}[{RI}]))", "{{type}} {{medium}}")],
         "ops")
    b.ts("Events republished by type and medium", [
        q(f"sum by (type, medium) (rate(pdserve_events_published_total[{RI}]))", "{{type}} {{medium}}")], "ops")
    b.ts("Events emitted per engine", [
        q(f"sum by (engine) (rate(pdserve_engine_kv_events_total{{{ROLE}, {ENG}}}[{RI}]))", "{{engine}}")], "ops")
    b.ts("Events rejected", [q(f"sum by (reason) (rate(pdserve_events_rejected_total[{RI}]))", "{{reason}}")], "ops")
    b.ts("Subscribers", [q("sum by (transport) (pdserve_events_subscribers)", "{{transport}}")])
    b.ts("Subscriber lag (worst)", [q("max by (transport) (pdserve_events_subscriber_lag_batches)", "{{transport}}"),
                                    q(f"sum by (transport) (increase(pdserve_events_subscriber_resyncs_total[{RI}]))",
                                      "resyncs {{transport}}")])
    b.ts("Prefix index blocks by medium", [q("sum by (medium) (pdserve_events_index_blocks)", "{{medium}}")])
    return b


def engine() -> Board:
    b = Board("pdserve-engine", "pdserve / Engine", "One engine: batch, KV cache, steps, transfers.",
              [datasource_var(), ROLE_VAR, label_var("engine", "Engine",
                                                     'label_values(pdserve_engine_info{role=~"$role"}, engine)',
                                                     multi=False)])
    one = 'engine="$engine"'
    b.stat("Running", f"sum(pdserve_engine_running_requests{{{one}}})")
    b.stat("Waiting", f"sum(pdserve_engine_waiting_requests{{{one}}})")
    b.stat("KV usage", f"max(pdserve_engine_kv_cache_usage_ratio{{{one}}})", "percentunit")
    b.stat("Preemptions / s", f"sum(rate(pdserve_engine_preemptions_total{{{one}}}[{RI}]))", "ops")
    b.ts("Requests", [q(f"sum(pdserve_engine_running_requests{{{one}}})", "running"),
                      q(f"sum(pdserve_engine_waiting_requests{{{one}}})", "waiting"),
                      q(f"sum(pdserve_engine_pinned_requests{{{one}}})", "pinned (awaiting pull)")])
    b.ts("KV cache free blocks", [q(f"sum(pdserve_engine_kv_cache_free_blocks{{{one}}})", "free or evictable")])
    b.ts("Step time", [q(pct(p, "pdserve_engine_step_duration_seconds", selector=one), f"p{int(p * 100)}")
                       for p in (0.5, 0.99)], "s")
    b.ts("Tokens per step", [q(pct(p, "pdserve_engine_step_tokens", selector=one), f"p{int(p * 100)}")
                             for p in (0.5, 0.99)])
    b.ts("Tokens / s", [q(f"sum(rate(pdserve_engine_prompt_tokens_total{{{one}}}[{RI}]))", "prompt computed"),
                        q(f"sum(rate(pdserve_engine_generation_tokens_total{{{one}}}[{RI}]))", "generated")])
    b.ts("Finished requests", [q(f"sum by (finish_reason) (rate(pdserve_engine_finished_requests_total{{{one}}}[{RI}]))",
                                 "{{finish_reason}}")], "ops")
    b.ts("KV pulled in (as decode)", [
        q(f'sum by (src_engine) (rate(pdserve_transfer_bytes_total{{dst_engine="$engine"}}[{RI}]))', "from {{src_engine}}")],
         "Bps")
    b.ts("KV pulled out (as prefill)", [
        q(f'sum by (dst_engine) (rate(pdserve_transfer_bytes_total{{src_engine="$engine"}}[{RI}]))', "to {{dst_engine}}")],
         "Bps")
    b.ts("Transfer failures", [
        q(f'sum by (reason) (rate(pdserve_transfer_failures_total{{dst_engine="$engine"}}[{RI}]))', "in {{reason}}"),
        q(f'sum by (reason) (rate(pdserve_transfer_failures_total{{src_engine="$engine"}}[{RI}]))', "out {{reason}}")],
         "ops")
    b.ts("Pending rank reports", [
        q(f"sum(pdserve_scheduler_aggregator_pending_reports{{{one}}})", "pending"),
        q(f"max(pdserve_scheduler_aggregator_oldest_pending_age_seconds{{{one}}})", "oldest age (s)")])
    return b


DASHBOARDS = {"pdserve-overview.json": overview, "pdserve-disaggregation.json": disaggregation,
              "pdserve-kv-events.json": kv_events, "pdserve-engine.json": engine}


def render_all() -> dict[str, str]:
    return {name: json.dumps(build().to_json(), indent=2, ensure_ascii=False) + "\n"
            for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a checked-in dashboard is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards: {', '.join(stale)}: run python helm/gen_dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
