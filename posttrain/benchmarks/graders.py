"""The math benchmarks' prompt and inspect scorer: ask for an ``ANSWER:`` line, grade it with math-verify.

The prompt is inspect_evals' GSM8K/MATH prompt; the grading (``posttrain.eval.math_answers``) reads the
last ``ANSWER:`` line it asks for, or math-verify's own pick of the final expression when there is none.
"""

from __future__ import annotations

from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer, stderr
from inspect_ai.solver import TaskState

from posttrain.eval.math_answers import grade_math

MATH_PROMPT = """
Solve the following math problem step by step. The last line of your response should be of the form "ANSWER: $ANSWER" (without quotes) where $ANSWER is the answer to the problem.

{prompt}

Remember to put your answer on its own line at the end in the form "ANSWER: $ANSWER" (without quotes) where $ANSWER is the answer to the problem, and you do not need to use a \\boxed command.

Reasoning:
""".strip()


@scorer(metrics=[accuracy(), stderr()])
def math_answer() -> Scorer:
    """Correct when the response's final answer equals the target under math-verify."""

    async def score(state: TaskState, target: Target) -> Score:
        grade = grade_math(state.output.completion, target.text)
        return Score(value=CORRECT if grade.correct else INCORRECT, answer=grade.extracted)

    return score
