"""`make ui`: the Dagster UI (webserver + daemon, so the eval sensor runs) and the MLflow UI, on loopback.

Both read the persistent project state: DAGSTER_HOME (absolute, holding the repo's dagster.yaml) and
the MLflow sqlite store under the state dir, so the runs `make demo` made are there to browse. The Dagster
side is `dagster-daemon run` plus Dagster's webserver with a ``/mlflow`` redirect to the MLflow UI started
here (pipelines/webserver.py), so MLflow links on asset pages follow ``--mlflow-port``. Each server is its
own process group, stopped together on Ctrl-C.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipelines.webserver import CODE_LOCATION_MODULE
from resources.mlflow_links import MLFLOW_UI_URL_ENV
from resources.state import default_mlflow_artifact_root, default_mlflow_tracking_uri, ensure_dagster_home, repo_root

DAGSTER_PORT = 3000
MLFLOW_PORT = 5000


def redact_password(uri: str) -> str:
    """``postgresql+psycopg2://user:secret@host/db`` → ``...://user:***@host/db``: printed URIs never carry a password."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", uri)
HOST = "127.0.0.1"


def bin_path(name: str) -> str:
    """The console script beside this interpreter (the project venv), else whatever PATH has."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def start_dagster(port: int, mlflow_ui_url: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """The daemon (automation, schedules, queued runs) and the webserver, each its own process group."""
    ensure_dagster_home()
    environment = {**os.environ, **(env or {})}
    daemon = [bin_path("dagster-daemon"), "run", "-m", CODE_LOCATION_MODULE]
    webserver = [sys.executable, "-m", "pipelines.webserver", "--host", HOST, "--port", str(port), "--mlflow-ui-url", mlflow_ui_url]
    return [subprocess.Popen(command, cwd=repo_root(), env=environment, start_new_session=True) for command in (daemon, webserver)]


def start_mlflow(port: int = MLFLOW_PORT, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [
        bin_path("mlflow"), "server",
        "--backend-store-uri", default_mlflow_tracking_uri(),
        "--default-artifact-root", default_mlflow_artifact_root().as_uri(),
        "--host", HOST, "--port", str(port), "--workers", "1",
    ]
    return subprocess.Popen(command, cwd=repo_root(), env={**os.environ, **(env or {})}, start_new_session=True)


def wait_until_up(url: str, process: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before {url} came up")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; empty where there is none). Dagster starts its code servers
    in process groups of their own, so a signal to the server's group does not reach them."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # the command name in field 2 may hold spaces; the parent pid is the 2nd field after its ')'
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found.extend(children)
        frontier.extend(children)
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def stop(process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM to the server's process group and to every process below it (code servers live in groups
    of their own), SIGKILL to whatever lingers past ``timeout_s``."""
    if process.poll() is not None:
        return
    below = _descendants(process.pid)
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in below if _alive(pid)]) and time.monotonic() < deadline:
        _signal_all(left, signal.SIGTERM)
        time.sleep(0.5)
    _signal_all([pid for pid in below if _alive(pid)], signal.SIGKILL)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve(dagster_port: int = DAGSTER_PORT, mlflow_port: int = MLFLOW_PORT) -> int:
    # The servers run in their own process groups, so a SIGTERM/SIGHUP to this process must stop them
    # explicitly (the default action would exit without running `finally`, orphaning both).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    mlflow_ui_url = f"http://{HOST}:{mlflow_port}"
    os.environ[MLFLOW_UI_URL_ENV] = mlflow_ui_url  # links the Dagster processes print in logs
    mlflow = start_mlflow(mlflow_port)
    daemon, webserver = start_dagster(dagster_port, mlflow_ui_url)
    servers = (webserver, daemon, mlflow)
    try:
        wait_until_up(f"http://{HOST}:{mlflow_port}/health", mlflow)
        wait_until_up(f"http://{HOST}:{dagster_port}/server_info", webserver)
        print(f"Dagster UI  http://{HOST}:{dagster_port}   (DAGSTER_HOME={os.environ['DAGSTER_HOME']})")
        print(f"MLflow UI   {mlflow_ui_url}    ({redact_password(default_mlflow_tracking_uri())})")
        print("Ctrl-C stops both.", flush=True)
        while all(server.poll() is None for server in servers):
            time.sleep(1.0)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for server in servers:
            stop(server)
