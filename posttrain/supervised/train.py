"""Plain-script entry point: ``python -m posttrain.supervised.train --config JSON``.

``JSON`` is a file path or an inline JSON object. Its keys are the :class:`SupervisedConfig` fields
plus:

- ``train_data`` (required): a parquet file of rendered tokens (``posttrain.datasets.schemas.RENDERED_TOKENS``);
- ``train_split`` (default ``"train"``; null = every row) and ``eval_split`` (default ``"heldout"``):
  rows of ``train_data`` to train on, and to report held-out NLL/bpb on at each evaluation (skipped when
  no row has that split, or ``eval_split`` is null);
- ``eval_problems`` (optional): a parquet file of RL problems (``RL_PROBLEMS`` schema); its
  ``eval_split`` rows (at most ``eval_problem_limit``, default 32) are answered greedily at each evaluation
  (``accuracy_max_tokens``, default 32) with the renderer ``renderer`` (default ``"chatml"``) and graded;
- ``base_url`` (default: the SDK's ``TINKER_BASE_URL``). The API key comes from ``TINKER_API_KEY``.

Metrics go to ``<log_dir>/metrics.jsonl`` (exactly once per step, also across resumes) and to stderr.
The last stdout line is a JSON summary of the :class:`SupervisedResult`. Re-running the same command
resumes from the last checkpoint in ``<log_dir>/checkpoints.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.eval import AccuracyEvaluator, Evaluator, NllEvaluator, problems_from_table
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import RenderedTokens
from posttrain.supervised.recipe import SupervisedRecipe
from posttrain.training.script import run_script

_SCRIPT_KEYS = (
    "train_data", "train_split", "eval_split", "eval_problems", "eval_problem_limit", "accuracy_max_tokens",
    "renderer", "base_url",
)


def load_config_argument(text: str) -> dict[str, Any]:
    """Parse ``--config``: inline JSON when it starts with ``{``, else a path to a JSON file."""
    if text.lstrip().startswith("{"):
        return json.loads(text)
    path = Path(text)
    if not path.is_file():
        raise SystemExit(f"--config {text!r}: neither inline JSON nor an existing file")
    return json.loads(path.read_text())


def build_evaluators(table: pa.Table, script: dict[str, Any]) -> list[Evaluator]:
    """Held-out NLL/bpb on the ``eval_split`` rows, and task accuracy when ``eval_problems`` is given."""
    eval_split = script.get("eval_split", HELDOUT_SPLIT)
    if eval_split is None:
        return []
    evaluators: list[Evaluator] = []
    heldout = RenderedTokens(table, split=eval_split)
    if len(heldout):
        evaluators.append(NllEvaluator(heldout.all_data()))
    if script.get("eval_problems"):
        problems = problems_from_table(
            pq.read_table(script["eval_problems"]), split=eval_split, limit=script.get("eval_problem_limit", 32)
        )
        evaluators.append(
            AccuracyEvaluator(
                script.get("renderer", "chatml"), problems, max_tokens=script.get("accuracy_max_tokens", 32)
            )
        )
    return evaluators


def run(values: dict[str, Any]) -> dict[str, Any]:
    script = {key: values.pop(key) for key in _SCRIPT_KEYS if key in values}
    if "train_data" not in script:
        raise SystemExit("--config needs 'train_data': a parquet file of rendered tokens")
    config = SupervisedConfig.from_dict(values)
    table = pq.read_table(script["train_data"])
    train_data = RenderedTokens(table, split=script.get("train_split", TRAIN_SPLIT))
    evaluators = build_evaluators(table, script)
    recipe = SupervisedRecipe(config, train_data)
    return run_script(
        config.training, recipe, base_url=script.get("base_url"), evaluators=evaluators,
        progress_keys=("loss", "learning_rate", "tokens_per_second"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.supervised.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="inline JSON object or path to a JSON file")
    args = parser.parse_args(argv)
    summary = run(load_config_argument(args.config))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
