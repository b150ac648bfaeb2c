"""Generates the Grafana dashboards in helm/pdserve/dashboards/ (checked in; a test fails on drift)
with Grafana's own builders (grafana-foundation-sdk, the dev extra).

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

from grafana_foundation_sdk.builders import common, stat, table, timeseries
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT = Path(__file__).resolve().parent / "pdserve" / "dashboards"
DS = models.DataSourceRef(type_val="prometheus", uid="${datasource}")
RI = "$__rate_interval"
ENG = 'engine=~"$engine"'
ROLE = 'role=~"$role"'


def q(expr: str, legend: str = "", *, instant: bool = False) -> prom.Dataquery:
    target = prom.Dataquery().datasource(DS).expr(expr).legend_format(legend or "__auto")
    if instant:
        target = target.instant().format(PromQueryFormat.TABLE)
    return target


def pct(quantile: float, metric: str, by: str = "", selector: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return (f"histogram_quantile({quantile}, sum by ({group}) "
            f"(rate({metric}_bucket{{{selector}}}[{RI}])))")


class Board:
    """One dashboard: numbers its panels and rows; the SDK's builder lays them out left to right,
    24 columns wide."""

    def __init__(self, uid: str, title: str, description: str, variables: list[Builder[Any]]) -> None:
        self.next_id = 1
        self.builder = (
            dash.Dashboard(title).uid(uid).description(description).tags(["pdserve"]).editable()
            .tooltip(models.DashboardCursorSync.CROSSHAIR).version(1).time("now-1h", "now").refresh("30s")
            .timezone("")
            .link(dash.DashboardLink("pdserve").type(models.DashboardLinkType.DASHBOARDS).tags(["pdserve"])
                  .as_dropdown(True).include_vars(True).keep_time(True)))
        for variable in variables:
            self.builder.with_variable(variable)

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        self.builder.with_row(dash.Row(title).id(self._id()))

    def _add(self, panel: Any, title: str, targets: list[prom.Dataquery], unit: str, w: int, h: int,
             description: str) -> None:
        for i, target in enumerate(targets):
            panel.with_target(target.ref_id(chr(ord("A") + i)))
        self.builder.with_panel(panel.id(self._id()).title(title).description(description).datasource(DS)
                                .unit(unit).span(w).height(h))

    def ts(self, title: str, targets: list[prom.Dataquery], unit: str = "short", *, w: int = 12, h: int = 8,
           description: str = "") -> None:
        panel = (timeseries.Panel()
                 .legend(common.VizLegendOptions().display_mode(common_models.LegendDisplayMode.TABLE)
                         .placement(common_models.LegendPlacement.BOTTOM).show_legend(True).calcs(["mean", "max"]))
                 .tooltip(common.VizTooltipOptions().mode(common_models.TooltipDisplayMode.MULTI)
                          .sort(common_models.SortOrder.DESCENDING)))
        self._add(panel, title, targets, unit, w, h, description)

    def stat(self, title: str, expr: str, unit: str = "short", *, w: int = 6, h: int = 4,
             description: str = "") -> None:
        panel = (stat.Panel().reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
                 .color_mode(common_models.BigValueColorMode.VALUE).graph_mode(common_models.BigValueGraphMode.AREA))
        self._add(panel, title, [q(expr)], unit, w, h, description)

    def matrix(self, title: str, expr: str, unit: str, *, w: int = 8, h: int = 9, description: str = "") -> None:
        """A prefill (rows) × decode (columns) table from an instant query by src/dst engine."""
        panel = (table.Panel().show_header(True).cell_height(common_models.TableCellHeight.SM)
                 .with_transformation(models.DataTransformerConfig(id_val="groupingToMatrix", options={
                     "rowField": "src_engine", "columnField": "dst_engine", "valueField": "Value",
                     "emptyValue": "null"})))
        self._add(panel, title, [q(expr, instant=True)], unit, w, h, description)

    def to_json(self) -> dict[str, Any]:
        return dict(json.loads(json.dumps(self.builder.build(), cls=JSONEncoder)))


def datasource_var() -> dash.DatasourceVariable:
    return dash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_var(name: str, label: str, query: str, *, multi: bool = True) -> dash.QueryVariable:
    variable = (dash.QueryVariable(name).label(label).datasource(DS).query(query)
                .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(models.VariableSort.ALPHABETICAL_ASC)
                .multi(multi).include_all(multi))
    return variable.all_value(".*") if multi else variable


ROLE_VAR = label_var("role", "Role", "label_values(pdserve_engine_info, role)")
ENGINE_VAR = label_var("engine", "Engine", 'label_values(pdserve_engine_info{role=~"$role"}, engine)')


def overview() -> Board:
    b = Board("pdserve-overview", "pdserve / Overview", "Traffic, latency percentiles and errors at the scheduler.",
              [datasource_var()])
    b.stat("Requests / s", f"sum(rate(pdserve_scheduler_requests_total[{RI}]))", "reqps")
    b.stat("In flight", "sum(pdserve_scheduler_requests_in_flight)")
    # `or vector(0)`: 0 % rather than "No data" while no request has failed.
    b.stat("Error ratio", f'(sum(rate(pdserve_scheduler_requests_total{{outcome="error"}}[{RI}])) or vector(0)) '
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
