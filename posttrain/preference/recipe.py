"""DPO as a training-core recipe: pair batches in, ``forward_backward_custom`` with the DPO loss out.

``train(config.training, DpoRecipe(config, pairs_table), service_client)`` runs it; the core owns the
training client, schedule, checkpoints and resume. The recipe owns:

- the reference: a given ``REFERENCE_LOGPROBS`` table (e.g. the Dagster asset), else computed in
  :meth:`DpoRecipe.start` from ``reference_model`` or a snapshot of the initial weights and written to
  ``<log_dir>/reference_logprobs.parquet``, which a resumed run reads back (its initial weights are
  gone by then);
- step ``s``'s pairs (:class:`posttrain.preference.data.PairBatching`, seeded by ``training.seed``);
- the step: ``forward_backward_custom(datums, dpo_loss_fn)`` then ``optim_step(adam)``. The SDK returns
  both as futures at once (its client-side forward → loss → backward runs in the background, in
  submission order), so the core can pipeline DPO steps like any other.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import tinker

from posttrain.atomic_files import staged
from posttrain.preference.data import PairBatching, PreferencePairs
from posttrain.preference.dpo import dpo_loss_fn
from posttrain.preference.eval import PairAccuracyEvaluator
from posttrain.preference.reference import ReferenceSums, compute_reference_logprobs, reference_sampling_client
from posttrain.training.config import TrainingConfig, config_from_dict, documented
from posttrain.training.recipe import RecipeBase, StepOutcome

REFERENCE_FILE = "reference_logprobs.parquet"
DPO_METRICS = ("dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward")


def _default_training() -> TrainingConfig:
    return TrainingConfig(learning_rate=1e-5, log_dir="runs/dpo")


@dataclass
class DpoConfig:
    """A DPO run. Data order is seeded by ``training.seed`` (with LoRA init and sampling)."""

    training: TrainingConfig = field(default_factory=_default_training)
    beta: float = documented(0.1, "DPO beta: strength of the implicit KL to the reference (higher = stay closer).")
    batch_size: int = documented(8, "Preference pairs per optimizer step (2 datums each).")
    num_epochs: int = documented(1, "Passes over the training pairs.")
    shuffle: bool = documented(True, "Shuffle the pairs each epoch (seeded by seed and the epoch).")
    drop_last: bool = documented(False, "Drop each epoch's last, smaller batch.")
    reference_model: str | None = documented(
        None,
        "Reference to stay close to: None = the run's initial weights (a snapshot before step 0); else a "
        "tinker://.../sampler_weights/... path or a base-model name.",
    )

    def __post_init__(self) -> None:
        if isinstance(self.training, dict):
            self.training = config_from_dict(TrainingConfig, self.training)

    def problems(self) -> list[str]:
        found = list(self.training.problems())
        if not self.beta > 0:
            found.append(f"beta must be positive, got {self.beta}")
        for name in ("batch_size", "num_epochs"):
            if getattr(self, name) <= 0:
                found.append(f"{name} must be positive, got {getattr(self, name)}")
        return found


def table_digest(table: pa.Table) -> str:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()[:16]


@dataclass
class _PendingDpoStep:
    forward_backward: Any  # APIFuture[ForwardBackwardOutput]
    optim: Any  # APIFuture[OptimStepResponse]
    metrics: dict[str, float]

    def result(self) -> StepOutcome:
        output = self.forward_backward.result()
        self.optim.result()
        return StepOutcome(metrics={**self.metrics, **{name: float(output.metrics[name]) for name in DPO_METRICS}})


class DpoRecipe(RecipeBase):
    name = "dpo"

    def __init__(
        self,
        config: DpoConfig,
        pairs: PreferencePairs | pa.Table,
        reference: pa.Table | None = None,
        heldout: PreferencePairs | None = None,
    ):
        """``pairs``: the training pairs (a table contributes its ``train`` split). ``reference``: their
        reference logprobs (and ``heldout``'s), else computed in :meth:`start`. ``heldout``: pairs never
        trained on whose reference logprobs are computed alongside, for :meth:`heldout_evaluator`."""
        problems = config.problems()
        if problems:
            raise ValueError("invalid DpoConfig: " + "; ".join(problems))
        self.config = config
        self.pairs = pairs if isinstance(pairs, PreferencePairs) else PreferencePairs.from_table(pairs)
        self.heldout = heldout
        if heldout is not None and (shared := set(self.pairs.row_ids()) & set(heldout.row_ids())):
            raise ValueError(f"pairs {sorted(shared)[:5]} are both training and held-out pairs: held-out pairs must not be trained on")
        self.scored_pairs = self.pairs.pairs + (heldout.pairs if heldout is not None else [])
        self.batching = PairBatching(
            num_pairs=len(self.pairs), batch_size=config.batch_size, num_epochs=config.num_epochs,
            seed=config.training.seed, shuffle=config.shuffle, drop_last=config.drop_last,
        )
        self.reference_table = reference
        self.reference: ReferenceSums | None = None
        if reference is not None:
            self.reference = ReferenceSums.from_table(reference)
            self.reference.check_covers([pair.row_id for pair in self.scored_pairs])

    def num_steps(self) -> int:
        return self.batching.num_steps()

    def identity(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs.digest(),
            "batching": asdict(self.batching),
            "beta": self.config.beta,
            "reference_model": self.config.reference_model,
            "heldout": None if self.heldout is None else self.heldout.digest(),
            "reference_table": None if self.reference_table is None else table_digest(self.reference_table),
        }

    def start(self, training_client: tinker.TrainingClient, service_client: tinker.ServiceClient, start_step: int) -> None:
        if self.reference is not None:
            return
        path = Path(self.config.training.log_dir) / REFERENCE_FILE
        if start_step > 0:
            if not path.exists():
                raise FileNotFoundError(
                    f"resuming DPO at step {start_step} needs the reference logprobs of step 0 at {path}, which is "
                    "missing; the initial weights cannot be recovered: start a new run (new log_dir) or pass reference="
                )
            self.reference_table = pq.read_table(path)
        else:
            client = reference_sampling_client(
                service_client, reference_model=self.config.reference_model, training_client=training_client
            )
            self.reference_table = compute_reference_logprobs(client, self.scored_pairs)
            with staged(path) as staging:
                pq.write_table(self.reference_table, staging)
        self.reference = ReferenceSums.from_table(self.reference_table)
        self.reference.check_covers([pair.row_id for pair in self.scored_pairs])

    def heldout_evaluator(self, prefix: str = "eval/") -> PairAccuracyEvaluator:
        """Held-out pair accuracy against this run's reference (available once :meth:`start` ran)."""
        if self.heldout is None:
            raise ValueError("heldout_evaluator needs DpoRecipe(..., heldout=PreferencePairs(...))")
        return PairAccuracyEvaluator(self.heldout.pairs, self._reference_for_eval, self.config.beta, prefix)

    def _reference_for_eval(self) -> pa.Table:
        if self.reference_table is None:
            raise RuntimeError("the held-out evaluator ran before DpoRecipe.start computed the reference")
        return self.reference_table

    def submit_step(self, step: int, training_client: tinker.TrainingClient, adam: tinker.AdamParams) -> _PendingDpoStep:
        if self.reference is None:
            raise RuntimeError("DpoRecipe.submit_step before start(): the training core calls start() first")
        indices = self.batching.pair_indices(step)
        data = self.pairs.data_at(indices)
        chosen_ref, rejected_ref = self.reference.for_rows([self.pairs.pairs[int(i)].row_id for i in indices])
        forward_backward = training_client.forward_backward_custom(data, dpo_loss_fn(chosen_ref, rejected_ref, self.config.beta))
        optim = training_client.optim_step(adam)
        metrics = {
            "epoch": float(self.batching.epoch_of(step)),
            "num_pairs": float(len(indices)),
            "num_tokens": float(sum(datum.model_input.length for datum in data)),
        }
        return _PendingDpoStep(forward_backward, optim, metrics)
