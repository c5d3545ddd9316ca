"""The two trained stages of RLHF as recipes on the training core (SFT → preference model → RL against it).

- :class:`PreferenceModelRecipe` — supervised learning on comparisons rendered in the cookbook's format
  (``comparison_format``): one datum per labelled comparison, trained on the label's first token only.
  It *is* the SFT recipe over those datums (same batching, order and exact resume), under its own name.
- :class:`RLHFRecipe` — the RL recipe (every loss, KL option and driver of ``posttrain.rl``) over a
  :class:`~posttrain.preference.env.PreferenceDataset`: rewards are win fractions in tournaments judged
  by the preference model whose sampler weights ``judge_path`` names, opened in ``start`` (answering each
  prompt itself first when it was trained with reference answers, ``judge_answers_first``, or reading the
  answer of the checkpoint ``reference_path`` names).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import tinker

from posttrain.preference.comparison_format import ORDERS, REFERENCES, ComparisonRenderer, LabeledComparison, Orders, Reference
from posttrain.preference.env import PreferenceDataset
from posttrain.preference.preference_model import PreferenceModel
from posttrain.preference.tournament import TOURNAMENT_PATTERNS, TournamentPattern
from posttrain.rl.config import RLConfig
from posttrain.rl.recipe import RLRecipe
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import DatumList
from posttrain.supervised.recipe import SupervisedRecipe
from posttrain.training.config import documented

PromptTable = Literal["rl_problems", "onpolicy_comparisons", "preference_comparisons"]


@dataclass
class PreferenceModelConfig(SupervisedConfig):
    renderer: str = documented("chatml", "Chat renderer the comparisons are rendered with (the policy's, so the judge reads what it writes).")
    orders: Orders = documented("both", "both: every comparison in both orders (label A and B equally often); one: one order per row, by hash.")
    reference: Reference = documented(
        "none",
        "none: the cookbook's format. chosen: a reference answer precedes the two completions — the chosen one in training, "
        "the judge's own greedy answer when it judges (a judge that solves the prompt before it compares); for comparisons "
        "whose chosen side a verifier picked (onpolicy_comparisons).",
    )

    def validate(self) -> None:
        super().validate()
        if self.orders not in ORDERS:
            raise ValueError(f"invalid PreferenceModelConfig: orders {self.orders!r} is not one of {ORDERS}")
        if self.reference not in REFERENCES:
            raise ValueError(f"invalid PreferenceModelConfig: reference {self.reference!r} is not one of {REFERENCES}")


class PreferenceModelRecipe(SupervisedRecipe):
    name = "preference_model"

    def __init__(self, config: PreferenceModelConfig, comparisons: list[LabeledComparison], renderer: ComparisonRenderer, data_version: str = ""):
        if not comparisons:
            raise ValueError("no comparisons to train the preference model on: the table's train split is empty")
        super().__init__(config, DatumList([renderer.datum(labeled) for labeled in comparisons]), data_version)
        self.orders = config.orders
        self.reference = config.reference
        self.digest = hashlib.sha256("\n".join(f"{c.row_id}:{c.label}" for c in comparisons).encode()).hexdigest()[:16]

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "orders": self.orders, "reference": self.reference, "comparisons_digest": self.digest}


@dataclass
class RLHFConfig(RLConfig):
    env: str = documented(
        "rl_problems",
        "Prompt table: rl_problems (prompts with a verifier: accuracy is tracked, never rewarded), onpolicy_comparisons or "
        "preference_comparisons (their distinct prompts).",
    )
    preference_model: str = documented(
        "latest:preference_model",
        "Preference-model checkpoint that judges: latest:preference_model, a checkpoint partition key or "
        "<registered model>/<version> (a registered preference_model checkpoint of the same base model).",
    )
    tournament: TournamentPattern = documented("all_pairs_one_way", "Pairs judged per group: all_pairs_one_way (i<j) or all_pairs_both_ways.")
    tournament_chunk_size: int = documented(0, "> 1: tournaments only within chunks of this many samples (fewer judgements); 0 = whole group.")
    judge_orders: Orders = documented("both", "both: each pair judged in both orders and averaged (cancels position bias); one: as given.")
    judge_reference_from: str = documented(
        "",
        "For a judge trained with reference: chosen, the checkpoint whose greedy answer fills its reference slot (a partition "
        "key, latest:<recipe>, best:<recipe>); empty = the judge answers itself.",
    )

    def problems(self) -> list[str]:
        found = super().problems()
        if self.tournament not in TOURNAMENT_PATTERNS:
            found.append(f"tournament {self.tournament!r} is not one of {TOURNAMENT_PATTERNS}")
        if self.tournament_chunk_size < 0 or self.tournament_chunk_size == 1:
            found.append(f"tournament_chunk_size must be 0 or >= 2, got {self.tournament_chunk_size}")
        if self.judge_orders not in ORDERS:
            found.append(f"judge_orders {self.judge_orders!r} is not one of {ORDERS}")
        if self.group_size < 2:
            found.append(f"group_size must be >= 2 for a tournament, got {self.group_size}")
        return found


class RLHFRecipe(RLRecipe):
    name = "rlhf"

    def __init__(
        self,
        config: RLHFConfig,
        dataset: PreferenceDataset,
        comparison_renderer: ComparisonRenderer,
        judge_path: str,
        tokenizer: Any | None = None,
        parent_sampler_path: str | None = None,
        judge_answers_first: bool = False,
        reference_path: str | None = None,
    ):
        if not judge_path.startswith("tinker://"):
            raise ValueError(f"judge_path must be the preference model's tinker://.../sampler_weights/... path, got {judge_path!r}")
        super().__init__(config, dataset, tokenizer, parent_sampler_path)
        self.preference_dataset = dataset
        self.comparison_renderer = comparison_renderer
        self.judge_path = judge_path
        self.judge_answers_first = judge_answers_first
        self.reference_path = reference_path

    def identity(self) -> dict[str, Any]:
        config: RLHFConfig = self.config  # type: ignore[assignment]
        found = {**super().identity(), "preference_model": self.judge_path, "judge_orders": config.judge_orders}
        return found | ({"judge_reference_from": self.reference_path} if self.reference_path else {})

    def start(self, training_client: tinker.TrainingClient, service_client: tinker.ServiceClient, start_step: int) -> None:
        config: RLHFConfig = self.config  # type: ignore[assignment]
        judge_client = service_client.create_sampling_client(model_path=self.judge_path).result()
        answerer = service_client.create_sampling_client(model_path=self.reference_path).result() if self.reference_path else None
        self.preference_dataset.bind(PreferenceModel(
            judge_client, self.comparison_renderer, orders=config.judge_orders,
            answers_first=self.judge_answers_first, answer_max_tokens=config.max_tokens, answerer=answerer,
        ))
        super().start(training_client, service_client, start_step)
