"""`make ui` (= `python -m pipelines ui`): both UIs come up on loopback, a training run launched from the
Dagster launchpad in headless Chromium succeeds, and a SIGTERM stops everything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import psutil
import pytest

from pipelines.definitions import build_definitions
from resources.state import repo_root
from tests.fixtures.dagster_env import TINY_CHAIN_CONFIG, TINY_MODEL, tiny_resources
from tests.fixtures.network import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"
]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.browser
def test_ui_serves_both_uis_launches_training_from_the_launchpad_and_leaves_nothing_behind_on_sigterm(
    dagster_instance: dg.DagsterInstance, project_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One `python -m pipelines ui` for the whole user path (one server start-up instead of two tests' worth):
    both UIs answer; headless Chromium clicks "Launch run" on the SFT training launchpad and the run,
    executed by `dagster dev`'s run launcher in its own process, succeeds in the instance and on the run
    page; then a SIGTERM stops every process and frees both ports."""
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("POSTTRAIN_BASE_MODEL", TINY_MODEL)
    monkeypatch.setenv("LOCALTINKER_DTYPE", "float32")
    # The data assets first, in-process (48 conversations: the launchpad's default config makes a few steps).
    data_config = {"ops": {k: v for k, v in TINY_CHAIN_CONFIG["ops"].items() if k != "sft_checkpoint"}}
    data = build_definitions(tiny_resources(project_state)).resolve_job_def("sft_data")
    assert data.execute_in_process(instance=dagster_instance, run_config=data_config).success

    dagster_port, mlflow_port = free_port(), free_port()
    ui = _start_ui(dagster_port, mlflow_port, project_state / "ui.log")
    descendants: list[psutil.Process] = []
    try:
        base = f"http://127.0.0.1:{dagster_port}"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.goto(f"{base}/locations/pipelines.definitions/jobs/sft_train/playground", timeout=120_000)
            launch = page.get_by_role("button", name="Launch run")
            launch.wait_for(timeout=120_000)
            launch.click()
            page.wait_for_url("**/runs/*", timeout=120_000)
            run_id = page.url.rstrip("/").split("/runs/")[-1].split("?")[0]
            assert _wait_for_run(dagster_instance, run_id, timeout_s=600) == dg.DagsterRunStatus.SUCCESS
            assert dagster_instance.get_run_by_id(run_id).job_name == "sft_train"
            assert dagster_instance.get_dynamic_partitions("sft_checkpoints")
            page.reload()
            page.get_by_text("Success", exact=True).first.wait_for(timeout=60_000)
            browser.close()

        descendants = psutil.Process(ui.pid).children(recursive=True)
        os.kill(ui.pid, signal.SIGTERM)
        assert ui.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, f"left running after SIGTERM: {[p.cmdline()[:3] for p in alive]}"
        assert _port_is_free(dagster_port) and _port_is_free(mlflow_port)
    finally:
        if ui.poll() is None:
            descendants = psutil.Process(ui.pid).children(recursive=True) + [psutil.Process(ui.pid)]
        for process in descendants:
            if process.is_running():
                process.kill()


