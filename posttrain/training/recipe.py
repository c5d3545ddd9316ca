"""What a recipe gives the training core: how one step's batch is built and submitted, and what it reports.

The core (:func:`posttrain.training.core.train`) owns everything recipes share: the training client
(fresh, ``init_from`` a checkpoint, or resumed with its Adam state), the LR schedule, pipelining,
checkpoints and their log, exact resume, metric and row commits, evaluation cadence, ``max_steps``
and progress. A recipe owns only its data and its loss:

- :meth:`Recipe.num_steps` — how many optimizer steps its data supports (the core caps it with
  ``max_steps``);
- :meth:`Recipe.identity` — JSON values that fix what step ``k`` trains on (data digest, batch size,
  β ...): a resume with different values is refused, because it would silently repeat or skip data;
- :meth:`Recipe.start` — called once with the training client before the first step of this call
  (a DPO recipe snapshots its reference here, an RL recipe starts its samplers);
- :meth:`Recipe.submit_step` — submit step ``step``: its ``forward_backward`` call(s) and then exactly
  one ``optim_step(adam)``, and return a :class:`PendingStep` whose ``result()`` awaits them and returns
  the step's metrics and rows. It may block (an RL recipe samples with the current weights first);
- :meth:`Recipe.close` — stop background work.

Steps must be a pure function of (identity, step, the weights at that step): that is what makes resume
after SIGKILL exact. Rows (e.g. one per RL sample) are committed with the step's metrics, right before
the checkpoint that covers them is recorded, so a resumed run never duplicates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import tinker


@dataclass
class StepOutcome:
    metrics: dict[str, float]
    rows: list[dict[str, Any]] = field(default_factory=list)


class PendingStep(Protocol):
    def result(self) -> StepOutcome: ...


@dataclass
class DoneStep:
    """A :class:`PendingStep` whose outcome is already known."""

    outcome: StepOutcome

    def result(self) -> StepOutcome:
        return self.outcome


class Recipe(Protocol):
    name: str

    def num_steps(self) -> int: ...

    def identity(self) -> dict[str, Any]: ...

    def start(self, training_client: tinker.TrainingClient, service_client: tinker.ServiceClient, start_step: int) -> None: ...

    def submit_step(self, step: int, training_client: tinker.TrainingClient, adam: tinker.AdamParams) -> PendingStep: ...

    def close(self) -> None: ...


class RecipeBase:
    """No-op ``start``/``close`` for recipes that need neither."""

    name = "recipe"

    def start(self, training_client: tinker.TrainingClient, service_client: tinker.ServiceClient, start_step: int) -> None:
        return None

    def close(self) -> None:
        return None


class RowSink(Protocol):
    """Receives committed rows (``write_rows``) and forgets rows of steps a resumed run redoes."""

    def write_rows(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def truncate_from(self, step: int) -> None: ...
