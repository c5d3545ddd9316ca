"""The loop's own scheduling decisions, observed through a recording stand-in for the tinker clients.

What is under test is the order in which the loop submits and awaits work, and how it resumes; the
server is irrelevant here (the real-server tests in test_train_integration.py cover the SDK path).
"""

from types import SimpleNamespace

import numpy as np
import pytest
import tinker

from posttrain.checkpoints import read_checkpoints
from posttrain.metrics import JsonlMetricsLogger, read_metrics
from posttrain.supervised import SupervisedConfig, datum_from_tokens, train_supervised


class _Future:
    def __init__(self, events, label, value):
        self.events, self.label, self.value = events, label, value

    def result(self):
        self.events.append(("await", self.label))
        return self.value


class _Crash(Exception):
    pass


class _RecordingTrainingClient:
    def __init__(self, events, crash_at_step=None):
        self.events = events
        self.steps = 0
        self.crash_at_step = crash_at_step

    def forward_backward(self, batch, loss_fn):
        if self.steps == self.crash_at_step:
            raise _Crash()
        self.events.append(("fb", self.steps, tuple(d.model_input.to_ints()[0] for d in batch)))
        outputs = [{"logprobs": tinker.TensorData.from_numpy(np.full(d.model_input.length, -1.0, np.float32))} for d in batch]
        return _Future(self.events, ("fb", self.steps), SimpleNamespace(loss_fn_outputs=outputs, metrics={"loss:sum": 1.0}))

    def optim_step(self, params):
        self.events.append(("optim", self.steps, params.learning_rate))
        self.steps += 1
        return _Future(self.events, ("optim", self.steps - 1), None)

    def save_state(self, name, ttl_seconds=None):
        self.events.append(("save_state", name))
        return _Future(self.events, ("save_state", name), SimpleNamespace(path=f"tinker://run/weights/{name}"))

    def save_weights_for_sampler(self, name, ttl_seconds=None):
        self.events.append(("save_sampler", name))
        return _Future(self.events, ("save_sampler", name), SimpleNamespace(path=f"tinker://run/sampler_weights/{name}"))


class _RecordingServiceClient:
    def __init__(self, crash_at_step=None):
        self.events = []
        self.crash_at_step = crash_at_step
        self.created_from = None

    def create_lora_training_client(self, base_model, rank, seed):
        return SimpleNamespace(result=lambda: _RecordingTrainingClient(self.events, self.crash_at_step))

    def create_training_client_from_state_with_optimizer(self, path):
        self.created_from = path
        return SimpleNamespace(result=lambda: _RecordingTrainingClient(self.events, self.crash_at_step))


def _dataset():
    return [datum_from_tokens([i, i + 1], [i + 1, i + 2], [1.0, 1.0]) for i in range(0, 80, 10)]


def _config(tmp_path, **overrides):
    values = dict(base_model="m", learning_rate=1.0, lr_schedule="linear", batch_size=2, num_epochs=2,
                  save_every=3, log_dir=str(tmp_path / "run"))
    return SupervisedConfig.from_dict({**values, **overrides})


def test_next_step_is_submitted_before_previous_results_are_awaited(tmp_path):
    service = _RecordingServiceClient()
    train_supervised(_config(tmp_path), _dataset(), service)
    kinds = [event[:2] if event[0] != "await" else ("await", event[1]) for event in service.events]
    # Step 1 is submitted before step 0 is awaited ...
    assert kinds.index(("fb", 1)) < kinds.index(("await", ("fb", 0)))
    # ... but before a checkpoint after step 2 the pipeline drains: step 3 comes after both saves returned.
    assert kinds.index(("await", ("optim", 2))) < kinds.index(("save_state", "000003"))
    assert kinds.index(("await", ("save_sampler", "000003"))) < kinds.index(("fb", 3))
    learning_rates = [event[2] for event in service.events if event[0] == "optim"]
    assert learning_rates == pytest.approx([1 - s / 8 for s in range(8)])


def test_crash_then_resume_trains_every_batch_once_and_logs_every_step_once(tmp_path):
    config = _config(tmp_path)
    reference = _RecordingServiceClient()
    train_supervised(_config(tmp_path / "reference"), _dataset(), reference)
    expected_batches = [event[2] for event in reference.events if event[0] == "fb"]

    metrics_path = tmp_path / "run" / "metrics.jsonl"
    crashing = _RecordingServiceClient(crash_at_step=5)
    with pytest.raises(_Crash):
        train_supervised(config, _dataset(), crashing, metrics_loggers=[JsonlMetricsLogger(metrics_path)])
    assert [r.batch for r in read_checkpoints(config.training.log_dir)] == [3]
    assert [row["step"] for row in read_metrics(metrics_path)] == [0, 1, 2]  # step 3, 4 were never committed

    resumed = _RecordingServiceClient()
    result = train_supervised(config, _dataset(), resumed, metrics_loggers=[JsonlMetricsLogger(metrics_path)])
    assert resumed.created_from == "tinker://run/weights/000003"
    trained_first = [event[2] for event in crashing.events if event[0] == "fb"][:3]
    trained_after = [event[2] for event in resumed.events if event[0] == "fb"]
    assert trained_first + trained_after == expected_batches
    assert [r.batch for r in read_checkpoints(config.training.log_dir)] == [3, 6, 8]
    assert result.final_checkpoint.final and result.start_step == 3
    assert [row["step"] for row in read_metrics(metrics_path)] == list(range(8))

    again = _RecordingServiceClient()
    repeated = train_supervised(config, _dataset(), again)
    assert again.events == []  # already complete: nothing is trained twice
    assert repeated.final_checkpoint == result.final_checkpoint
    assert repeated.final_metrics == result.final_metrics and repeated.final_metrics["loss"] == 1.0


def test_resume_with_a_different_batch_order_is_refused(tmp_path):
    train_supervised(_config(tmp_path, max_steps=3), _dataset(), _RecordingServiceClient())
    with pytest.raises(ValueError, match="seed: 0 -> 9"):
        train_supervised(_config(tmp_path, seed=9), _dataset(), _RecordingServiceClient())
