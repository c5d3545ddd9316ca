"""The training core every recipe runs on: one resumable, pipelined loop over a :class:`Recipe`.

``train(config, recipe, service_client)`` trains (or resumes) a run and returns a
:class:`TrainingResult`. What it guarantees, for SFT, DPO, RL and distillation alike:

- Training client: a fresh LoRA on ``config.base_model``; or the weights of ``config.init_from`` (a
  ``tinker://`` state: chaining, Adam starts fresh); or, when ``<log_dir>/checkpoints.jsonl`` has a
  record, that record's state *with its Adam moments* (exact resume after SIGKILL at any moment).
- Learning rate: ``learning_rate_at(step)`` (``posttrain.schedules``) in each step's AdamParams.
- Pipelining: step ``s+1`` is submitted before step ``s``'s results are awaited, so the server never
  idles while the client computes metrics; the pipeline is drained before a checkpoint or evaluation,
  so those see exactly the weights after step ``s``.
- Checkpoints every ``save_every`` steps and after the last (``final``): state + sampler weights, then
  (only after both returned) a durable record ``{name, batch, epoch?, final?, state_path, sampler_path,
  recipe, metrics}`` in ``checkpoints.jsonl``, then ``on_checkpoint(record)``.
- Commit: metrics go to ``metrics_loggers`` and rows (e.g. RL samples) to ``row_sinks`` only right
  before the checkpoint that covers them is recorded. On resume at step ``s`` every logger/sink with
  ``truncate_from`` forgets steps ``>= s``, so each sees every step exactly once whatever the moment of
  a kill. ``progress_logger`` gets metrics immediately (it repeats redone steps after a crash).
- ``<log_dir>/run.json`` records what fixes step ``k``'s data and learning rate (model, LoRA rank,
  ``init_from``, LR schedule, warm-up, Adam, total steps, seed, the recipe's identity): a resume that
  would change any of them is refused with :class:`ResumeMismatchError` naming the differences.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import tinker

from posttrain.atomic_files import write_text_atomically
from posttrain.checkpoints import CheckpointRecord, append_checkpoint, last_checkpoint, read_checkpoints, save_checkpoint
from posttrain.eval.base import EvalTarget, Evaluator, run_evaluators
from posttrain.metrics import MetricsLogger
from posttrain.schedules import learning_rate_at
from posttrain.training.config import TrainingConfig
from posttrain.training.recipe import PendingStep, Recipe, RowSink

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"


class ResumeMismatchError(ValueError):
    """A log directory holds checkpoints of a run whose schedule or data order differs from this one."""


@dataclass
class TrainingResult:
    log_dir: str
    base_model: str
    recipe: str
    total_steps: int
    start_step: int  # 0 for a fresh run, the resumed step otherwise
    final_checkpoint: CheckpointRecord
    checkpoints: list[CheckpointRecord]  # every record in checkpoints.jsonl, oldest first
    new_checkpoints: list[CheckpointRecord]  # the records this call wrote
    final_metrics: dict[str, float] = field(default_factory=dict)  # last step's, evaluations included

    @property
    def state_path(self) -> str | None:
        return self.final_checkpoint.state_path

    @property
    def sampler_path(self) -> str | None:
        return self.final_checkpoint.sampler_path

    @property
    def resumed(self) -> bool:
        return self.start_step > 0


def planned_total_steps(recipe: Recipe, max_steps: int | None) -> int:
    available = recipe.num_steps()
    if available <= 0:
        raise ValueError(f"recipe {recipe.name!r} has no step to train (its data makes 0 batches): add data or lower the batch size")
    return min(available, max_steps) if max_steps else available


def train(
    config: TrainingConfig,
    recipe: Recipe,
    service_client: tinker.ServiceClient,
    *,
    evaluators: Sequence[Evaluator] = (),
    metrics_loggers: Sequence[MetricsLogger] = (),
    row_sinks: Sequence[RowSink] = (),
    progress_logger: MetricsLogger | None = None,
    on_checkpoint: Callable[[CheckpointRecord], None] | None = None,
) -> TrainingResult:
    """Train (or resume) ``recipe`` under ``config``; see the module docstring for guarantees."""
    problems = config.problems()
    if problems:
        raise ValueError(f"invalid training config for {recipe.name}: " + "; ".join(problems))
    log_dir = Path(config.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    total_steps = planned_total_steps(recipe, config.max_steps)
    if config.warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps={config.warmup_steps} must be smaller than the {total_steps} planned steps")
    check_run_file(log_dir, run_identity(config, recipe, total_steps))

    resume_from = last_checkpoint(log_dir)
    start_step = resume_from.batch if resume_from else 0
    if resume_from is not None and start_step >= total_steps:
        logger.info("%s: final checkpoint %s already covers %d steps", log_dir, resume_from.name, total_steps)
        return _result(config, recipe, total_steps, start_step, resume_from, [], dict(resume_from.extra.get("metrics", {})))

    for sink in [*metrics_loggers, *row_sinks]:
        if hasattr(sink, "truncate_from"):
            sink.truncate_from(start_step)
    for metrics_logger in metrics_loggers:
        metrics_logger.log_params({**_flat_identity(recipe), **config.flat_params(), "recipe": recipe.name, "total_steps": total_steps})

    training_client = create_training_client(service_client, config, resume_from)
    recipe.start(training_client, service_client, start_step)
    loop = _Loop(config, recipe, log_dir, training_client, total_steps, evaluators,
                 _CommitBuffer(metrics_loggers, row_sinks, progress_logger), on_checkpoint)
    try:
        for step in range(start_step, total_steps):
            loop.step(step)
        loop.drain()
    finally:
        recipe.close()
    return _result(config, recipe, total_steps, start_step, loop.new_checkpoints[-1], loop.new_checkpoints, loop.last_metrics)


def create_training_client(
    service_client: tinker.ServiceClient, config: TrainingConfig, resume_from: CheckpointRecord | None
) -> tinker.TrainingClient:
    """Resume (weights + Adam), start from ``init_from`` (weights), or a fresh LoRA on the base model."""
    if resume_from is not None:
        logger.info("%s: resuming at step %d from %s", config.log_dir, resume_from.batch, resume_from.state_path)
        return service_client.create_training_client_from_state_with_optimizer(resume_from.state_path).result()
    if config.init_from:
        logger.info("%s: starting from the weights of %s", config.log_dir, config.init_from)
        return service_client.create_training_client_from_state(config.init_from).result()
    return service_client.create_lora_training_client(
        base_model=config.base_model, rank=config.lora_rank, seed=config.seed
    ).result()


@dataclass
class _InFlight:
    step: int
    learning_rate: float
    pending: PendingStep


class _CommitBuffer:
    """Holds per-step metrics and rows until the checkpoint covering them is recorded."""

    def __init__(self, loggers: Sequence[MetricsLogger], sinks: Sequence[RowSink], progress: MetricsLogger | None):
        self.loggers, self.sinks, self.progress = list(loggers), list(sinks), progress
        self.metrics: dict[int, dict[str, float]] = {}
        self.rows: dict[int, list[dict[str, Any]]] = {}

    def add(self, step: int, metrics: dict[str, float], rows: Sequence[dict[str, Any]] = ()) -> None:
        self.metrics.setdefault(step, {}).update(metrics)
        if rows:
            self.rows.setdefault(step, []).extend(rows)
        if self.progress is not None:
            self.progress.log_metrics(metrics, step)

    def commit(self) -> None:
        for step in sorted(self.rows):
            for sink in self.sinks:
                sink.write_rows(step, self.rows[step])
        for step in sorted(self.metrics):
            for metrics_logger in self.loggers:
                metrics_logger.log_metrics(self.metrics[step], step)
        self.metrics.clear()
        self.rows.clear()


class _Loop:
    """The state of one ``train`` call: the step in flight, the commit buffer, the checkpoints written."""

    def __init__(self, config, recipe, log_dir, training_client, total_steps, evaluators, buffer, on_checkpoint):
        self.config: TrainingConfig = config
        self.recipe: Recipe = recipe
        self.log_dir: Path = log_dir
        self.training_client: tinker.TrainingClient = training_client
        self.total_steps: int = total_steps
        self.evaluators: Sequence[Evaluator] = evaluators
        self.buffer: _CommitBuffer = buffer
        self.on_checkpoint = on_checkpoint
        self.in_flight: _InFlight | None = None
        self.new_checkpoints: list[CheckpointRecord] = []
        self.last_metrics: dict[str, float] = {}
        self.last_finish = time.monotonic()

    def step(self, step: int) -> None:
        """Submit ``step``, then collect the previous one (pipelining); checkpoint/evaluate if due."""
        config = self.config
        learning_rate = learning_rate_at(config.learning_rate, config.lr_schedule, step, self.total_steps, config.warmup_steps)
        submitted = _InFlight(step, learning_rate, self.recipe.submit_step(step, self.training_client, config.adam.params(learning_rate)))
        self.drain()
        self.in_flight = submitted
        done = step + 1
        is_last = done == self.total_steps
        save_now = is_last or _due(done, config.save_every)
        eval_now = bool(self.evaluators) and (is_last or _due(done, config.eval_every))
        if save_now or eval_now:
            self.drain()
        if eval_now:
            eval_metrics = run_evaluators(list(self.evaluators), EvalTarget(training_client=self.training_client))
            self.buffer.add(step, eval_metrics)
            self.last_metrics.update(eval_metrics)
        if save_now:
            self.checkpoint(done, final=is_last)

    def drain(self) -> None:
        """Await the step in flight (if any) and buffer its metrics and rows."""
        if self.in_flight is None:
            return
        work, self.in_flight = self.in_flight, None
        outcome = work.pending.result()
        now = time.monotonic()
        metrics = {
            **outcome.metrics,
            "learning_rate": work.learning_rate,
            "step_time_seconds": now - self.last_finish,
            "progress": (work.step + 1) / self.total_steps,
        }
        if "num_tokens" in metrics:
            metrics["tokens_per_second"] = metrics["num_tokens"] / max(metrics["step_time_seconds"], 1e-9)
        self.last_finish = now
        self.buffer.add(work.step, metrics, outcome.rows)
        self.last_metrics = dict(metrics)

    def checkpoint(self, done: int, final: bool) -> None:
        epoch = self.last_metrics.get("epoch")
        record = save_checkpoint(
            self.training_client,
            self.log_dir,
            name=f"{done:06d}",
            batch=done,
            epoch=None if epoch is None else int(epoch),
            final=final,
            extra={
                "recipe": self.recipe.name,
                "base_model": self.config.base_model,
                "init_from": self.config.init_from,
                "created_at": time.time(),
                "metrics": dict(self.last_metrics),
            },
            ttl_seconds=self.config.checkpoint_ttl_seconds,
            commit=False,
        )
        # Commit first, record second: a kill in between leaves metrics/rows of steps the resumed run
        # redoes, which truncate_from drops; the other order could lose steps.
        self.buffer.commit()
        append_checkpoint(self.log_dir, record)
        self.new_checkpoints.append(record)
        if self.on_checkpoint is not None:
            self.on_checkpoint(record)


def _due(done: int, every: int) -> bool:
    return every > 0 and done % every == 0


def run_identity(config: TrainingConfig, recipe: Recipe, total_steps: int) -> dict[str, Any]:
    """What fixes step ``k``'s data and learning rate; ``run.json`` holds it."""
    return {
        "recipe": recipe.name,
        "base_model": config.base_model,
        "lora_rank": config.lora_rank,
        "init_from": config.init_from,
        "learning_rate": config.learning_rate,
        "lr_schedule": config.lr_schedule,
        "warmup_steps": config.warmup_steps,
        "adam": asdict(config.adam),
        "seed": config.seed,
        "total_steps": total_steps,
        "recipe_identity": _jsonable(recipe.identity()),
    }


