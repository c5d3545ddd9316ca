"""An :class:`RLDataset` over a list of problems (an ``rl_problems`` table, or generated ones).

Each row is played by the env its scorer names (``posttrain.rl.envs.instances.group_builder``): a
single-turn problem, or a multi-turn game such as guess-the-number.

Batch k holds ``groups_per_batch`` problems, each a group of ``group_size`` envs. Problems are visited
in a seeded shuffle, reshuffled each epoch; ``get_batch(k)`` depends only on (problems, seed, k), so a
resumed run trains step k on exactly the problems it would have.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import pyarrow as pa

from posttrain.completers import ChatRenderer
from posttrain.datasets.problems import RLProblem, rl_problems_from_table
from posttrain.datasets.schemas import RL_PROBLEMS, TRAIN_SPLIT, validate_table
from posttrain.rl.envs.instances import group_builder
from posttrain.rl.envs.problem_env import DEFAULT_FORMAT_COEF
from posttrain.rl.types import EnvGroupBuilder, RLDataset


class ProblemDataset(RLDataset):
    def __init__(
        self,
        problems: Sequence[RLProblem],
        renderer: ChatRenderer,
        *,
        group_size: int,
        groups_per_batch: int,
        seed: int = 0,
        num_epochs: int = 1,
        format_coef: float = DEFAULT_FORMAT_COEF,
        system: str | None = None,
    ):
        if not problems:
            raise ValueError("ProblemDataset got no problems: check the table's split and limit")
        if group_size < 1 or groups_per_batch < 1 or num_epochs < 1:
            raise ValueError(
                f"group_size ({group_size}), groups_per_batch ({groups_per_batch}) and num_epochs ({num_epochs}) must be >= 1"
            )
        if groups_per_batch > len(problems):
            raise ValueError(f"groups_per_batch={groups_per_batch} exceeds the {len(problems)} problems; lower it or add problems")
        self.problems = list(problems)
        self.renderer = renderer
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.seed = seed
        self.num_epochs = num_epochs
        self.format_coef = format_coef
        self.system = system
        self.batches_per_epoch = len(self.problems) // groups_per_batch

    def __len__(self) -> int:
        return self.batches_per_epoch * self.num_epochs

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside this dataset's {len(self)} batches")
        chosen = batch_indices(len(self.problems), self.groups_per_batch, self.seed, index)
        return [
            group_builder(self.problems[i], self.renderer, self.group_size, format_coef=self.format_coef, system=self.system)
            for i in chosen
        ]

    def identity(self) -> dict[str, object]:
        digest = hashlib.sha256("\n".join(p.row_id for p in self.problems).encode()).hexdigest()[:16]
        return {
            "dataset": type(self).__name__,
            "problems_digest": digest,
            "num_problems": len(self.problems),
            "group_size": self.group_size,
            "groups_per_batch": self.groups_per_batch,
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "format_coef": self.format_coef,
        }


def batch_indices(num_problems: int, groups_per_batch: int, seed: int, index: int) -> list[int]:
    """Which problems batch ``index`` holds: a seeded shuffle per epoch, cut into whole batches."""
    epoch, position = divmod(index, num_problems // groups_per_batch)
    order = list(range(num_problems))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order[position * groups_per_batch : (position + 1) * groups_per_batch]


def problems_from_rl_table(table: pa.Table, split: str | None = TRAIN_SPLIT) -> list[RLProblem]:
    """The problems of an ``rl_problems`` table (checked against the schema), one split by default."""
    validate_table(table, RL_PROBLEMS)
    return rl_problems_from_table(table, split)
