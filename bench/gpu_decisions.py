"""Which GPU defaults one ``scripts/gpu_check.sh`` run supports: for each opt-in (or default-on) path, the two
figures the bench measured side by side, whether the GPU test that checks the path passed, and the verdict.

A device session is one call of a few minutes, and its report is read afterwards by someone deciding what to
flip; this prints that decision from the run's own files instead of leaving it to be worked out by hand.

    python bench/gpu_decisions.py REPORT_DIR/bench_gpu.json REPORT_DIR/gpu_tests.txt
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import NamedTuple


class Decision(NamedTuple):
    """A path, whether it is on by default now, the GPU test it needs, and the bench's figure with the path
    (``with_path``) against the figure without it (``without``): larger is better for both."""

    name: str
    default_on: bool
    test: str
    with_path: str
    without: str


DECISIONS = (
    Decision("joined decode weights (LOCALTINKER_DECODE_JOINED)", True, "test_decode_graphs_agree_with_the_trainer",
             "1b.sample_ratio", "1b.sample_ratio_separate_a"),
    Decision("training pieces as CUDA graphs (LOCALTINKER_TRAIN_GRAPHS=1)", False,
             "test_training_pieces_replayed_as_cuda_graphs_train_as_without", "1b.sft_ratio_graphs", "1b.sft_ratio"),
    Decision("sdpa decode attention (LOCALTINKER_DECODE_ATTENTION=sdpa)", False,
             "test_decode_graphs_with_sdpa_attention_agree_with_the_trainer", "1b.sample_ratio_sdpa_attention",
             "1b.sample_ratio"),
)


def outcomes_of(text: str) -> dict[str, str]:
    """Each test's outcome from pytest's ``-v`` lines (``test_name PASSED``; parameters dropped)."""
    return {match[1]: match[2] for match in re.finditer(r"(test_\w+)(?:\[[^\]]*\])?\s+(PASSED|FAILED|ERROR|SKIPPED)",
                                                         text)}


def verdict(decision: Decision, figures: dict[str, object], outcomes: dict[str, str]) -> str:
    """One line: what to do with the default, and why."""
    outcome = outcomes.get(decision.test, "not run")
    with_path, without = figures.get(decision.with_path), figures.get(decision.without)
    measured = isinstance(with_path, float) and isinstance(without, float)
    figures_text = (f"{decision.with_path} {with_path:.3g} vs {decision.without} {without:.3g}" if measured
                    else f"{decision.with_path} or {decision.without} not measured")
    keep = "keep on" if decision.default_on else "keep off"
    if outcome in ("FAILED", "ERROR"):
        action = "turn off" if decision.default_on else keep
        return f"{decision.name}: {action} ({decision.test} {outcome}; {figures_text})"
    if outcome != "PASSED":
        return f"{decision.name}: no verdict, {keep} until its test runs ({decision.test} {outcome}; {figures_text})"
    if not measured:
        return f"{decision.name}: {keep} ({figures_text})"
    faster = with_path >= without if decision.default_on else with_path > without
    if decision.default_on:
        action = keep if faster else "turn off"
    else:
        action = "turn on" if faster else keep
    return f"{decision.name}: {action} ({decision.test} PASSED; {figures_text})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", type=Path, help="bench_gpu.py --json output")
    parser.add_argument("tests", type=Path, help="the GPU tests' -v lines")
    args = parser.parse_args()
    figures = json.loads(args.figures.read_text()) if args.figures.exists() else {}
    outcomes = outcomes_of(args.tests.read_text()) if args.tests.exists() else {}
    for decision in DECISIONS:
        print(verdict(decision, figures, outcomes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
