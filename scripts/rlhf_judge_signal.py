"""How much signal an RLHF run's judge gave, read back from its rollout table: on every judged pair of one right
and one wrong sample of a group (by the prompt's verifier, logged as ``correct``, never rewarded), how often the
right one won, its mean win probability, and the mean advantage of right and of wrong samples in mixed groups.
A verifier as the reward would score 1 and 1. (New runs log the first two per step as
``env/judge_verifier_agreement`` and ``env/judge_p_right``, averaged per group.)

    .venv/bin/python scripts/rlhf_judge_signal.py $POSTTRAIN_STATE_DIR/parquet/rlhf_rollout_batches.versions/*.parquet
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posttrain.preference.preference_model import verdict_correct  # noqa: E402


def main(paths: list[str]) -> int:
    for path in paths:
        groups: dict[tuple, dict[int, dict]] = {}
        for row in pq.read_table(path).to_pylist():
            groups.setdefault((row["training_run_id"], int(row["step"]), str(row["group"])), {})[int(row["sample"])] = row
        wins, probabilities, advantages = [], [], {1.0: [], 0.0: []}
        for samples in groups.values():
            graded = {i: float(s["correct"]) for i, s in samples.items() if s["correct"] is not None}
            if len(set(graded.values())) < 2:
                continue
            for i, sample in samples.items():
                advantages[graded[i]].append(float(sample["advantage"]))
                if graded[i] != 1.0:
                    continue
                for score in json.loads(sample["pairwise_scores"]):
                    if graded.get(score["opponent"]) == 0.0:
                        wins.append(verdict_correct(score["win"]))
                        probabilities.append(score["win"])
        if not wins:
            print(f"{path}: no pair of a right and a wrong answer")
            continue
        n = len(wins)
        print(f"{path}: {len(groups)} groups; right-vs-wrong pairs {n}: right wins {np.mean(wins):.3f} ± "
              f"{np.std(wins, ddof=1) / np.sqrt(n):.3f}, mean P(right wins) {np.mean(probabilities):.3f}; mean advantage "
              f"right {np.mean(advantages[1.0]):+.4f}, wrong {np.mean(advantages[0.0]):+.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