def check_run_file(log_dir: Path, identity: dict[str, Any]) -> None:
    """Write ``run.json`` on the first run; on a resume refuse any change to what fixes the run."""
    path = log_dir / RUN_FILE
    if path.exists() and read_checkpoints(log_dir):
        previous = json.loads(path.read_text())
        changed = {key: (previous.get(key), value) for key, value in identity.items() if previous.get(key) != value}
        if changed:
            details = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items())
            raise ResumeMismatchError(
                f"{log_dir} holds checkpoints of a run with a different schedule, model or data order ({details}); "
                "resume with the same settings, or start a new run (a new log_dir / a new Dagster run)"
            )
    write_text_atomically(path, json.dumps(identity, indent=2, sort_keys=True))


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _flat_identity(recipe: Recipe) -> dict[str, Any]:
    """The recipe's scalar identity values (batch size, β, group size ...) as params."""
    return {key: value for key, value in _jsonable(recipe.identity()).items() if not isinstance(value, (dict, list))}


def _result(config, recipe, total_steps, start_step, final, new_checkpoints, final_metrics) -> TrainingResult:
    return TrainingResult(
        log_dir=str(config.log_dir),
        base_model=config.base_model,
        recipe=recipe.name,
        total_steps=total_steps,
        start_step=start_step,
        final_checkpoint=final,
        checkpoints=read_checkpoints(config.log_dir),
        new_checkpoints=new_checkpoints,
        final_metrics=final_metrics,
    )
