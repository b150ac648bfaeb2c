"""The Helm chart, linted strictly, rendered with every CI values file and checked manifest by manifest."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_render import (
    CHART,
    CI_VALUES,
    ROOT,
    config_files,
    load_script,
    of_kind,
    one,
    render_values,
    rendered,
)

KUBE_VERSION = kubernetes_validate.latest_version()
ENGINE_ROLES = ("prefill", "decode")
# Prometheus Operator CRDs are not in kubernetes-validate's schemas: check their structure here.
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {"type": "object", "required": ["selector", "endpoints"], "properties": {
        "endpoints": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["port"]}}}},
    "PodMonitor": {"type": "object", "required": ["selector", "podMetricsEndpoints"], "properties": {
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["port"]}}}},
    "PrometheusRule": {"type": "object", "required": ["groups"], "properties": {"groups": {
        "type": "array", "minItems": 1, "items": {"type": "object", "required": ["name", "rules"], "properties": {
            "rules": {"type": "array", "items": {"type": "object", "required": ["expr"]}}}}}}},
    "Certificate": {"type": "object", "required": ["secretName", "issuerRef", "dnsNames"], "properties": {
        "dnsNames": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "issuerRef": {"type": "object", "required": ["name", "kind"]}}},
}


def containers(pod_owner: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod_owner["spec"]["template"]["spec"]["containers"])


def port_of(container: dict[str, Any], name: str) -> int:
    return next(int(p["containerPort"]) for p in container["ports"] if p["name"] == name)


def values_of(values_name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "ci" / values_name).read_text()) if values_name != "default" else {}


# ---------------------------------------------------------------- chart-level


def test_lint_strict_with_every_values_file() -> None:
    for values in [{}, *(yaml.safe_load(p.read_text()) for p in CI_VALUES)]:
        report = helm_python.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], (problems, report["errors"])


def test_app_version_is_the_pdserve_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


def test_schema_is_derived_from_values_and_in_sync() -> None:
    gen = load_script("gen_schema")
    assert gen.render(gen.build_schema()) == (CHART / "values.schema.json").read_text(), \
        "values.schema.json drifted: run python helm/gen_schema.py"


def test_schema_generator_refuses_undocumented_keys(tmp_path: Any) -> None:
    gen = load_script("gen_schema")
    values = tmp_path / "values.yaml"
    values.write_text("# documented\na: 1\n# documented\nb:\n  # inner\n  c: true\n  d: x\n")
    with pytest.raises(ValueError, match="b.d has no comment"):
        gen.build_schema(values)


def test_schema_refuses_bad_values() -> None:
    for bad, where in (({"prefill": {"tp": 0}}, "/prefill/tp"), ({"model": {"source": "s3"}}, "/model/source"),
                       ({"unknownKey": 1}, "additional properties 'unknownKey'"),
                       ({"scheduler": {"ports": {"grpc": 70000}}}, "/scheduler/ports/grpc")):
        with pytest.raises(helm_python.HelmValuesError, match=f"(?s)don't meet the specifications .*{re.escape(where)}"):
            render_values(bad)


def test_every_toggle_is_named_enabled() -> None:
    """Chart-defined booleans only (free-form maps such as podSecurityContext are Kubernetes' own)."""
    toggles: list[str] = []

    def walk(schema: dict[str, Any], path: str) -> None:
        for key, sub in schema.get("properties", {}).items():
            if sub["type"] == "boolean":
                toggles.append(f"{path}{key}")
                assert key == "enabled", f"{path}{key} is a toggle not named enabled"
            walk(sub, f"{path}{key}.")

    walk(load_script("gen_schema").build_schema(), "")
    assert "networkPolicy.enabled" in toggles and len(toggles) > 10


def test_templates_are_short() -> None:
    for path in (CHART / "templates").rglob("*"):
        if path.is_file():
            assert len(path.read_text().splitlines()) <= 150, path


def test_shared_or_managed_keys_cannot_be_repeated_in_component_config() -> None:
    for values in ({"prefill": {"config": {"block_size": 32}}}, {"scheduler": {"config": {"hash_seed": "x"}}},
                   {"decode": {"config": {"tp": 4}}}):
        with pytest.raises(helm_python.HelmRenderError, match="set by the chart"):
            render_values(values)


def test_required_values_fail_with_a_clear_message() -> None:
    with pytest.raises(helm_python.HelmRenderError, match="model.pvc.claimName is required"):
        render_values({"model": {"source": "pvc"}})
    with pytest.raises(helm_python.HelmRenderError, match="tracing.endpoint is required"):
        render_values({"tracing": {"enabled": True}})


# ---------------------------------------------------------------- every manifest


def test_manifests_validate_strictly_against_kubernetes(values_name: str) -> None:
    for path, doc in rendered(values_name):
        if doc["kind"] in CRD_SCHEMAS:
            group = "cert-manager.io/v1" if doc["kind"] == "Certificate" else "monitoring.coreos.com/v1"
            assert doc["apiVersion"] == group, path
            jsonschema.validate(doc["spec"], CRD_SCHEMAS[doc["kind"]])
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_no_empty_or_duplicate_resources(values_name: str) -> None:
    docs = rendered(values_name)
    seen = set()
    for path, doc in docs:
        assert doc.get("kind") and doc.get("metadata", {}).get("name"), f"{path} rendered an empty resource"
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
    # every container port name is unique and every Service targetPort names a real container port
    ports = {p["name"] for kind in ("Deployment", "StatefulSet") for d in of_kind(docs, kind)
             for c in containers(d) for p in c["ports"]}
    for svc in of_kind(docs, "Service"):
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (svc["metadata"]["name"], p)


def test_standard_labels_everywhere(values_name: str) -> None:
    for path, doc in rendered(values_name):
        labels = doc["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "helm.sh/chart"):
            assert key in labels, (path, key)


def test_probes_are_native_grpc_on_the_health_port(values_name: str) -> None:
    """Engines: native gRPC probes. The scheduler: GET /health on its HTTP API port without TLS
    (readiness: GET /ready, 503 while a restarted replica's prefix index converges); under TLS
    the kubelet (which cannot present a client certificate) probes the plaintext gRPC
    health-only port (readiness: the pdserve.v1.Generation service's health, likewise)."""
    docs = rendered(values_name)
    configs = config_files(docs)
    for component, kind in (("scheduler", "Deployment"), ("prefill", "StatefulSet"), ("decode", "StatefulSet")):
        (container,) = containers(one(docs, kind, component))
        grpc_port = port_of(container, "grpc")
        assert grpc_port == configs[component]["port"]
        probe_port = port_of(container, "health") if "health_port" in configs[component] else grpc_port
        assert probe_port == configs[component].get("health_port", grpc_port)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if component == "scheduler" and "health_port" not in configs[component]:
                http_port = port_of(container, "http")
                assert http_port == configs["scheduler"]["http_port"]
                path = "/ready" if probe == "readinessProbe" else "/health"
                assert container[probe]["httpGet"] == {"path": path, "port": http_port}, probe
                assert set(container[probe]) & {"grpc", "tcpSocket", "exec"} == set()
                continue
            expected = {"port": probe_port}
            if component == "scheduler" and probe == "readinessProbe":
                expected["service"] = "pdserve.v1.Generation"
            assert container[probe]["grpc"] == expected, (component, probe)
            assert set(container[probe]) & {"httpGet", "tcpSocket", "exec"} == set()


def test_http_api_port_is_served_exposed_and_open_to_clients(values_name: str) -> None:
    docs = rendered(values_name)
    configs = config_files(docs)
    (container,) = containers(one(docs, "Deployment", "scheduler"))
    http_port = configs["scheduler"]["http_port"]
    assert port_of(container, "http") == http_port
    [port] = [p for p in client_service(docs)["spec"]["ports"] if p["name"] == "http"]
    assert port["port"] == http_port and port["targetPort"] == "http"
    for policy in of_kind(docs, "NetworkPolicy"):
        client_rules = [r for r in policy["spec"]["ingress"]
                        if {"port": configs["scheduler"]["port"], "protocol": "TCP"} in r["ports"]]
        for rule in client_rules:
            assert {"port": http_port, "protocol": "TCP"} in rule["ports"], "clients reach the HTTP API too"


def test_gpu_count_equals_tp_and_cpu_installs_request_none(values_name: str) -> None:
    docs = rendered(values_name)
    configs = config_files(docs)
    gpu = values_of(values_name).get("gpu", {}).get("enabled", True)
    dra = values_of(values_name).get("gpu", {}).get("mode") == "dra"
    for role in ENGINE_ROLES:
        sts = one(docs, "StatefulSet", role)
        (container,) = containers(sts)
        tp = configs[role]["tp"]
        limits = container["resources"].get("limits", {})
        assert configs[role]["device"] == ("cuda" if gpu else "cpu")
        assert configs[role]["dtype"] == values_of(values_name).get("kv", {}).get("dtype", "auto")
        if gpu and not dra:
            assert limits["nvidia.com/gpu"] == tp
        else:
            assert "nvidia.com/gpu" not in limits
        metrics_ports = sorted(p["containerPort"] for p in container["ports"] if p["name"].startswith("metrics-r"))
        base = configs[role]["metrics_port"]
        assert metrics_ports == list(range(base, base + tp)), "one /metrics port per rank"


def test_values_declared_once_are_identical_everywhere(values_name: str) -> None:
    docs = rendered(values_name)
    configs = config_files(docs)
    values = values_of(values_name)
    kv, model = values.get("kv", {}), values.get("model", {})
    expected_model = "" if model.get("source", "demo") == "demo" else model["path"]
    for component in ("scheduler", *ENGINE_ROLES):
        cfg = configs[component]
        assert cfg["model"] == expected_model
        assert cfg["block_size"] == kv.get("blockSize", 16)
        assert cfg["hash_seed"] == kv.get("hashSeed", "0")
    sched_port = configs["scheduler"]["control_port"]
    for role in ENGINE_ROLES:  # every replica, through the headless Service
        assert configs[role]["scheduler"] == f"dns:demo-pdserve-scheduler-peers:{sched_port}"
        assert configs[role]["tp"] == values.get(role, {}).get("tp", 1)
    # every pod that loads the model mounts it at the configured path
    if expected_model:
        for kind, component in (("Deployment", "scheduler"), ("StatefulSet", "prefill"), ("StatefulSet", "decode")):
            (container,) = containers(one(docs, kind, component))
            assert any(m["mountPath"] == expected_model for m in container["volumeMounts"]), component


def test_engines_drain_within_the_grace_period(values_name: str) -> None:
    docs = rendered(values_name)
    configs = config_files(docs)
    for role in ENGINE_ROLES:
        pod = one(docs, "StatefulSet", role)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod["terminationGracePeriodSeconds"] > pre_stop + configs[role]["drain_timeout_s"]


def test_engine_pods_have_shm_ipc_lock_ucx_and_stable_ids(values_name: str) -> None:
    docs = rendered(values_name)
    values = values_of(values_name)
    for role in ENGINE_ROLES:
        sts = one(docs, "StatefulSet", role)
        pod = sts["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert sts["spec"]["serviceName"] == one(docs, "Service", role)["metadata"]["name"]
        assert one(docs, "Service", role)["spec"]["clusterIP"] == "None"
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
        env = {e["name"]: e.get("value") for e in container["env"]}
        ucx = values.get("ucx", {})
        assert env["UCX_TCP_PORT_RANGE"] == f"{ucx.get('tcpPortStart', 20000)}-{ucx.get('tcpPortEnd', 20999)}"
        if ucx.get("tls"):
            assert env["UCX_TLS"] == ucx["tls"]
        if ucx.get("netDevices"):
            assert env["UCX_NET_DEVICES"] == ucx["netDevices"]
        assert "$(POD_NAME)" in container["args"], "engine id from the StatefulSet pod name (ordinal)"


def test_rdma_device_plugin_and_dra() -> None:
    docs = rendered("gpu-tp2-rdma-values.yaml")
    for role in ENGINE_ROLES:
        (container,) = containers(one(docs, "StatefulSet", role))
        assert container["resources"]["limits"]["rdma/ib"] == 1
    docs = rendered("everything-values.yaml")
    (claim_template,) = [t for t in of_kind(docs, "ResourceClaimTemplate") if t["metadata"]["name"].endswith("-rdma")]
    request = claim_template["spec"]["spec"]["devices"]["requests"][0]
    assert request["exactly"] == {"deviceClassName": "rdma.nvidia.com", "allocationMode": "ExactCount", "count": 2}
    for role in ENGINE_ROLES:
        sts = one(docs, "StatefulSet", role)
        pod = sts["spec"]["template"]["spec"]
        assert [c for c in pod["resourceClaims"] if c["name"] == "rdma"] == [
            {"name": "rdma", "resourceClaimTemplateName": claim_template["metadata"]["name"]}]
        assert {"name": "rdma"} in pod["containers"][0]["resources"]["claims"]
    assert not of_kind(rendered("default"), "ResourceClaimTemplate")


def test_gpu_dra_claims_per_role_host_ipc_and_staging() -> None:
    """gpu.mode dra: one ResourceClaimTemplate per role asking for tp GPUs, claimed by its pods
    beside the RDMA claim; hostIpc and kvStaging reach the pod and the engine config."""
    docs = rendered("everything-values.yaml")
    configs = config_files(docs)
    templates = {t["metadata"]["name"]: t for t in of_kind(docs, "ResourceClaimTemplate")}
    for role in ENGINE_ROLES:
        sts = one(docs, "StatefulSet", role)
        pod = sts["spec"]["template"]["spec"]
        gpu_claim = next(c for c in pod["resourceClaims"] if c["name"] == "gpu")
        request = templates[gpu_claim["resourceClaimTemplateName"]]["spec"]["spec"]["devices"]["requests"][0]
        assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount",
                                      "count": configs[role]["tp"]}
        assert [c["name"] for c in pod["containers"][0]["resources"]["claims"]] == ["gpu", "rdma"]
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
        assert pod["hostIPC"] is True
        assert (configs[role]["kv_staging"], configs[role]["dtype"]) == ("host", "float16")
    default = rendered("default")
    for role in ENGINE_ROLES:
        pod = one(default, "StatefulSet", role)["spec"]["template"]["spec"]
        assert "hostIPC" not in pod and "resourceClaims" not in pod
        assert config_files(default)[role]["kv_staging"] == "none"


def test_kv_transport_reaches_both_roles_config() -> None:
    """ucx.kvTransport (one value: both engines of a pair must agree) becomes each role's
    kv_transport, which the engine config accepts."""
    from services.common.config import EngineConfig

    for values, want in (({}, "ucx-tag"), ({"ucx": {"kvTransport": "nixl"}}, "nixl")):
        configs = config_files(render_values(values))
        for role in ENGINE_ROLES:
            assert configs[role]["kv_transport"] == want
            EngineConfig(kv_transport=configs[role]["kv_transport"]).validate()


def test_role_config_may_not_repeat_the_declared_once_dtype() -> None:
    with pytest.raises(Exception, match=r"prefill.config.dtype is set by the chart"):
        render_values({"prefill": {"config": {"dtype": "float32"}}})


def test_hpa_per_role_and_pdbs() -> None:
    docs = rendered("everything-values.yaml")
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    for role in ENGINE_ROLES:
        sts = one(docs, "StatefulSet", role)
        assert sts["metadata"]["name"] in hpas
        assert "replicas" not in sts["spec"], "an HPA-managed StatefulSet leaves replicas to the HPA"
    assert not of_kind(rendered("default"), "HorizontalPodAutoscaler")
    pdbs = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in of_kind(rendered("default"),
                                                                                      "PodDisruptionBudget")}
    assert pdbs == {"scheduler", "prefill", "decode"}


def test_hpa_on_the_planners_desired_engines() -> None:
    docs = render_values({"scheduler": {"config": {"planner": "advise"}},
                          "decode": {"hpa": {"enabled": True, "metric": "planner"}}})
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {"name": "pdserve_planner_desired_engines",
                                            "selector": {"matchLabels": {"role": "decode"}}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


def client_service(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The scheduler's regular Service (beside it, the headless `-peers` one for engines)."""
    (svc,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"] == "demo-pdserve-scheduler"]
    return svc


def test_scheduler_replicas_pdb_anti_affinity_and_both_services() -> None:
    docs = rendered("gpu-tp2-rdma-values.yaml")  # the production-like values: 2 replicas
    deployment = one(docs, "Deployment", "scheduler")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    pdb = [p for p in of_kind(docs, "PodDisruptionBudget")
           if p["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"]
    assert len(pdb) == 1 and pdb[0]["spec"]["minAvailable"] == 1
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")
                if s["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"}
    assert set(services) == {"demo-pdserve-scheduler", "demo-pdserve-scheduler-peers"}
    peers = services["demo-pdserve-scheduler-peers"]["spec"]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    assert [p["name"] for p in peers["ports"]] == ["control", "events"]
    events_port = config_files(docs)["scheduler"]["events_port"]
    assert config_files(docs)["scheduler"]["peers"] == f"dns:demo-pdserve-scheduler-peers:{events_port}"
    assert "peers" not in config_files(rendered("default"))["scheduler"]  # one replica: nobody to ask
    assert services["demo-pdserve-scheduler"]["spec"].get("clusterIP") != "None"
    for role in ENGINE_ROLES:
        assert config_files(docs)[role]["scheduler"].startswith("dns:demo-pdserve-scheduler-peers:")
    single = one(rendered("default"), "Deployment", "scheduler")
    assert single["spec"]["replicas"] == 1 and "affinity" not in single["spec"]["template"]["spec"]


def test_scheduler_service_exposes_its_ports() -> None:
    docs = rendered("everything-values.yaml")
    svc = client_service(docs)
    names = {p["name"] for p in svc["spec"]["ports"]}
    assert names == {"grpc", "control", "events", "http", "metrics", "zmq-pub", "zmq-replay"}
    cfg = config_files(docs)["scheduler"]
    assert cfg["zmq_endpoint"] == "tcp://*:5557" and cfg["zmq_replay_endpoint"] == "tcp://*:5558"
    assert {p["name"] for p in client_service(rendered("default"))["spec"]["ports"]} == \
        {"grpc", "control", "events", "http", "metrics"}


def test_tls_tracing_and_service_account() -> None:
    docs = rendered("everything-values.yaml")
    for kind, component in (("Deployment", "scheduler"), ("StatefulSet", "prefill"), ("StatefulSet", "decode")):
        owner = one(docs, kind, component)
        pod = owner["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert {"name": "tls", "secret": {"secretName": "pdserve-mtls", "defaultMode": 0o440}} in pod["volumes"]
        assert any(m["mountPath"] == "/etc/pdserve/tls" for m in container["volumeMounts"])
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
        assert env["OTEL_SERVICE_NAME"] == f"pdserve-{component}"
        assert pod["automountServiceAccountToken"] is False
    assert not any(d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding") for _, d in docs)
    (sa,) = of_kind(docs, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    default_env = {e["name"] for e in containers(one(rendered("default"), "Deployment", "scheduler"))[0]["env"]}
    assert not any(name.startswith("OTEL_") for name in default_env), "tracing is off by default"


def test_monitoring_targets_exist() -> None:
    docs = rendered("everything-values.yaml")
    (sm,) = of_kind(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in client_service(docs)["spec"]["ports"]}
    (pm,) = of_kind(docs, "PodMonitor")
    engine_ports = {p["name"] for role in ENGINE_ROLES for p in containers(one(docs, "StatefulSet", role))[0]["ports"]}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} == {n for n in engine_ports if n.startswith("metrics")}
    (dash,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(dash["data"]) == files and len(files) == 4
    for name in files:
        assert json.loads(dash["data"][name]) == json.loads((CHART / "dashboards" / name).read_text())
    assert not of_kind(rendered("default"), "PrometheusRule")


# ---------------------------------------------------------------- NetworkPolicy


def _engine_peer(peer: dict[str, Any]) -> bool:
    sel = peer.get("podSelector", {})
    exprs = sel.get("matchExpressions", [])
    return set(peer) == {"podSelector"} and exprs == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}] \
        and sel["matchLabels"].get("app.kubernetes.io/instance") == "demo"


def _component_peer(peer: dict[str, Any], component: str) -> bool:
    return set(peer) == {"podSelector"} and \
        peer["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == component


def test_network_policy_rules() -> None:
    docs = rendered("everything-values.yaml")
    values = values_of("everything-values.yaml")
    policies = {p["metadata"]["name"].rsplit("-", 1)[1]: p["spec"] for p in of_kind(docs, "NetworkPolicy")}
    assert set(policies) == {"scheduler", "engines"}
    sched_cfg = config_files(docs)["scheduler"]

    rules = {tuple(sorted(p["port"] for p in r["ports"])): r.get("from") for r in policies["scheduler"]["ingress"]}
    clients = values["networkPolicy"]["clients"]
    # clients (and the helm test pod) reach only the Generate port and the HTTP API
    client_ports = tuple(sorted((sched_cfg["port"], sched_cfg["http_port"])))
    for ports, peers in rules.items():
        if any(p in clients for p in peers or [None]):
            assert ports == client_ports
    assert rules[client_ports][:len(clients)] == clients
    assert _component_peer(rules[client_ports][-1], "test")
    # only engine pods reach the control port
    (control_peers,) = [peers for ports, peers in rules.items() if ports == (sched_cfg["control_port"],)]
    assert len(control_peers) == 1 and _engine_peer(control_peers[0])
    (event_peers,) = [peers for ports, peers in rules.items() if sched_cfg["events_port"] in ports and len(ports) > 1]
    assert event_peers == values["networkPolicy"]["eventSubscribers"]
    # the replicas reach each other's KVEvents port (a restarted one takes a peer's index snapshot)
    (replica_peers,) = [peers for ports, peers in rules.items() if ports == (sched_cfg["events_port"],)]
    assert len(replica_peers) == 1 and _component_peer(replica_peers[0], "scheduler")
    assert all(peers for peers in rules.values()), "no scheduler port is open to everyone when clients are listed"

    engines = policies["engines"]
    assert engines["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    for rule in engines["ingress"]:
        ports = rule["ports"]
        if ports[0]["port"] == values["ucx"]["tcpPortStart"]:
            assert ports == [{"port": 31000, "endPort": 31999, "protocol": "TCP"}]
            assert len(rule["from"]) == 1 and _engine_peer(rule["from"][0]), "UCX ports: engine pods only"
        elif ports[0]["port"] in (50060, 50061):
            assert len(rule["from"]) == 1 and _component_peer(rule["from"][0], "scheduler")
        else:
            assert rule["from"] == values["networkPolicy"]["metricsScrapers"]
            assert ports == [{"port": 9400, "endPort": 9503, "protocol": "TCP"}]
    assert not of_kind(rendered("default"), "NetworkPolicy")


def test_network_policy_without_client_list_opens_only_the_client_apis_to_all() -> None:
    docs = render_values({"networkPolicy": {"enabled": True}})
    (policy,) = [p for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("scheduler")]
    open_rules = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert [r["ports"] for r in open_rules] == [[{"port": 50051, "protocol": "TCP"}, {"port": 8000, "protocol": "TCP"}]]


# ---------------------------------------------------------------- image


def _dockerfile_installs(name: str) -> list[str]:
    return [" ".join(line.split()) for line in (ROOT / name).read_text().splitlines() if "pip install" in line]


@pytest.mark.parametrize(("dockerfile", "lock", "pin"), [
    ("Dockerfile", "cuda", "ucxx-cu13=="),
    ("Dockerfile.cpu", "cpu", "torch==2.13.0+cpu"),
])
def test_dockerfiles_install_exactly_the_lock(dockerfile: str, lock: str, pin: str) -> None:
    """Each image installs its lock file, offline and without resolving, then pdserve without
    dependencies; `make images` builds it from a context holding that lock's wheels."""
    text = (ROOT / dockerfile).read_text()
    assert f"ARG LOCK={lock}\n" in text and "COPY requirements/${LOCK}.txt requirements/" in text
    installs = _dockerfile_installs(dockerfile)
    assert installs[:2] == [
        "RUN pip install -q --no-index --find-links /wheels --no-deps -r requirements/${LOCK}.txt",
        "RUN pip install -q --no-index --find-links /wheels --no-deps . && pip check \\"], installs
    assert all("--no-index" in c and "--no-deps" in c for c in installs), installs
    assert f"$(call image_build,{lock},{dockerfile}," in (ROOT / "Makefile").read_text()
    locked = (ROOT / "requirements" / f"{lock}.txt").read_text()
    assert pin in locked and ">=" not in "".join(line.split(";")[0] for line in locked.splitlines())
    assert "FROM ${BASE_IMAGE} AS build" in text and "ARG BASE_IMAGE=python:3.11-slim-bookworm" in text


def test_default_image_tags_match_the_dockerfiles() -> None:
    gpu = containers(one(rendered("default"), "Deployment", "scheduler"))[0]["image"]
    cpu = containers(one(rendered("cpu-demo-values.yaml"), "Deployment", "scheduler"))[0]["image"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert gpu == f"ghcr.io/pdserve/pdserve:{version}"
    assert cpu == f"ghcr.io/pdserve/pdserve:{version}-cpu"
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / name).read_text()
        assert 'ENTRYPOINT ["pdserve"]' in text and "USER 10001" in text
        assert 'HEALTHCHECK' in text and 'CMD ["pdserve", "health"]' in text