def _start_ui(dagster_port: int, mlflow_port: int, log_path: Path) -> subprocess.Popen:
    """`python -m pipelines ui` on the given ports (its output to `log_path`, never an unread pipe that
    fills and stalls the servers), returned once both UIs answer."""
    command = ["-m", "pipelines", "ui", "--dagster-port", str(dagster_port), "--mlflow-port", str(mlflow_port)]
    ui = subprocess.Popen(
        [sys.executable, *command],
        cwd=repo_root(),
        env=dict(os.environ),
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    up = False
    while time.monotonic() < deadline and ui.poll() is None:
        up = _answers(f"http://127.0.0.1:{dagster_port}/server_info") and _answers(f"http://127.0.0.1:{mlflow_port}/health")
        if up:
            return ui
        time.sleep(1)
    _stop_tree(ui)
    raise AssertionError(f"UIs did not come up; ui exited with {ui.poll()}; see {log_path}")


def _stop_tree(ui: subprocess.Popen) -> None:
    if ui.poll() is None:
        processes = psutil.Process(ui.pid).children(recursive=True) + [psutil.Process(ui.pid)]
        for process in processes:
            if process.is_running():
                process.kill()


def _training_jobs() -> list[str]:
    """Every recipe's `_train` and `_chain` job (and any further chain, e.g. DPO on offline pairs)."""
    from pipelines.definitions import defs

    return sorted(job.name for job in defs.resolve_all_job_defs() if job.name.endswith(("_train", "_chain")))


EDIT_LEARNING_RATE = """() => {
    const editor = document.querySelector('.CodeMirror').CodeMirror;
    const text = editor.getValue();
    if (!/learning_rate: /.test(text)) return false;
    editor.setValue(text.replace(/learning_rate: [^\\n]+/, 'learning_rate: 3e-5'));
    return true;
}"""
"""Changes the learning rate to exponent notation (a string to YAML 1.1), as a person tuning it would."""


@pytest.mark.browser
@pytest.mark.slow
def test_every_training_job_launches_after_a_person_scaffolds_its_defaults_and_edits_one(
    dagster_instance: dg.DagsterInstance, project_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For each recipe's `_train` and `_chain` job: "Scaffold all default config" (whose YAML the launchpad
    rewrites in JavaScript: `eps: 1e-12`), change the learning rate to `3e-5` (exponent notation, a string
    to YAML 1.1), "Launch run", and the run starts; it is then terminated (starting is what is tested)."""
    from dagster_graphql import DagsterGraphQLClient
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("POSTTRAIN_BASE_MODEL", TINY_MODEL)
    dagster_port, mlflow_port = free_port(), free_port()
    ui = _start_ui(dagster_port, mlflow_port, project_state / "ui.log")
    client = DagsterGraphQLClient("127.0.0.1", port_number=dagster_port)
    base = f"http://127.0.0.1:{dagster_port}/locations/pipelines.definitions/jobs"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            for job_name in _training_jobs():
                page.goto(f"{base}/{job_name}/playground", timeout=120_000)
                page.get_by_role("button", name="Scaffold all default config").click(timeout=120_000)
                page.get_by_role("button", name="Confirm").click()
                page.get_by_text("All defaults expanded").wait_for(timeout=60_000)
                assert page.evaluate(EDIT_LEARNING_RATE), f"{job_name}: no learning_rate scaffolded"
                launch = page.get_by_role("button", name="Launch run")
                page.wait_for_function(
                    "() => [...document.querySelectorAll('button')].some(b => b.textContent.trim().toLowerCase() === 'launch run' && !b.disabled)",
                    timeout=60_000,
                )
                launch.click()
                page.wait_for_url("**/runs/*", timeout=120_000)
                run_id = page.url.rstrip("/").split("/runs/")[-1].split("?")[0]
                run = dagster_instance.get_run_by_id(run_id)
                assert run.job_name == job_name
                assert run.run_config["ops"][_training_op(run.run_config)]["config"]["learning_rate"] == "3e-5"
                status = _wait_for_start(dagster_instance, run_id, timeout_s=300)
                _terminate(client, dagster_instance, run_id)
                assert status != dg.DagsterRunStatus.QUEUED, f"{job_name}: run never started"
            browser.close()
    finally:
        _stop_tree(ui)


def _terminate(client, instance: dg.DagsterInstance, run_id: str) -> None:
    """Stop a started run (it may finish on its own meanwhile: then there is nothing to stop)."""
    from dagster_graphql import DagsterGraphQLClientError

    try:
        if not instance.get_run_by_id(run_id).is_finished:
            client.terminate_run(run_id)
    except DagsterGraphQLClientError:
        if not instance.get_run_by_id(run_id).is_finished:
            raise
    _wait_for_run(instance, run_id, timeout_s=300)


def _training_op(run_config: dict) -> str:
    return next(name for name, op in run_config["ops"].items() if "learning_rate" in op.get("config", {}))


def _wait_for_start(instance: dg.DagsterInstance, run_id: str, timeout_s: float) -> dg.DagsterRunStatus:
    """The run's status once it left the queue and the launcher (STARTED or finished)."""
    waiting = {dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = instance.get_run_by_id(run_id)
        if run is not None and run.status not in waiting:
            return run.status
        time.sleep(1.0)
    raise TimeoutError(f"run {run_id} did not start within {timeout_s:.0f} s")


def _wait_for_run(instance: dg.DagsterInstance, run_id: str, timeout_s: float) -> dg.DagsterRunStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = instance.get_run_by_id(run_id)
        if run is not None and run.is_finished:
            return run.status
        time.sleep(2.0)
    raise TimeoutError(f"run {run_id} did not finish within {timeout_s:.0f} s")


def test_printed_tracking_uri_never_shows_a_database_password() -> None:
    from pipelines.ui import redact_password

    assert redact_password("postgresql+psycopg2://mlflow:s3cret@127.0.0.1:5432/mlflow") == "postgresql+psycopg2://mlflow:***@127.0.0.1:5432/mlflow"
    assert redact_password("sqlite:////state/mlflow/mlflow.db") == "sqlite:////state/mlflow/mlflow.db"
