"""ARCHITECTURE §2 import rules, enforced by importing every module of a package in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FORBIDDEN: dict[str, set[str]] = {
    "posttrain": {"dagster", "mlflow", "localtinker", "assets", "resources", "pipelines"},
    "localtinker": {"posttrain", "assets", "resources", "pipelines", "dagster", "mlflow"},
    "resources": {"assets", "pipelines"},
    "assets": {"pipelines"},
}

_PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


@pytest.fixture(scope="module")
def probes() -> dict[str, subprocess.Popen]:
    """Every package's probe, started at once: each is a fresh interpreter importing a package's modules (torch,
    transformers, dagster...), mostly waiting on files, so together they take about the time of the longest."""
    started = {package: subprocess.Popen([sys.executable, "-c", _PROBE, package], cwd=REPO, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE) for package in FORBIDDEN}
    yield started
    for probe in started.values():
        if probe.poll() is None:
            probe.kill()


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_the_layering_allows(probes: dict[str, subprocess.Popen], package: str) -> None:
    stdout, stderr = probes[package].communicate(timeout=300)
    assert probes[package].returncode == 0, stderr[-3000:]
    loaded = set(json.loads(stdout.strip().splitlines()[-1]))
    assert not loaded & FORBIDDEN[package], f"{package} pulls in {sorted(loaded & FORBIDDEN[package])}"
