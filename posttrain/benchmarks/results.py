"""An inspect eval log read back as one benchmark result: metric ± s.e., n, and a score per sample.

inspect reports its own metrics; ours are recomputed from the per-sample scores with
``posttrain.eval.stats`` so every number in a report, the leaderboard and MLflow carries n and a
standard error computed one way (inspect's own figures are kept beside them, and agree for
accuracy). A sample scored in several epochs counts once, at its mean over epochs, so n is the
number of distinct samples. Scores that are dicts (IFEval's four levels) are read at the benchmark's
headline key.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from inspect_ai.log import EvalLog
from inspect_ai.scorer import value_to_float

from posttrain.eval.stats import mean_estimate

_TO_FLOAT = value_to_float()


class BenchmarkRunError(RuntimeError):
    """The eval did not finish cleanly (an error, a cancellation, or no sample scored)."""


@dataclass(frozen=True)
class BenchmarkResult:
    task: str
    model: str
    metric: str
    value: float
    stderr: float
    n: int
    log_path: str
    samples: list[dict[str, Any]] = field(default_factory=list)  # sample_id, epoch, score, answer, target, completion
    inspect_metrics: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The one-line JSON form the CLI prints and the assets record."""
        return {
            "task": self.task,
            "model": self.model,
            "metric": self.metric,
            "value": self.value,
            "stderr": None if math.isnan(self.stderr) else self.stderr,
            "n": self.n,
            "log": self.log_path,
        }


def check_succeeded(task: str, log: EvalLog) -> None:
    """Raises :class:`BenchmarkRunError` with inspect's error unless the eval finished and scored samples."""
    if log.status != "success":
        detail = log.error.message if log.error is not None else log.status
        raise BenchmarkRunError(f"benchmark {task!r} on {log.eval.model}: the inspect eval ended {log.status!r}: {detail}")
    if not log.samples:
        raise BenchmarkRunError(f"benchmark {task!r} on {log.eval.model}: no sample was scored; check --limit and the dataset")


def read_result(task: str, log: EvalLog, score_key: str | None = None) -> BenchmarkResult:
    """``log`` (with its samples) as a :class:`BenchmarkResult`; raises when the run did not succeed."""
    check_succeeded(task, log)
    rows = [_sample_row(sample, score_key) for sample in log.samples]
    per_sample: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        per_sample[row["sample_id"]].append(row["score"])
    estimate = mean_estimate([sum(values) / len(values) for values in per_sample.values()])
    return BenchmarkResult(
        task=task,
        model=str(log.eval.model),
        metric=score_key or _metric_name(log),
        value=estimate.value,
        stderr=estimate.stderr,
        n=estimate.n,
        log_path=str(log.location),
        samples=rows,
        inspect_metrics=_inspect_metrics(log),
    )


def _sample_row(sample: Any, score_key: str | None) -> dict[str, Any]:
    if not sample.scores:
        raise BenchmarkRunError(f"sample {sample.id!r} (epoch {sample.epoch}) has no score; its error: {sample.error}")
    score = next(iter(sample.scores.values()))
    value = score.value
    if isinstance(value, dict):
        if score_key is None or score_key not in value:
            raise BenchmarkRunError(f"sample {sample.id!r} scores {sorted(value)}; the benchmark must name which one is its metric")
        value = value[score_key]
    return {
        "sample_id": str(sample.id),
        "epoch": int(sample.epoch),
        "score": float(_TO_FLOAT(value)),
        "answer": None if score.answer is None else str(score.answer),
        "target": sample.target if isinstance(sample.target, str) else "\n".join(sample.target),
        "completion": sample.output.completion if sample.output is not None else "",
    }


def _metric_name(log: EvalLog) -> str:
    scores = log.results.scores if log.results else []
    names = list(scores[0].metrics) if scores else []
    return "accuracy" if "accuracy" in names else "mean"


def _inspect_metrics(log: EvalLog) -> dict[str, float]:
    found: dict[str, float] = {}
    for score in log.results.scores if log.results else []:
        for name, metric in score.metrics.items():
            found[f"{score.name}/{name}"] = float(metric.value)
    return found
