"""Prompt distillation's pure parts: greedy teacher settings, held-out agreement problems and grading."""

import pytest

from posttrain.distill.prompt import PromptDistillConfig, TeacherSampling, agreement_problems, same_answer
from posttrain.eval.accuracy import TaskProblem

ROWS = [
    {"row_id": "a", "split": "train", "messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "The answer is 5."}]},
    {"row_id": "b", "split": "heldout", "messages": [{"role": "user", "content": "4+4?"}, {"role": "assistant", "content": "The answer is 8."}]},
    {"row_id": "c", "split": "heldout", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
]


def test_temperature_zero_means_greedy_top_k_one():
    assert TeacherSampling("sys", temperature=0.0).settings().top_k == 1
    sampled = TeacherSampling("sys", temperature=0.7).settings()
    assert sampled.top_k == -1 and sampled.temperature == 0.7
    with pytest.raises(ValueError, match="temperature >= 0"):
        TeacherSampling("sys", temperature=-1.0).settings()


def test_agreement_uses_held_out_rows_with_the_teachers_answer_as_gold():
    problems = agreement_problems(ROWS)
    assert [(p.row_id, p.question, p.answer) for p in problems] == [("b", "4+4?", "The answer is 8."), ("c", "hi", "hello")]
    assert len(agreement_problems(ROWS, limit=1)) == 1


def test_same_answer_compares_extracted_answers_not_wording():
    teacher = TaskProblem(question="4+4?", answer="Let me add: 4 + 4 = 8. The answer is 8.")
    assert same_answer("8", teacher) == 1.0 and same_answer("9", teacher) == 0.0 and same_answer(None, teacher) == 0.0
    assert same_answer(None, TaskProblem(question="hi", answer="hello")) == 1.0  # neither states an answer


def test_prompt_distill_config_validates_as_sft():
    with pytest.raises(ValueError, match="batch_size must be positive"):
        PromptDistillConfig(batch_size=0).supervised()
