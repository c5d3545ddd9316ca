"""The cookbook's pairwise comparison format: what a preference model reads and which token it answers.

A comparison is rendered as one conversation (ARCHITECTURE §10, tinker-cookbook ``preference/types.py``):
the prompt conversation, a system message ``==== Completion A ====``, completion A, ``==== Completion B
====``, completion B, ``==== Preference ====``, then an assistant turn holding the label ``A``, ``B`` or
``Tie``. The preference model is SFT on the *first token* of that label (the sequence is cut right
after it, as the cookbook does), so scoring needs only the probability of each label's first token at
the position after the generation prompt — :class:`ComparisonRenderer` gives both.

A comparison may carry a *reference answer* to the prompt, rendered as ``==== Reference ====`` and the
answer between the prompt and completion A: a judge that reads one compares the completions with an answer
it trusts instead of solving the prompt inside one forward pass (MT-Bench's reference-guided grading). In
training the reference is the chosen completion of a verified comparison (``reference="chosen"``); when
judging, the preference model writes its own answer there first (``posttrain.preference.preference_model``).

Comparisons come from a ``preference_comparisons`` table (``chosen`` / ``rejected``): each row gives a
labelled comparison in both orders by default (chosen as A labelled ``A``, and swapped, labelled ``B``),
so the trained model sees each label in each position equally often.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tinker

from posttrain.datasets.schemas import PREFERENCE_COMPARISONS, TRAIN_SPLIT, validate_table
from posttrain.datums import datum_from_tokens

Label = Literal["A", "B", "Tie"]
LABELS: tuple[Label, ...] = get_args(Label)
COMPLETION_A = "==== Completion A ===="
COMPLETION_B = "==== Completion B ===="
PREFERENCE = "==== Preference ===="
REFERENCE = "==== Reference ===="
SWAPPED_LABEL: dict[str, Label] = {"A": "B", "B": "A", "Tie": "Tie"}
Orders = Literal["both", "one"]
ORDERS: tuple[str, ...] = get_args(Orders)
Reference = Literal["none", "chosen"]
REFERENCES: tuple[str, ...] = get_args(Reference)

Message = dict[str, Any]


@dataclass(frozen=True)
class Comparison:
    prompt: list[Message]
    completion_a: list[Message]
    completion_b: list[Message]
    reference: list[Message] | None = None  # a reference answer the judge compares both completions with

    def swap(self) -> Comparison:
        return Comparison(self.prompt, self.completion_b, self.completion_a, self.reference)

    def with_reference(self, reference: list[Message]) -> Comparison:
        return Comparison(self.prompt, self.completion_a, self.completion_b, reference)

    def conversation(self) -> list[Message]:
        """The comparison as one conversation ending where the preference model answers."""
        reference = [{"role": "system", "content": REFERENCE}, *self.reference] if self.reference is not None else []
        return [
            *self.prompt,
            *reference,
            {"role": "system", "content": COMPLETION_A},
            *self.completion_a,
            {"role": "system", "content": COMPLETION_B},
            *self.completion_b,
            {"role": "system", "content": PREFERENCE},
        ]


@dataclass(frozen=True)
class LabeledComparison:
    comparison: Comparison
    label: Label
    row_id: str = ""

    def swap(self) -> LabeledComparison:
        return LabeledComparison(self.comparison.swap(), SWAPPED_LABEL[self.label], self.row_id)


@dataclass(frozen=True)
class ScoringInput:
    """The generation prompt of a comparison and the first token of each label after it."""

    prompt_tokens: list[int]
    label_tokens: dict[str, int]

    def sequence(self, label: str) -> tinker.ModelInput:
        """Prompt + the label's first token: ``compute_logprobs``' last element is log P(label | prompt)."""
        return tinker.ModelInput.from_ints([*self.prompt_tokens, self.label_tokens[label]])


class ComparisonRenderer:
    """Renders comparisons with a chat renderer (``posttrain.renderers``) in the cookbook's format."""

    def __init__(self, renderer: Any):
        self.renderer = renderer

    def labeled_tokens(self, labeled: LabeledComparison) -> tuple[list[int], int]:
        """(tokens up to and including the label's first token, index of that token)."""
        messages = [*labeled.comparison.conversation(), {"role": "assistant", "content": labeled.label}]
        model_input, weights = self.renderer.build_supervised_example(messages)
        tokens = model_input.to_ints()
        trained = np.flatnonzero(np.asarray(weights) > 0)
        if trained.size == 0:
            raise ValueError(f"comparison {labeled.row_id!r}: the renderer trained no token of the label {labeled.label!r}")
        first = int(trained[0])
        return tokens[: first + 1], first

    def datum(self, labeled: LabeledComparison) -> tinker.Datum:
        """SFT datum on the label's first token only (weight 1 there, 0 elsewhere)."""
        tokens, first = self.labeled_tokens(labeled)
        weights = [0.0] * len(tokens)
        weights[first] = 1.0
        return datum_from_tokens(tokens[:-1], tokens[1:], weights[1:])

    def scoring_input(self, comparison: Comparison, labels: Sequence[str] = LABELS) -> ScoringInput:
        prompt: list[int] | None = None
        label_tokens: dict[str, int] = {}
        for label in labels:
            tokens, first = self.labeled_tokens(LabeledComparison(comparison, label))  # type: ignore[arg-type]
            if prompt is not None and tokens[:first] != prompt:
                raise ValueError(f"the renderer's prompt differs before label {label!r}; the labels must continue one prompt")
            prompt = tokens[:first]
            label_tokens[label] = tokens[first]
        if len(set(label_tokens.values())) != len(label_tokens):
            raise ValueError(f"labels {list(labels)} share a first token ({label_tokens}): the preference model could not tell them apart")
        assert prompt is not None
        return ScoringInput(prompt, label_tokens)


def _flip(seed: int, row_id: str) -> bool:
    return hashlib.sha256(f"{seed}:{row_id}".encode()).digest()[0] % 2 == 1


def labeled_comparisons_from_table(
    table: pa.Table, split: str | None = TRAIN_SPLIT, *, orders: Orders = "both", seed: int = 0, reference: Reference = "none"
) -> list[LabeledComparison]:
    """Labelled comparisons of a ``preference_comparisons`` table (chosen is preferred).

    ``orders="both"``: two per row, chosen first (label A) and chosen second (label B);
    ``"one"``: one per row, the order picked by a hash of (seed, row id), so about half are each way.
    ``reference="chosen"``: each comparison carries the chosen completion as its reference answer — only
    meaningful where a verifier picked the chosen side (on-policy comparisons), so it is a correct answer.
    """
    if orders not in ORDERS:
        raise ValueError(f"orders={orders!r} is not one of {ORDERS}")
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r} is not one of {REFERENCES}")
    validate_table(table, PREFERENCE_COMPARISONS)
    if split is not None:
        table = table.filter(pc.equal(table.column("split"), split))
    labeled = []
    for row in table.select(["row_id", "prompt", "chosen", "rejected"]).to_pylist():
        chosen = list(row["chosen"])
        comparison = Comparison(list(row["prompt"]), chosen, list(row["rejected"]), chosen if reference == "chosen" else None)
        forward = LabeledComparison(comparison, "A", row["row_id"])
        if orders == "both":
            labeled += [forward, forward.swap()]
        else:
            labeled.append(forward.swap() if _flip(seed, row["row_id"]) else forward)
    return labeled
