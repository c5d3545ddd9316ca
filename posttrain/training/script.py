"""Running a recipe from a plain script (``python -m posttrain.<recipe>.train --config JSON``).

Every recipe's CLI does the same around the core: open a ``tinker.ServiceClient`` (``TINKER_BASE_URL`` /
``TINKER_API_KEY`` or an explicit ``base_url``), train with metrics in ``<log_dir>/metrics.jsonl`` (exactly
once per step, also across resumes) and a console progress line, close the session with its real status
(``success``, ``errored`` or ``interrupted``), and print a JSON summary. Re-running the same command resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import tinker

from posttrain.eval.base import Evaluator
from posttrain.metrics import METRICS_FILE, ConsoleMetricsLogger, JsonlMetricsLogger
from posttrain.training.config import TrainingConfig
from posttrain.training.core import train
from posttrain.training.recipe import Recipe


def run_script(
    config: TrainingConfig,
    recipe: Recipe,
    *,
    base_url: str | None,
    evaluators: Sequence[Evaluator] = (),
    progress_keys: tuple[str, ...] = ("loss", "learning_rate"),
) -> dict[str, Any]:
    """Train ``recipe`` under ``config`` through a fresh ServiceClient; returns the run's JSON summary."""
    service_client = tinker.ServiceClient(base_url=base_url)
    status = "errored"
    try:
        result = train(
            config,
            recipe,
            service_client,
            evaluators=evaluators,
            metrics_loggers=[JsonlMetricsLogger(Path(config.log_dir) / METRICS_FILE)],
            progress_logger=ConsoleMetricsLogger(keys=progress_keys),
        )
        status = "success"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        service_client.close(status).result(timeout=60)
    return {
        "log_dir": result.log_dir,
        "total_steps": result.total_steps,
        "start_step": result.start_step,
        "state_path": result.state_path,
        "sampler_path": result.sampler_path,
        "checkpoints": [record.name for record in result.checkpoints],
        "final_metrics": result.final_metrics,
    }
