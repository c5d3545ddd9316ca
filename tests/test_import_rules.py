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


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_the_layering_allows(package: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, package], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert not loaded & FORBIDDEN[package], f"{package} pulls in {sorted(loaded & FORBIDDEN[package])}"
