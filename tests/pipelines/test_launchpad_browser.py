"""Headless Chromium launches the SFT training job from the Dagster launchpad and sees the run succeed.

The data assets are materialized in-process first (48 conversations, so the launchpad's default
training config makes a few steps on the tiny model); the training run itself is launched by clicking
"Launch run" in the UI, executed by `dagster dev`'s run launcher in its own process, and watched to
success both in the instance and on the run page.
"""

import socket
import time

import dagster as dg
import pytest

from pipelines.definitions import build_definitions
from pipelines.ui import start_dagster, stop, wait_until_up
from tests.fixtures.dagster_env import TINY_CHAIN_CONFIG, TINY_MODEL, tiny_resources

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.browser
def test_sft_training_launched_from_the_launchpad_succeeds(dagster_instance, project_state, monkeypatch):
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("POSTTRAIN_BASE_MODEL", TINY_MODEL)
    monkeypatch.setenv("LOCALTINKER_DTYPE", "float32")
    data_config = {"ops": {k: v for k, v in TINY_CHAIN_CONFIG["ops"].items() if k != "sft_checkpoint"}}
    data = build_definitions(tiny_resources(project_state)).resolve_job_def("sft_data")
    assert data.execute_in_process(instance=dagster_instance, run_config=data_config).success
    port = _free_port()
    server = start_dagster(port)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(f"{base}/server_info", server)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.goto(f"{base}/locations/pipelines.definitions/jobs/sft_train/playground", timeout=120_000)
            launch = page.get_by_role("button", name="Launch run")
            launch.wait_for(timeout=120_000)
            launch.click()
            page.wait_for_url("**/runs/*", timeout=120_000)
            run_id = page.url.rstrip("/").split("/runs/")[-1].split("?")[0]
            status = _wait_for_run(dagster_instance, run_id, timeout_s=600)
            assert status == dg.DagsterRunStatus.SUCCESS
            assert dagster_instance.get_run_by_id(run_id).job_name == "sft_train"
            assert dagster_instance.get_dynamic_partitions("sft_checkpoints")
            page.reload()
            page.get_by_text("Success", exact=True).first.wait_for(timeout=60_000)
            browser.close()
    finally:
        stop(server)


def _wait_for_run(instance: dg.DagsterInstance, run_id: str, timeout_s: float) -> dg.DagsterRunStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = instance.get_run_by_id(run_id)
        if run is not None and run.is_finished:
            return run.status
        time.sleep(2.0)
    raise TimeoutError(f"run {run_id} did not finish within {timeout_s:.0f} s")
