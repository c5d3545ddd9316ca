"""The scale-out deployment as separate processes, the way an operator runs it (deploy/README.md).

- PostgreSQL (``postgres_cluster``) holds Dagster's runs, events and schedules (database ``dagster``) and
  MLflow's tracking store (database ``mlflow``);
- DAGSTER_HOME holds a verbatim copy of ``deploy/postgres/dagster.yaml``, and the ``tinker`` pool's limit is set
  with ``dagster instance concurrency set`` before anything is queued;
- one localtinker server stands in for hosted Tinker, shared by every run;
- a gRPC code server serves ``pipelines.definitions`` (the production code location, unchanged);
- ``dagster-daemon run`` with ``deploy/postgres/workspace.yaml`` dequeues runs, ticks the automation sensor and
  launches runs through the code server.

Every process gets its own session (``start_new_session``) and is stopped by signalling its process group,
so the run workers the code server spawned go with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resources.state import repo_root
from tests.fixtures.network import free_port
from tests.scaleout.postgres_cluster import HOST, PostgresCluster

PROFILE_DIR = repo_root() / "deploy" / "postgres"
BIN = Path(sys.executable).parent
POOL, POOL_LIMIT = "tinker", 1  # the training assets' pool; one training run at a time in the test


@dataclass(frozen=True)
class Deployment:
    root: Path
    env: dict[str, str]
    dagster_home: Path
    mlflow_tracking_uri: str
    logs: Path

    def launch(self, job: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        """``dagster job launch``: with the QueuedRunCoordinator this only enqueues the run."""
        self.dagster(
            "job", "launch",
            "-w", str(PROFILE_DIR / "workspace.yaml"),
            "-j", job,
            "--config-json", json.dumps(run_config),
            "--tags", json.dumps(dict(tags)),
        )  # fmt: skip

    def dagster(self, *args: str) -> None:
        """One ``dagster`` CLI command against this deployment's instance; raises with its output if it fails."""
        command = [str(BIN / "dagster"), *args]
        result = subprocess.run(command, env=self.env, cwd=repo_root(), capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:4])} failed: {result.stdout[-3000:]}{result.stderr[-3000:]}")

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no {path})"


def _start(name: str, command: list[str], env: Mapping[str, str], logs: Path) -> subprocess.Popen:
    log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps writing after we return
    try:
        return subprocess.Popen(
            command, env=dict(env), cwd=repo_root(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        log.close()


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the whole process group, SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_until(condition: Callable[[], bool], timeout_s: float, what: Callable[[], str], every_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what()}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _grpc_healthy(env: Mapping[str, str], port: int) -> bool:
    command = [str(BIN / "dagster"), "api", "grpc-health-check", "--host", HOST, "--port", str(port)]
    return subprocess.run(command, env=dict(env), capture_output=True, timeout=60).returncode == 0


@contextmanager
def running_deployment(cluster: PostgresCluster, root: Path, base_model: str) -> Iterator[Deployment]:
    """Creates the databases, writes DAGSTER_HOME, starts localtinker, the code server and the daemon."""
    cluster.create_database("dagster")
    cluster.create_database("mlflow")
    logs, home, state = root / "logs", root / "dagster_home", root / "state"
    for directory in (logs, home, state):
        directory.mkdir(parents=True)
    shutil.copyfile(PROFILE_DIR / "dagster.yaml", home / "dagster.yaml")
    tinker_port, code_port = free_port(), free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "POSTTRAIN_STATE_DIR": str(state),
        "DAGSTER_PG_HOST": cluster.host,
        "DAGSTER_PG_PORT": str(cluster.port),
        "DAGSTER_PG_USERNAME": cluster.username,
        "DAGSTER_PG_PASSWORD": cluster.password,
        "DAGSTER_PG_DB": "dagster",
        "MLFLOW_TRACKING_URI": cluster.url("mlflow"),
        "POSTTRAIN_CODE_SERVER_HOST": HOST,
        "POSTTRAIN_CODE_SERVER_PORT": str(code_port),
        "TINKER_BASE_URL": f"http://{HOST}:{tinker_port}",
        "POSTTRAIN_BASE_MODEL": base_model,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TINKER_TELEMETRY": "0",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("TINKER_API_KEY", None)
    with ExitStack() as stack:
        tinker = _start(
            "localtinker",
            [sys.executable, "-m", "localtinker", "serve", "--host", HOST, "--port", str(tinker_port),
             "--storage", str(root / "tinker"), "--threads", "1", "--log-level", "warning"],
            env, logs,
        )  # fmt: skip
        stack.callback(_stop, tinker)
        code_server = _start(
            "code_server",
            [str(BIN / "dagster"), "api", "grpc", "--module-name", "pipelines.definitions",
             "--host", HOST, "--port", str(code_port)],
            env, logs,
        )  # fmt: skip
        stack.callback(_stop, code_server)
        deployment = Deployment(root, env, home, cluster.url("mlflow"), logs)
        # As deploy/README.md says: the pool's limit is set before any run is queued. Left to `default_limit`, the
        # daemon creates it during its first dequeue and lets every run queued by then through unlimited.
        deployment.dagster("instance", "concurrency", "set", POOL, str(POOL_LIMIT))
        wait_until(lambda: _http_ok(f"{env['TINKER_BASE_URL']}/api/v1/healthz"), 120, lambda: deployment.log_tail("localtinker"))
        wait_until(lambda: _grpc_healthy(env, code_port), 240, lambda: deployment.log_tail("code_server"), every_s=3)
        daemon = _start("daemon", [str(BIN / "dagster-daemon"), "run", "-w", str(PROFILE_DIR / "workspace.yaml")], env, logs)
        stack.callback(_stop, daemon)
        yield deployment
