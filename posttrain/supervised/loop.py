"""The supervised training loop over the tinker SDK (cookbook semantics), resumable after SIGKILL.

One call trains ``config`` on ``data`` through ``service_client`` and returns a
:class:`SupervisedResult`. What it guarantees:

- Pipelining: step ``s+1``'s ``forward_backward`` and ``optim_step`` are submitted before step ``s``'s
  results are awaited, so the server never idles while the client computes metrics. The pipeline is
  drained only before a checkpoint or an evaluation, so those see exactly the weights after step ``s``.
- Learning rate: ``learning_rate_at(step)`` from ``posttrain.schedules`` goes into each step's AdamParams.
- Checkpoints: every ``save_every`` steps and after the last step (``final: true``), state + sampler
  weights are saved and, only after both returned, a record ``{name, batch, epoch, final?, state_path,
  sampler_path}`` is appended durably to ``<log_dir>/checkpoints.jsonl``; then ``on_checkpoint(record)``.
  A recorded checkpoint always exists on the server; an unrecorded save is simply never used.
- Resume: calling again with the same ``log_dir`` restarts from the last record's ``state_path`` with its
  Adam state (``create_training_client_from_state_with_optimizer``) at batch index ``record.batch``: no
  batch is repeated or skipped. A run whose final checkpoint covers every planned step returns at once.
  ``<log_dir>/run.json`` remembers what fixes the batch order and refuses a resume that would change it.
- Metrics: per step ``loss`` (mean NLL per trained token), ``loss_sum`` (the server's summed weighted
  loss), ``learning_rate``, ``num_sequences``, ``num_tokens``, ``num_trained_tokens``,
  ``tokens_per_second``, ``step_time_seconds``, ``epoch``, ``progress``, plus evaluator metrics on
  evaluation steps. ``metrics_loggers`` receive them only when committed: right before the checkpoint
  that covers them is recorded. On resume at step ``s`` each logger with a ``truncate_from(step)`` method
  is asked to forget steps ``>= s`` (a kill between flushing and recording leaves such rows), so a
  logger implementing it sees every step exactly once; one without it can at worst see the steps of
  that one interval twice, and only if the kill lands inside that flush. ``progress_logger`` gets
  metrics immediately (for a console or progress bar; it repeats the redone steps after a crash).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import tinker

from posttrain.checkpoints import CheckpointRecord, append_checkpoint, last_checkpoint, read_checkpoints, save_checkpoint
from posttrain.eval.base import EvalTarget, Evaluator, run_evaluators
from posttrain.metrics import MetricsLogger
from posttrain.schedules import learning_rate_at
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import (
    SupervisedData,
    apply_loss_reduction,
    as_supervised_data,
    batch_position,
    datum_weights,
    get_batch,
    planned_steps,
)

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
# Fields that decide which batch a step trains on; changing them under an existing log would
# silently repeat or skip data, so a resume with different values is refused.
_ORDER_FIELDS = ("base_model", "lora_rank", "batch_size", "seed", "shuffle", "loss_reduction")


@dataclass
class SupervisedResult:
    log_dir: str
    base_model: str
    total_steps: int
    start_step: int  # 0 for a fresh run, the resumed batch index otherwise
    final_checkpoint: CheckpointRecord
    checkpoints: list[CheckpointRecord]  # every record in checkpoints.jsonl, oldest first
    new_checkpoints: list[CheckpointRecord]  # the records this call wrote
    # Metrics of the last step, evaluations included (every record also keeps them in extra["metrics"]).
    final_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def state_path(self) -> str | None:
        return self.final_checkpoint.state_path

    @property
    def sampler_path(self) -> str | None:
        return self.final_checkpoint.sampler_path

    @property
    def resumed(self) -> bool:
        return self.start_step > 0


@dataclass
class _InFlight:
    step: int
    epoch: int
    learning_rate: float
    batch: list[tinker.Datum]
    forward_backward: Any
    optim_step: Any


class _MetricsBuffer:
    """Holds per-step metrics until they are committed to the loggers."""

    def __init__(self, loggers: Sequence[MetricsLogger], progress: MetricsLogger | None):
        self.loggers = list(loggers)
        self.progress = progress
        self.rows: dict[int, dict[str, float]] = {}

    def add(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.setdefault(step, {}).update(metrics)
        if self.progress is not None:
            self.progress.log_metrics(metrics, step)

    def commit(self) -> None:
        for step in sorted(self.rows):
            for metrics_logger in self.loggers:
                metrics_logger.log_metrics(self.rows[step], step)
        self.rows.clear()


def train_supervised(
    config: SupervisedConfig,
    data: SupervisedData | Sequence[tinker.Datum] | pa.Table,
    service_client: tinker.ServiceClient,
    *,
    evaluators: Sequence[Evaluator] = (),
    metrics_loggers: Sequence[MetricsLogger] = (),
    progress_logger: MetricsLogger | None = None,
    on_checkpoint: Callable[[CheckpointRecord], None] | None = None,
) -> SupervisedResult:
    """Train (or resume training) ``config`` on ``data``; see the module docstring for guarantees.

    ``data``: a list of ``tinker.Datum``, a rendered-token Arrow table (its ``split == "train"`` rows
    when it has a split column), or any ``SupervisedData``.
    """
    log_dir = Path(config.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    data = as_supervised_data(data)
    num_batches = len(data) // config.batch_size
    if num_batches <= 0:
        raise ValueError(
            f"{len(data)} training examples make no complete batch of batch_size={config.batch_size}: "
            "add examples or lower batch_size"
        )
    total_steps = planned_steps(num_batches, config.num_epochs, config.max_steps)
    _check_run_file(log_dir, config, num_batches)

    resume_from = last_checkpoint(log_dir)
    start_step = resume_from.batch if resume_from else 0
    if resume_from is not None and start_step >= total_steps:
        logger.info("%s: final checkpoint %s already covers %d steps", log_dir, resume_from.name, total_steps)
        return _result(config, total_steps, start_step, resume_from, [], dict(resume_from.extra.get("metrics", {})))

    for metrics_logger in metrics_loggers:
        if hasattr(metrics_logger, "truncate_from"):
            metrics_logger.truncate_from(start_step)
        metrics_logger.log_params({**config.flat_params(), "num_batches_per_epoch": num_batches, "total_steps": total_steps})

    training_client = _training_client(service_client, config, resume_from)
    run = _Run(config, log_dir, data, training_client, total_steps, num_batches, evaluators,
               _MetricsBuffer(metrics_loggers, progress_logger), on_checkpoint)
    for step in range(start_step, total_steps):
        run.step(step)
    run.drain()
    return _result(config, total_steps, start_step, run.new_checkpoints[-1], run.new_checkpoints, run.last_metrics)


def _training_client(
    service_client: tinker.ServiceClient, config: SupervisedConfig, resume_from: CheckpointRecord | None
) -> tinker.TrainingClient:
    if resume_from is None:
        return service_client.create_lora_training_client(
            base_model=config.base_model, rank=config.lora_rank, seed=config.seed
        ).result()
    logger.info("%s: resuming at step %d from %s", config.log_dir, resume_from.batch, resume_from.state_path)
    return service_client.create_training_client_from_state_with_optimizer(resume_from.state_path).result()


class _Run:
    """The state of one call: the step in flight, the metrics buffer, the checkpoints written."""

    def __init__(
        self,
        config: SupervisedConfig,
        log_dir: Path,
        data: SupervisedData,
        training_client: tinker.TrainingClient,
        total_steps: int,
        num_batches: int,
        evaluators: Sequence[Evaluator],
        buffer: _MetricsBuffer,
        on_checkpoint: Callable[[CheckpointRecord], None] | None,
    ):
        self.config, self.log_dir, self.data = config, log_dir, data
        self.training_client = training_client
        self.total_steps, self.num_batches = total_steps, num_batches
        self.evaluators, self.buffer, self.on_checkpoint = evaluators, buffer, on_checkpoint
        self.in_flight: _InFlight | None = None
        self.new_checkpoints: list[CheckpointRecord] = []
        self.last_metrics: dict[str, float] = {}
        self.last_finish = time.monotonic()

    def step(self, step: int) -> None:
        """Submit ``step``, then collect the previous one (pipelining); checkpoint/evaluate if due."""
        submitted = self.submit(step)
        self.drain()
        self.in_flight = submitted
        done = step + 1
        is_last = done == self.total_steps
        save_now = is_last or _due(done, self.config.save_every)
        eval_now = bool(self.evaluators) and (is_last or _due(done, self.config.eval_every))
        if save_now or eval_now:
            self.drain()
        if eval_now:
            eval_metrics = run_evaluators(self.evaluators, EvalTarget(training_client=self.training_client))
            self.buffer.add(step, eval_metrics)
            self.last_metrics.update(eval_metrics)
        if save_now:
            self.checkpoint(done, epoch=submitted.epoch, final=is_last)

    def submit(self, step: int) -> _InFlight:
        config = self.config
        position = batch_position(step, self.num_batches)
        batch = get_batch(self.data, config.batch_size, position.epoch, position.batch_index, config.seed, config.shuffle)
        batch = apply_loss_reduction(batch, config.loss_reduction)
        learning_rate = learning_rate_at(config.learning_rate, config.lr_schedule, step, self.total_steps, config.warmup_steps)
        return _InFlight(
            step=step,
            epoch=position.epoch,
            learning_rate=learning_rate,
            batch=batch,
            forward_backward=self.training_client.forward_backward(batch, "cross_entropy"),
            optim_step=self.training_client.optim_step(config.adam.params(learning_rate)),
        )

    def drain(self) -> None:
        """Await the step in flight (if any) and buffer its metrics."""
        if self.in_flight is None:
            return
        work, self.in_flight = self.in_flight, None
        metrics = _step_metrics(work, self.total_steps)
        now = time.monotonic()
        metrics["step_time_seconds"] = now - self.last_finish
        metrics["tokens_per_second"] = metrics["num_tokens"] / max(now - self.last_finish, 1e-9)
        self.last_finish = now
        self.buffer.add(work.step, metrics)
        self.last_metrics = dict(metrics)

    def checkpoint(self, done: int, epoch: int, final: bool) -> None:
        record = save_checkpoint(
            self.training_client,
            self.log_dir,
            name=f"{done:06d}",
            batch=done,
            epoch=epoch,
            final=final,
            extra={"base_model": self.config.base_model, "created_at": time.time(), "metrics": dict(self.last_metrics)},
            ttl_seconds=self.config.checkpoint_ttl_seconds,
            commit=False,
        )
        # Metrics first, record second: a kill in between leaves metrics of steps the resumed run
        # redoes, which JsonlMetricsLogger.truncate_from drops; the other order could lose steps.
        self.buffer.commit()
        append_checkpoint(self.log_dir, record)
        self.new_checkpoints.append(record)
        if self.on_checkpoint is not None:
            self.on_checkpoint(record)


def _due(done: int, every: int) -> bool:
    return every > 0 and done % every == 0


def _step_metrics(work: _InFlight, total_steps: int) -> dict[str, float]:
    output = work.forward_backward.result()
    work.optim_step.result()
    nll_sum, trained_tokens = 0.0, 0
    for datum, loss_output in zip(work.batch, output.loss_fn_outputs):
        logprobs = np.asarray(loss_output["logprobs"].to_numpy(), dtype=np.float64).reshape(-1)
        trained = datum_weights(datum) > 0
        nll_sum -= float(logprobs[trained].sum())
        trained_tokens += int(trained.sum())
    return {
        "loss": nll_sum / max(trained_tokens, 1),
        "loss_sum": float(output.metrics.get("loss:sum", float("nan"))),
        "learning_rate": work.learning_rate,
        "num_sequences": float(len(work.batch)),
        "num_tokens": float(sum(datum.model_input.length for datum in work.batch)),
        "num_trained_tokens": float(trained_tokens),
        "epoch": float(work.epoch),
        "progress": (work.step + 1) / total_steps,
    }


def _check_run_file(log_dir: Path, config: SupervisedConfig, num_batches: int) -> None:
    """Write ``run.json`` on the first run; on later runs refuse changes that alter the batch order."""
    path = log_dir / RUN_FILE
    current = {name: getattr(config, name) for name in _ORDER_FIELDS} | {"num_batches_per_epoch": num_batches}
    if path.exists():
        previous = json.loads(path.read_text())
        changed = {key: (previous.get(key), value) for key, value in current.items() if previous.get(key) != value}
        if changed and read_checkpoints(log_dir):
            details = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items())
            raise ValueError(
                f"{log_dir} holds checkpoints of a run with different data order or model ({details}); "
                "resume with the same settings or choose a new log_dir"
            )
    temporary = path.with_name(RUN_FILE + ".tmp")
    temporary.write_text(json.dumps(current, indent=2))
    os.replace(temporary, path)


def _result(
    config: SupervisedConfig,
    total_steps: int,
    start_step: int,
    final: CheckpointRecord,
    new_checkpoints: list[CheckpointRecord],
    final_metrics: dict[str, float],
) -> SupervisedResult:
    return SupervisedResult(
        log_dir=str(config.log_dir),
        base_model=config.base_model,
        total_steps=total_steps,
        start_step=start_step,
        final_checkpoint=final,
        checkpoints=read_checkpoints(config.log_dir),
        new_checkpoints=new_checkpoints,
        final_metrics=final_metrics,
    )
