"""Kill soak: SIGKILL the training run (and, some iterations, the localtinker server) at random moments, re-execute
from failure each time, and check that nothing was lost or repeated.

For each recipe (SFT, RL, DPO on offline pairs) on the tiny model: its data assets are materialized once; then
the ``<recipe>_train`` job runs in a child process that is SIGKILLed at a random moment (after 0 or 1 new
checkpoint records, then either at the first optimizer step past the last record or after a random fraction
of one record interval), ``KILLS`` times; every third kill also SIGKILLs the external server, restarted on the
same storage dir and port. Each kill is followed by ``report_run_failed`` (what run monitoring does) and a
re-execution from failure, itself a killable child. Then:
- the last run succeeds; ``checkpoints.jsonl`` holds each planned checkpoint once;
- one manifest and one ``<recipe>_checkpoints`` partition per record, with the record's paths;
- the MLflow history of the recipe's loss has each step exactly once; RL: each rollout row exactly once;
- the final sampler weights, written before a server restart, sample after it.
Figures printed (``-s``): iterations, kills (run / server), steps redone = optim_steps the server executed
beyond the planned steps (counted in its request log).

Run: ``.venv/bin/python -m pytest -q -s -m slow tests/reliability/test_kill_soak.py -p no:cacheprovider``
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import tinker

from assets.checkpoint_manifest import all_manifests
from posttrain.checkpoints import read_checkpoints
from resources.mlflow import MlflowResource
from resources.state import STATE_DIR_ENV, ensure_dagster_home
from pipelines.definitions import RL_DATA_ASSETS, SFT_DATA_ASSETS
from tests.fixtures.dagster_env import TINY_MODEL
from tests.reliability.external_server import REPO, ExternalServer, start_external_server

KILLS = 5
SERVER_KILL_EVERY = 3  # every third kill also takes the server down
MAX_ATTEMPTS = 20
ATTEMPT_TIMEOUT_S = 900


@dataclass(frozen=True)
class SoakRecipe:
    name: str
    data_assets: tuple[str, ...]  # materialized once, before the kills
    data_config: dict
    train_config: dict
    total_steps: int
    save_every: int
    samples_per_step: int = 0  # RL: rollout rows per step
    loss_metric: str = "loss"


SOAK_RECIPES = [
    SoakRecipe(
        "sft", SFT_DATA_ASSETS, {"chat_dataset": {"config": {"limit": 200, "heldout_fraction": 0.1}}},
        {"sft_checkpoint": {"config": {"batch_size": 4, "max_steps": 32, "save_every": 2, "lora_rank": 4, "learning_rate": 1e-3}}},
        total_steps=32, save_every=2,
    ),
    SoakRecipe(
        "rl", RL_DATA_ASSETS, {"rl_problems": {"config": {"limit": 80, "heldout_fraction": 0.1}}},
        {"rl_checkpoint": {"config": {"init_from": "", "max_steps": 24, "save_every": 2, "lora_rank": 4, "learning_rate": 1e-3,
                                      "group_size": 2, "groups_per_batch": 2, "max_tokens": 8}}},
        total_steps=24, save_every=2, samples_per_step=4,
    ),
    SoakRecipe(  # offline verified-vs-wrong pairs (a random tiny model gives no on-policy pairs), reference = base model
        "dpo", ("base_model", "rl_problems", "preference_comparisons", "preference_pairs", "reference_logprobs"),
        {"rl_problems": {"config": {"limit": 16, "heldout_fraction": 0.25}},
         "preference_comparisons": {"config": {"limit": 64, "heldout_fraction": 0.1}},
         "reference_logprobs": {"config": {"pairs": "preference_pairs", "reference": ""}}},
        {"dpo_checkpoint": {"config": {"pairs": "preference_pairs", "init_from": "", "max_steps": 24, "save_every": 2, "lora_rank": 4,
                                       "learning_rate": 1e-3, "batch_size": 2}}},
        total_steps=24, save_every=2, loss_metric="dpo_loss",
    ),
]


@dataclass
class SoakFigures:
    recipe: str
    attempts: int = 0
    run_kills: int = 0
    server_kills: int = 0
    optim_steps_executed: int = 0
    steps_redone: int = 0


def _child(recipe: str, args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "tests.reliability.soak_job", recipe, *args], cwd=REPO, env=dict(os.environ),
                                start_new_session=True, stdout=out, stderr=subprocess.STDOUT)


def _optim_steps(server_log: Path) -> int:
    """Optimizer steps the server has received so far (its access log survives restarts: appended)."""
    return server_log.read_text(errors="replace").count("/optim_step ") if server_log.exists() else 0


def _records(log_dir: Path | None) -> int:
    return len(read_checkpoints(log_dir)) if log_dir is not None and (log_dir / "checkpoints.jsonl").exists() else 0


def _soak(recipe: SoakRecipe, root: Path, rng: random.Random) -> tuple[SoakFigures, ExternalServer, dg.DagsterInstance]:
    from pipelines.definitions import build_definitions
    from tests.reliability.soak_job import soak_resources

    state = root / "state"
    figures = SoakFigures(recipe.name)
    server_log = root / "server.log"
    server = start_external_server(root / "server-storage", server_log, log_level="info")
    os.environ["TINKER_BASE_URL"] = server.base_url
    instance = dg.DagsterInstance.from_config(str(ensure_dagster_home()))
    data = build_definitions(soak_resources()).resolve_implicit_global_asset_job_def()
    selection = [dg.AssetKey(name) for name in recipe.data_assets]
    assert data.execute_in_process(instance=instance, run_config={"ops": recipe.data_config}, asset_selection=selection).success

    args = [json.dumps({"ops": recipe.train_config})]
    training = state / "training"
    interval = 4.0  # seconds from one checkpoint record to the next, re-measured as records land
    while True:
        figures.attempts += 1
        assert figures.attempts <= MAX_ATTEMPTS, f"{recipe.name}: no successful run after {MAX_ATTEMPTS} attempts"
        child = _child(recipe.name, args, root / "runs.log")
        log_dir = next(iter(training.glob("*")), None) if training.exists() else None
        kill = figures.run_kills < KILLS
        # Kill at a random moment after 0 or 1 new checkpoint records: half the time as soon as the server sees the
        # first optimizer step past the last record (mid-interval, so that step is redone), half the time after a
        # random fraction of one record-to-record interval (measured as records land; 4 s until then). Either wait
        # ends early if another record lands: at most two new records per kill, and 12+ records leave room for all
        # KILLS however fast the steps run.
        wait_for_records = _records(log_dir) + rng.randint(0, 1)
        seen, seen_at = _records(log_dir), None
        deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
        while child.poll() is None and kill:
            log_dir = next(iter(training.glob("*")), None) if training.exists() else None
            current = _records(log_dir)
            if current > seen:
                now = time.monotonic()
                if seen_at is not None:
                    interval = (now - seen_at) / (current - seen)
                seen, seen_at = current, now
            if current >= wait_for_records:
                if rng.random() < 0.5:
                    steps = _optim_steps(server_log)
                    kill_now = lambda: _optim_steps(server_log) > steps  # noqa: E731
                else:
                    delay_ends = time.monotonic() + rng.uniform(0.0, 1.0) * interval
                    kill_now = lambda: time.monotonic() >= delay_ends  # noqa: E731
                while not kill_now() and _records(log_dir) <= current and child.poll() is None:
                    time.sleep(0.02)
                break
            assert time.monotonic() < deadline, f"{recipe.name}: attempt {figures.attempts} hung"
            time.sleep(0.05)
        if kill and child.poll() is None:
            if figures.run_kills % SERVER_KILL_EVERY == SERVER_KILL_EVERY - 1:
                server.kill()
                figures.server_kills += 1
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            figures.run_kills += 1
            if server.process.poll() is not None:
                server.start()  # same port, same storage: tinker:// paths of earlier attempts must still load
        else:
            assert child.wait(ATTEMPT_TIMEOUT_S) == 0, f"{recipe.name}: attempt {figures.attempts} failed; see {root / 'runs.log'}"
            break
        runs = instance.get_runs(dg.RunsFilter(job_name=f"{recipe.name}_train"), limit=1)
        if not runs:  # killed before it created its run: start over
            continue
        latest = runs[0]
        if latest.status == dg.DagsterRunStatus.STARTED:
            instance.report_run_failed(latest)
        latest = instance.get_run_by_id(latest.run_id)
        if latest.status == dg.DagsterRunStatus.SUCCESS:
            break
        args = ["--from-failure", latest.run_id]
    return figures, server, instance


@pytest.mark.slow
@pytest.mark.timeout(3600)  # KILLS restarts of a Dagster process each; many minutes under load
@pytest.mark.parametrize("recipe", SOAK_RECIPES, ids=lambda recipe: recipe.name)
def test_random_kills_of_run_and_server_lose_and_repeat_nothing(recipe: SoakRecipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    for name, value in {STATE_DIR_ENV: str(state), "DAGSTER_HOME": str(state / "dagster"), "POSTTRAIN_BASE_MODEL": TINY_MODEL,
                        "TINKER_BASE_URL": ""}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    figures, server, instance = _soak(recipe, tmp_path, random.Random(f"soak-{recipe.name}"))
    try:
        (log_dir,) = list((state / "training").glob("*"))
        records = read_checkpoints(log_dir)
        assert [r.batch for r in records] == list(range(recipe.save_every, recipe.total_steps + 1, recipe.save_every))
        manifests = sorted((m for m in all_manifests() if m.recipe == recipe.name), key=lambda m: m.step)
        assert [(m.step, m.state_path, m.sampler_path) for m in manifests] == [(r.batch, r.state_path, r.sampler_path) for r in records]
        assert sorted(instance.get_dynamic_partitions(f"{recipe.name}_checkpoints")) == sorted(m.partition for m in manifests)

        mlflow = MlflowResource()
        client = mlflow.get_client()
        (run,) = client.search_runs([mlflow.experiment_id(client)], f"tags.`posttrain.log_dir` = '{log_dir}'")
        assert [m.step for m in client.get_metric_history(run.info.run_id, recipe.loss_metric)] == list(range(recipe.total_steps))
        if recipe.samples_per_step:
            rows = pq.read_table(state / "parquet" / "rollout_batches.parquet").to_pylist()
            assert Counter(row["step"] for row in rows) == {step: recipe.samples_per_step for step in range(recipe.total_steps)}
            assert len({(row["step"], row["group"], row["sample"]) for row in rows}) == len(rows)

        if figures.server_kills == 0:
            server.restart()  # the final paths must outlive a server restart even when no kill hit the server
        with tinker.ServiceClient(base_url=server.base_url, api_key="tml-local") as service:
            sampler = service.create_sampling_client(model_path=records[-1].sampler_path)
            sample = sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 1, tinker.SamplingParams(max_tokens=2, seed=0)).result()
            assert len(sample.sequences[0].tokens) == 2

        figures.optim_steps_executed = _optim_steps(tmp_path / "server.log")
        figures.steps_redone = figures.optim_steps_executed - recipe.total_steps
        assert figures.run_kills == KILLS and figures.steps_redone >= 0
        print(f"\nSOAK {recipe.name}: attempts={figures.attempts} run_kills={figures.run_kills} server_kills={figures.server_kills} "
              f"planned_steps={recipe.total_steps} optim_steps_executed={figures.optim_steps_executed} steps_redone={figures.steps_redone} "
              f"checkpoints={len(records)} wall={time.monotonic() - started:.0f}s (under load)")
    finally:
        server.stop()
        instance.dispose()
