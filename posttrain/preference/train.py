"""Plain-script entry point: ``python -m posttrain.preference.train --config JSON``.

``JSON`` is a file path or an inline JSON object with the :class:`DpoConfig` fields (``training`` a
nested object of ``TrainingConfig`` fields) plus:

- ``train_data`` (required): a parquet file of preference pairs (``schemas.PREFERENCE_PAIRS``); its
  ``train`` rows are trained on, its ``eval_split`` rows (default ``"heldout"``; null = none) give the
  held-out pair accuracy at each evaluation;
- ``reference`` (optional): a parquet file of reference logprobs (``REFERENCE_LOGPROBS``) covering
  those pairs, e.g. from an earlier run's ``reference_logprobs.parquet`` (a β sweep does not rescore);
- ``base_url`` (default: the SDK's ``TINKER_BASE_URL``). The API key comes from ``TINKER_API_KEY``.

Metrics go to ``<log_dir>/metrics.jsonl`` (exactly once per step, across resumes) and to stderr. The
last stdout line is a JSON summary. Re-running the same command resumes after the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import pyarrow.parquet as pq

from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.preference.data import PreferencePairs, pairs_from_table
from posttrain.preference.recipe import DpoConfig, DpoRecipe
from posttrain.supervised.train import load_config_argument
from posttrain.training.config import config_from_dict
from posttrain.training.script import run_script

_SCRIPT_KEYS = ("train_data", "eval_split", "reference", "base_url")


def build_recipe(config: DpoConfig, script: dict[str, Any]) -> DpoRecipe:
    if "train_data" not in script:
        raise SystemExit("--config needs 'train_data': a parquet file of preference pairs")
    table = pq.read_table(script["train_data"])
    eval_split = script.get("eval_split", HELDOUT_SPLIT)
    heldout = pairs_from_table(table, split=eval_split) if eval_split else []
    reference = pq.read_table(script["reference"]) if script.get("reference") else None
    return DpoRecipe(
        config, PreferencePairs.from_table(table, split=TRAIN_SPLIT), reference=reference,
        heldout=PreferencePairs(heldout) if heldout else None,
    )


def run(values: dict[str, Any]) -> dict[str, Any]:
    script = {key: values.pop(key) for key in _SCRIPT_KEYS if key in values}
    config = config_from_dict(DpoConfig, values)
    recipe = build_recipe(config, script)
    evaluators = [recipe.heldout_evaluator()] if recipe.heldout is not None else []
    return run_script(
        config.training, recipe, base_url=script.get("base_url"), evaluators=evaluators,
        progress_keys=("dpo_loss", "accuracy", "margin", "learning_rate"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.preference.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="inline JSON object or path to a JSON file")
    args = parser.parse_args(argv)
    print(json.dumps(run(load_config_argument(args.config))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
