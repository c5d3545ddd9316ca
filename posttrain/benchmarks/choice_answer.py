"""A multiple-choice scorer that reads the choice however a small model states it.

inspect's ``choice()`` counts only an ``ANSWER: X`` line. A small chat model often names its pick another way:
``B) 55``, ``(B)``, a bare ``B``, or the option's own text (``55``). Each of those is an unambiguous choice of one
option, so each counts as that choice; anything else (two letters, a value that is no option, silence) is wrong.
Standard benchmarks (MMLU) keep inspect's strict scorer so their figures stay comparable with published ones;
this one is for the demo's own multiple-choice task, where the question is what the model knows, not its format.
"""

from __future__ import annotations

import re

from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer, stderr
from inspect_ai.solver import TaskState

_ANSWER_LINE = re.compile(r"(?i)ANSWER\s*:\s*\(?([A-Z])\)?\b")
_LEADING_LETTER = re.compile(r"^\(?([A-Z])(?:[).:]|\s|$)")


def picked_letter(completion: str, options: list[str]) -> str | None:
    """The letter of the option the completion picks, or None when it picks none (or is ambiguous)."""
    letters = [chr(ord("A") + i) for i in range(len(options))]
    text = completion.strip()
    for pattern in (_ANSWER_LINE, _LEADING_LETTER):
        found = pattern.search(text) if pattern is _ANSWER_LINE else pattern.match(text)
        if found and found.group(1).upper() in letters:
            return found.group(1).upper()
    stated = re.sub(r"(?i)^ANSWER\s*:\s*", "", text).rstrip(".").strip()
    matches = [letter for letter, option in zip(letters, options) if stated == option.strip()]
    return matches[0] if len(matches) == 1 else None


@scorer(metrics=[accuracy(), stderr()])
def choice_answer() -> Scorer:
    """Correct when the picked option (:func:`picked_letter`) is the target letter."""

    async def score(state: TaskState, target: Target) -> Score:
        letter = picked_letter(state.output.completion, [choice.value for choice in state.choices])
        return Score(value=CORRECT if letter == target.text else INCORRECT, answer=letter or "")

    return score
