"""`make ui` (= `python -m pipelines ui`): both UIs come up on loopback, and a SIGTERM stops everything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from resources.state import repo_root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_ui_serves_dagster_and_mlflow_and_leaves_nothing_behind_on_sigterm(project_state: Path) -> None:
    dagster_port, mlflow_port = _free_port(), _free_port()
    ui = subprocess.Popen(
        [sys.executable, "-m", "pipelines", "ui", "--dagster-port", str(dagster_port), "--mlflow-port", str(mlflow_port)],
        cwd=repo_root(),
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        up = False
        while time.monotonic() < deadline and ui.poll() is None:
            descendants = psutil.Process(ui.pid).children(recursive=True)
            up = _answers(f"http://127.0.0.1:{dagster_port}/server_info") and _answers(
                f"http://127.0.0.1:{mlflow_port}/health"
            )
            if up:
                break
            time.sleep(1)
        assert up, f"UIs did not come up; ui exited with {ui.poll()}"
        descendants = psutil.Process(ui.pid).children(recursive=True)

        os.kill(ui.pid, signal.SIGTERM)
        assert ui.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, f"left running after SIGTERM: {[p.cmdline()[:3] for p in alive]}"
        assert _port_is_free(dagster_port) and _port_is_free(mlflow_port)
    finally:
        for process in [*descendants, psutil.Process(ui.pid) if ui.poll() is None else None]:
            if process is not None and process.is_running():
                process.kill()


def test_printed_tracking_uri_never_shows_a_database_password() -> None:
    from pipelines.ui import redact_password

    assert redact_password("postgresql+psycopg2://mlflow:s3cret@127.0.0.1:5432/mlflow") == "postgresql+psycopg2://mlflow:***@127.0.0.1:5432/mlflow"
    assert redact_password("sqlite:////state/mlflow/mlflow.db") == "sqlite:////state/mlflow/mlflow.db"
