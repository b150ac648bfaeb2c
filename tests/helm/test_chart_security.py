"""The chart's TLS, cert-manager and auth wiring lands on the config keys the code reads."""

from __future__ import annotations

from typing import Any

import pytest
from chart_render import config_files, of_kind, one, render_values, rendered

from services.common.config import EngineConfig, SchedulerConfig, load_config

COMPONENTS = (("scheduler", "Deployment"), ("prefill", "StatefulSet"), ("decode", "StatefulSet"))
SCHEDULER = "demo-pdserve-scheduler"


def _pod(docs: list[tuple[str, dict[str, Any]]], kind: str, component: str) -> dict[str, Any]:
    return dict(one(docs, kind, component)["spec"]["template"]["spec"])


def test_without_tls_plaintext_is_an_explicit_opt_in() -> None:
    configs = config_files(rendered("default"))
    for component, _ in COMPONENTS:
        assert configs[component]["allow_plaintext"] is True
        assert not any(k.startswith("tls_") for k in configs[component])
    with pytest.raises(ValueError, match="allow_plaintext"):
        load_config(SchedulerConfig, env={}, overrides={**configs["scheduler"], "allow_plaintext": False})


def test_tls_config_mounts_and_probes() -> None:
    docs = rendered("everything-values.yaml")
    configs = config_files(docs)
    for component, kind in COMPONENTS:
        cfg = configs[component]
        assert (cfg["tls_cert"], cfg["tls_key"], cfg["tls_ca"]) == (
            "/etc/pdserve/tls/tls.crt", "/etc/pdserve/tls/tls.key", "/etc/pdserve/tls/ca.crt")
        assert cfg["tls_server_name"] == cfg["tls_peer_name"] == SCHEDULER
        assert "allow_plaintext" not in cfg
        cls = SchedulerConfig if component == "scheduler" else EngineConfig
        load_config(cls, env={}, overrides=cfg)  # type: ignore[type-var]
        (container,) = _pod(docs, kind, component)["containers"]
        assert container["readinessProbe"]["grpc"]["port"] == cfg["health_port"]
    sched = configs["scheduler"]
    assert sched["tls_require_client_cert"] is True
    assert sched["auth_tokens_file"] == "/etc/pdserve/auth/tokens"
    assert {"name": "auth", "secret": {"secretName": "pdserve-tokens", "defaultMode": 0o440}} in \
        _pod(docs, "Deployment", "scheduler")["volumes"]
    for role in ("prefill", "decode"):
        assert "auth_tokens_file" not in configs[role]
        assert all(v["name"] != "auth" for v in _pod(docs, "StatefulSet", role)["volumes"]), "tokens stay on the scheduler"


def test_cert_manager_certificate_names_the_scheduler() -> None:
    (cert,) = of_kind(rendered("everything-values.yaml"), "Certificate")
    spec = cert["spec"]
    assert spec["secretName"] == "pdserve-mtls"
    assert SCHEDULER in spec["dnsNames"] and f"{SCHEDULER}.inference.svc" in spec["dnsNames"]
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert spec["issuerRef"] == {"name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert not of_kind(rendered("default"), "Certificate")


def test_cert_manager_default_secret_name_and_required_values() -> None:
    docs = render_values({"tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}}})
    (cert,) = of_kind(docs, "Certificate")
    assert {"name": "tls", "secret": {"secretName": cert["spec"]["secretName"], "defaultMode": 0o440}} in \
        _pod(docs, "Deployment", "scheduler")["volumes"]
    with pytest.raises(Exception, match="tls.secretName is required"):
        render_values({"tls": {"enabled": True}})
    with pytest.raises(Exception, match="auth.existingSecret is required"):
        render_values({"auth": {"enabled": True}})


def test_components_may_not_override_security_keys() -> None:
    with pytest.raises(Exception, match="allow_plaintext is set by the chart"):
        render_values({"prefill": {"config": {"allow_plaintext": False}}})
