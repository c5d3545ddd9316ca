"""The training core with a recipe of its own: rows exactly once, init_from, refused resumes, bad configs.

A recording stand-in for the tinker clients (as in tests/posttrain/supervised/test_loop_order.py): what is
under test is what the core submits, saves, commits and refuses; the real-server path is covered by the
supervised, DPO and RL integration tests.
"""

from types import SimpleNamespace

import pytest

from posttrain.checkpoints import read_checkpoints
from posttrain.metrics import JsonlMetricsLogger, read_metrics
from posttrain.training import DoneStep, JsonlRowSink, RecipeBase, ResumeMismatchError, StepOutcome, TrainingConfig, train
from tests.posttrain.supervised.test_loop_order import _Crash, _RecordingServiceClient


class CountingRecipe(RecipeBase):
    """Step k: one forward_backward + optim_step; reports metric k and two rows tagged with k."""

    name = "counting"

    def __init__(self, steps=6, tag="a"):
        self.steps, self.tag, self.started_at = steps, tag, None

    def num_steps(self):
        return self.steps

    def identity(self):
        return {"tag": self.tag}

    def start(self, training_client, service_client, start_step):
        self.started_at = start_step

    def submit_step(self, step, training_client, adam):
        from posttrain.supervised import datum_from_tokens

        training_client.forward_backward([datum_from_tokens([step, 1], [1, 2], [1.0, 1.0])], "cross_entropy")
        training_client.optim_step(adam)
        return DoneStep(StepOutcome({"k": float(step)}, rows=[{"sample": f"{step}-0"}, {"sample": f"{step}-1"}]))


class _FromStateService(_RecordingServiceClient):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights_from = None

    def create_training_client_from_state(self, path):
        self.weights_from = path
        return self.create_lora_training_client("m", 1, 0)


def _config(tmp_path, **overrides):
    return TrainingConfig(**{"base_model": "m", "learning_rate": 1.0, "save_every": 2, "log_dir": str(tmp_path / "run"), **overrides})


def test_rows_and_metrics_are_committed_exactly_once_across_a_crash(tmp_path):
    config = _config(tmp_path)
    rows, metrics = JsonlRowSink(tmp_path / "run" / "rows.jsonl"), JsonlMetricsLogger(tmp_path / "run" / "metrics.jsonl")
    with pytest.raises(_Crash):
        train(config, CountingRecipe(), _FromStateService(crash_at_step=3), metrics_loggers=[metrics], row_sinks=[rows])
    assert [r.batch for r in read_checkpoints(config.log_dir)] == [2]
    assert [row["step"] for row in rows.read()] == [0, 0, 1, 1]  # step 2 ran but was never committed

    recipe = CountingRecipe()
    result = train(config, recipe, _FromStateService(), metrics_loggers=[metrics], row_sinks=[rows])
    assert recipe.started_at == 2 and result.start_step == 2
    assert [row["sample"] for row in rows.read()] == [f"{k}-{i}" for k in range(6) for i in (0, 1)]
    assert [row["step"] for row in read_metrics(metrics.path)] == list(range(6))
    assert [r.extra["recipe"] for r in read_checkpoints(config.log_dir)] == ["counting"] * 3


def test_init_from_starts_from_the_weights_of_a_checkpoint_but_a_resume_from_its_own_state(tmp_path):
    service = _FromStateService()
    train(_config(tmp_path, init_from="tinker://parent/weights/000010", max_steps=2), CountingRecipe(), service)
    assert service.weights_from == "tinker://parent/weights/000010" and service.created_from is None
    record = read_checkpoints(tmp_path / "run")[-1]
    assert record.extra["init_from"] == "tinker://parent/weights/000010"


@pytest.mark.parametrize(
    "change, named",
    [
        ({"learning_rate": 0.5}, "learning_rate: 1.0 -> 0.5"),
        ({"warmup_steps": 1}, "warmup_steps: 0 -> 1"),
        ({"max_steps": 4}, "total_steps: 6 -> 4"),
        ({"lr_schedule": "cosine"}, "lr_schedule: 'linear' -> 'cosine'"),
    ],
)
def test_a_resume_that_would_change_the_schedule_is_refused(tmp_path, change, named):
    with pytest.raises(_Crash):
        train(_config(tmp_path), CountingRecipe(), _FromStateService(crash_at_step=3))
    with pytest.raises(ResumeMismatchError, match=named):
        train(_config(tmp_path, **change), CountingRecipe(), _FromStateService())
    with pytest.raises(ResumeMismatchError, match="recipe_identity"):
        train(_config(tmp_path), CountingRecipe(tag="b"), _FromStateService())


def test_invalid_configs_name_every_problem(tmp_path):
    with pytest.raises(ValueError, match=r"adam.eps must be positive.*learning_rate must be positive"):
        train(_config(tmp_path, learning_rate=0.0, adam={"eps": 0.0}), CountingRecipe(), _FromStateService())
    with pytest.raises(ValueError, match="warmup_steps=6 must be smaller than the 6 planned steps"):
        train(_config(tmp_path, warmup_steps=6), CountingRecipe(), _FromStateService())
    with pytest.raises(ValueError, match="init_from must be a tinker:// state path"):
        train(_config(tmp_path, init_from="sft-1234"), CountingRecipe(), _FromStateService())
    with pytest.raises(ValueError, match="no step to train"):
        train(_config(tmp_path), CountingRecipe(steps=0), _FromStateService())
