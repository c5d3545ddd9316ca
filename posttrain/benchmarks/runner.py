"""One benchmark on one model: ``run_benchmark(task, target, log_dir)`` -> :class:`BenchmarkResult`.

The asset, the CLI and the bench all call this. The model is ``tinker/<base model | sampler path>``
through our provider; the inspect log lands in ``log_dir`` (``inspect view --log-dir <log_dir>``
shows it) only when the eval succeeded: inspect writes into a staging folder beside it, which a
failed or interrupted run leaves nothing of.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.benchmarks.results import BenchmarkResult, BenchmarkRunError, check_succeeded, read_result
from posttrain.benchmarks.tasks import resolve_task

DEFAULT_MAX_CONNECTIONS = 64
SCORE_KEYS = {"ifeval": "prompt_level_strict"}  # benchmarks whose per-sample score is a dict


@dataclass(frozen=True)
class ModelTarget:
    """What to sample: a base model name or a ``tinker://`` sampler path, on an endpoint, with a renderer.

    ``api_key`` is passed to the provider, never into inspect's logged model args."""

    model: str
    renderer: str
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    tokenizer: str | None = None

    def inspect_model(self, max_connections: int) -> Any:
        import posttrain.benchmarks.provider  # noqa: F401  (registers tinker/ with inspect)
        from inspect_ai.model import get_model

        args: dict[str, Any] = {"renderer": self.renderer, "max_connections": max_connections}
        if self.tokenizer:
            args["tokenizer"] = self.tokenizer
        return get_model(f"tinker/{self.model}", base_url=self.base_url, api_key=self.api_key, memoize=False, **args)


def run_benchmark(
    task: str,
    target: ModelTarget,
    log_dir: Path,
    *,
    limit: int | None = None,
    task_args: Mapping[str, Any] | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> BenchmarkResult:
    """Run ``task`` (a benchmark name, inspect_evals task or task file) on ``target``; raises on a bad
    task, a missing dataset or a failed eval, leaving no log behind."""
    from inspect_ai import eval as inspect_eval
    from inspect_ai._util.error import PrerequisiteError
    from inspect_ai.log import read_eval_log

    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be a positive number of samples, got {limit}")
    resolved = resolve_task(task, task_args)
    model = target.inspect_model(max_connections)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=log_dir))
    try:
        try:
            logs = inspect_eval(
                resolved.task,
                model=model,
                log_dir=str(staging),
                limit=limit,
                display="none",
                log_format="eval",
                max_connections=max_connections,
                max_samples=max_connections,
                max_subprocesses=4,
                fail_on_error=True,
                score_display=False,
            )
        except PrerequisiteError as error:  # inspect's own check of the task (e.g. duplicate sample ids)
            raise BenchmarkRunError(f"benchmark {task!r}: {error}") from error
        if not logs:
            raise BenchmarkRunError(f"benchmark {task!r}: inspect returned no log")
        check_succeeded(resolved.name, logs[0])
        staged = Path(logs[0].location)
        final = log_dir / staged.name
        staged.replace(final)
        return read_result(resolved.name, read_eval_log(str(final)), SCORE_KEYS.get(resolved.name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        model.api.close()  # ends the provider's Tinker session
