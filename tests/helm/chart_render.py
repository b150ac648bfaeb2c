"""Renders the chart offline (helm_python, the Helm Go SDK) once per values file (shared by tests/helm)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE = "demo", "inference"


def load_script(name: str) -> ModuleType:
    """Imports helm/<name>.py (the generators are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "helm" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render_values(values: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(template path, manifest) for every document the chart renders with `values`."""
    chart = helm_python.Chart.load(str(CHART))
    try:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    finally:
        chart.close()
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                docs.append((path, doc))
    return docs


@functools.cache
def rendered(values_name: str) -> list[tuple[str, dict[str, Any]]]:
    values = yaml.safe_load((CHART / "ci" / values_name).read_text()) if values_name != "default" else {}
    return render_values(values)


def of_kind(docs: list[tuple[str, dict[str, Any]]], kind: str) -> list[dict[str, Any]]:
    return [d for _, d in docs if d["kind"] == kind]


def one(docs: list[tuple[str, dict[str, Any]]], kind: str, component: str) -> dict[str, Any]:
    found = [d for d in of_kind(docs, kind)
             if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
    return found[0]


def config_files(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """component -> parsed config file from the chart's ConfigMap."""
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    return {name.removesuffix(".yaml"): yaml.safe_load(text) for name, text in cm["data"].items()}


VALUES_NAMES = ["default", *(p.name for p in CI_VALUES)]
