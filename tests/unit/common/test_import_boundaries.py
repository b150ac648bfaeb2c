"""The scheduler service and the connector core must never import torch."""

import subprocess
import sys

import pytest

PROBE = """
import importlib, pkgutil, sys
import {package} as root
for mod in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
    importlib.import_module(mod.name)
print("torch" in sys.modules)
"""


@pytest.mark.parametrize("package", ["services.scheduler"])
def test_package_imports_no_torch(package: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(package=package)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", f"{package} imports torch"
