"""Distillation prompts from any prompt table: problems as they are, chat and comparison prompts without gold answers."""

import pyarrow as pa
import pytest

from posttrain.datasets.schemas import CHAT, PREFERENCE_COMPARISONS, RL_PROBLEMS
from posttrain.distill.prompts import has_gold_answers, prompts_table


def _chat(row_id, split, *messages):
    return {"row_id": row_id, "source": "no_robots", "split": split, "messages": [{"role": r, "content": c} for r, c in messages]}


def test_chat_rows_become_their_last_user_turn_with_their_split_and_no_gold_answer():
    table = pa.Table.from_pylist([
        _chat("a", "train", ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Name a colour"), ("assistant", "Red")),
        _chat("b", "heldout", ("user", "Why?"), ("assistant", "Because.")),
        _chat("c", "train", ("assistant", "an answer with no question")),
    ], schema=CHAT)
    prompts = prompts_table(table)
    assert prompts.schema.equals(RL_PROBLEMS, check_metadata=False) and not has_gold_answers(table)
    assert prompts.select(["row_id", "split", "task", "question", "answer", "scorer"]).to_pylist() == [
        {"row_id": "a", "split": "train", "task": "no_robots", "question": "Name a colour", "answer": "", "scorer": ""},
        {"row_id": "b", "split": "heldout", "task": "no_robots", "question": "Why?", "answer": "", "scorer": ""},
    ]


def test_comparisons_give_their_prompt_and_problems_pass_through():
    comparisons = pa.Table.from_pylist([{
        "row_id": "p", "source": "hh_rlhf", "split": "train", "prompt": [{"role": "user", "content": "Say hi"}],
        "chosen": [{"role": "assistant", "content": "Hi"}], "rejected": [{"role": "assistant", "content": "No"}],
    }], schema=PREFERENCE_COMPARISONS)
    assert prompts_table(comparisons)["question"].to_pylist() == ["Say hi"]
    problems = pa.Table.from_pylist([{"row_id": "q", "source": "s", "split": "train", "task": "t", "question": "1+1?",
                                      "answer": "2", "scorer": "exact_number", "scorer_metadata": "{}"}], schema=RL_PROBLEMS)
    assert prompts_table(problems) is problems and has_gold_answers(problems)
    with pytest.raises(ValueError, match="question/answer .* messages .* prompt/chosen"):
        prompts_table(pa.table({"text": ["x"]}))
