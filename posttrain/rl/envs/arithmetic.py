"""The cookbook's arithmetic env: "What is x + y?" with x, y uniform in [0, 100], graded by value.

Problems are generated from (seed, batch index), so there is no table and no end but ``num_batches``.
"""

from __future__ import annotations

import random

from posttrain.completers import ChatRenderer
from posttrain.datasets.problems import RLProblem
from posttrain.rl.envs.problem_env import DEFAULT_FORMAT_COEF, ProblemGroupBuilder
from posttrain.rl.types import EnvGroupBuilder, RLDataset

MAX_OPERAND = 100


def arithmetic_problem(rng: random.Random, label: str) -> RLProblem:
    x, y = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    return RLProblem(
        row_id=f"arithmetic/{label}/{x}+{y}",
        split="train",
        task="arithmetic",
        question=f"What is {x} + {y}?",
        answer=str(x + y),
        scorer="exact_number",
        scorer_metadata="{}",
    )


class ArithmeticDataset(RLDataset):
    def __init__(
        self,
        renderer: ChatRenderer,
        *,
        group_size: int,
        groups_per_batch: int,
        num_batches: int,
        seed: int = 0,
        format_coef: float = DEFAULT_FORMAT_COEF,
    ):
        if min(group_size, groups_per_batch, num_batches) < 1:
            raise ValueError(
                f"arithmetic: group_size ({group_size}), groups_per_batch ({groups_per_batch}) and num_batches ({num_batches}) must be >= 1"
            )
        self.renderer = renderer
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.num_batches = num_batches
        self.seed = seed
        self.format_coef = format_coef

    def __len__(self) -> int:
        return self.num_batches

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside this dataset's {len(self)} batches")
        rng = random.Random(f"arithmetic:{self.seed}:{index}")
        return [
            ProblemGroupBuilder(self.renderer, arithmetic_problem(rng, f"{index}.{g}"), self.group_size, self.format_coef)
            for g in range(self.groups_per_batch)
        ]

    def identity(self) -> dict[str, object]:
        return {
            "dataset": "arithmetic",
            "group_size": self.group_size,
            "groups_per_batch": self.groups_per_batch,
            "num_batches": self.num_batches,
            "seed": self.seed,
            "format_coef": self.format_coef,
        }
