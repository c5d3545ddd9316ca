"""code_reward: last fenced block, cookbook reward values, grading through the pool."""

from __future__ import annotations

import pytest

from posttrain.rl.code_reward import code_reward, code_rewards, extract_program, reward_for
from posttrain.sandbox import Limits, ProblemTests, SandboxPool

ADD_THREE = {"row_id": "t/add_three", "entry_point": "add_three", "test_code": "def check(candidate):\n    assert candidate(1) == 4\n    assert candidate(-3) == 0\n", "tests": []}
LIMITS = Limits(timeout_s=10, memory_mb=256)


def test_extract_program_takes_the_last_python_or_bare_block():
    text = "think\n```python\nx = 1\n```\nthen\n```\ny = 2\n```\n```text\nnot code\n```\n"
    assert extract_program(text) == "y = 2\n"
    assert extract_program("```py\nz = 3\n```") == "z = 3\n"
    assert extract_program("no fences here") is None
    assert extract_program("```python\nunterminated") is None


def test_reward_values_follow_the_cookbook():
    assert (reward_for(False, False), reward_for(True, False), reward_for(True, True)) == (pytest.approx(-0.1), 0.0, 1.0)
    right = code_reward("```python\ndef add_three(x):\n    return x + 3\n```", ADD_THREE, limits=LIMITS)
    assert (right.reward, right.status, right.all_tests_pass) == (1.0, "passed", True)
    wrong = code_reward("```python\ndef add_three(x):\n    return x + 2\n```", ADD_THREE, limits=LIMITS)
    assert (wrong.reward, wrong.status) == (0.0, "failed") and "AssertionError" in wrong.stderr_tail
    missing = code_reward("def add_three(x): return x + 3", ADD_THREE, limits=LIMITS)
    assert (missing.reward, missing.status, missing.has_code_block) == (pytest.approx(-0.1), "no_code_block", False)
    early_exit = code_reward("```python\nimport sys\nsys.exit(0)\n```", ADD_THREE, limits=LIMITS)
    assert early_exit.reward == 0.0


def test_batch_grading_in_a_pool_keeps_order():
    responses = ["```python\ndef add_three(x):\n    return x + 3\n```", "nothing", "```python\ndef add_three(x):\n    return 0\n```"]
    with SandboxPool(max_workers=2) as pool:
        grades = code_rewards(responses, [ADD_THREE, ADD_THREE, ProblemTests.from_row(ADD_THREE)], limits=LIMITS, pool=pool)
    assert [g.reward for g in grades] == [1.0, pytest.approx(-0.1), 0.0]
    with pytest.raises(ValueError, match="2 responses but 1 test suites"):
        code_rewards(responses[:2], [ADD_THREE])
