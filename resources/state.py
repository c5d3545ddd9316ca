"""Where the project keeps state that must outlive a process: Dagster, MLflow, Tinker checkpoints.

Everything resolves to ONE absolute directory so that `make demo`, `make ui`, the sensor-launched
eval runs (separate processes, other working directories) and the lineage command all see the same
runs, checkpoints and model versions. Relative sqlite paths resolve against the process cwd, which
is exactly the bug this module exists to prevent.

Override with the environment variable ``POSTTRAIN_STATE_DIR`` (tests point it at a tmp dir);
the default is ``<repo>/.state``.
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "POSTTRAIN_STATE_DIR"
MLFLOW_TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"  # MLflow's own variable, honoured the same way


def repo_root() -> Path:
    """The checkout this code runs from (the directory holding ``pyproject.toml``)."""
    return Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    """The absolute project state directory; created on first use."""
    configured = os.environ.get(STATE_DIR_ENV)
    path = Path(configured).expanduser() if configured else repo_root() / ".state"
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_subdir(name: str) -> Path:
    """``<state>/<name>``, created; one per tool (``dagster``, ``mlflow``, ``tinker``, ``data``)."""
    path = state_dir() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_mlflow_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` when set (the scale-out profile: PostgreSQL, see deploy/README.md), else
    sqlite at ``<state>/mlflow/mlflow.db`` (absolute: four slashes after ``sqlite:``)."""
    configured = os.environ.get(MLFLOW_TRACKING_URI_ENV)
    return configured or f"sqlite:///{state_subdir('mlflow') / 'mlflow.db'}"


def default_mlflow_artifact_root() -> Path:
    return state_subdir("mlflow") / "artifacts"


def default_tinker_storage_dir() -> Path:
    """Where the embedded localtinker keeps ``tinker://`` checkpoints across restarts."""
    return state_subdir("tinker")


def dagster_home() -> Path:
    """The absolute DAGSTER_HOME: env ``DAGSTER_HOME`` if set, else ``<state>/dagster``."""
    configured = os.environ.get("DAGSTER_HOME")
    return Path(configured).expanduser().resolve() if configured else state_subdir("dagster")


def ensure_dagster_home() -> Path:
    """Creates DAGSTER_HOME with the repo's ``dagster.yaml`` and exports it for this process and children.

    The instance config lives in the repo (reviewed like code); the home holds the run/event sqlite
    databases. The copy is refreshed whenever the repo's file changes.
    """
    home = dagster_home()
    home.mkdir(parents=True, exist_ok=True)
    template = (repo_root() / "dagster.yaml").read_text()
    target = home / "dagster.yaml"
    if not target.exists() or target.read_text() != template:
        target.write_text(template)
    os.environ["DAGSTER_HOME"] = str(home)
    return home
