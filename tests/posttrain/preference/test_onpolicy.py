"""On-policy pairs from a real checkpoint's samples on the tiny-random server: pairing and drop counts."""

import itertools

import pytest

from posttrain.datasets import schemas, tokens
from posttrain.preference.onpolicy import accumulate_comparisons, build_onpolicy_pairs, sampler_of
from posttrain.renderers import get_renderer
from tests.posttrain.preference.tiny_pairs import TINY_MODEL, tiny_tokenizer


def _problems(count: int, scorer: str = "exact_match"):
    rows = [
        {"row_id": f"p{i}", "source": "test", "split": "heldout" if i == count - 1 else "train", "task": "t",
         "question": f"What is {i} + 1?", "answer": "a sentence no random model writes", "scorer": scorer, "scorer_metadata": "{}"}
        for i in range(count)
    ]
    return schemas.table_from_rows(rows, schemas.RL_PROBLEMS)


@pytest.fixture(scope="module")
def sampler_path(tinker_server):
    import tinker

    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key="tml-local")
    training_client = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    path = training_client.save_weights_for_sampler("onpolicy-test").result().path
    yield path
    client.close("success").result(timeout=60)


def test_prompts_without_a_correct_answer_are_dropped_and_counted(service_client, sampler_path):
    renderer = get_renderer("chatml", tiny_tokenizer())
    result = build_onpolicy_pairs(service_client, sampler_path, renderer, _problems(4), num_samples=3, max_tokens=8)
    assert result.num_prompts == 3  # the train split only
    assert (result.num_pairs, result.dropped_none_correct, result.dropped_all_correct) == (0, 3, 0)
    assert result.sample_accuracy == 0.0
    assert result.metrics()["onpolicy/dropped_none_correct"] == 3.0


def test_mixed_prompts_become_pairs_that_train_as_dpo_data(service_client, sampler_path):
    renderer = get_renderer("chatml", tiny_tokenizer())
    verdicts = {"p0": itertools.repeat(1.0), "p1": itertools.repeat(0.0), "p2": itertools.cycle([1.0, 0.0]), "p3": itertools.cycle([0.0, 1.0])}
    graded: dict[str, list[float]] = {}

    def grade(extracted, problem):
        score = next(verdicts[problem.row_id])
        graded.setdefault(problem.row_id, []).append(score)
        return score

    result = build_onpolicy_pairs(
        service_client, sampler_path, renderer, _problems(5), num_samples=4, max_tokens=8, seed=3, grade=grade
    )
    assert result.num_prompts == 4 and all(len(scores) == 4 for scores in graded.values())
    assert (result.num_pairs, result.dropped_all_correct, result.dropped_none_correct) == (2, 1, 1)
    assert result.sample_accuracy == pytest.approx((4 + 0 + 2 + 2) / 16)
    rows = result.table.to_pylist()
    assert [row["row_id"] for row in rows] == ["p2", "p3"]
    assert all(row["source"] == "onpolicy:" + sampler_path and row["split"] == "train" for row in rows)
    assert rows[0]["prompt"] == [{"role": "user", "content": "What is 2 + 1?"}]
    assert all(row["chosen"][0]["role"] == "assistant" and row["rejected"][0]["role"] == "assistant" for row in rows)
    rendered = tokens.render_comparisons_table(result.table, renderer, max_length=None)
    assert schemas.schema_problems(rendered, schemas.PREFERENCE_PAIRS) == [] and rendered.num_rows == 2


def test_one_sample_per_prompt_is_refused(service_client, sampler_path):
    with pytest.raises(ValueError, match="num_samples must be at least 2"):
        build_onpolicy_pairs(service_client, sampler_path, get_renderer("chatml", tiny_tokenizer()), _problems(2), num_samples=1)


def _comparisons(sampler: str, rows: list[tuple[str, str, str]]):
    """rows: (row_id, split, question) with a fixed right and wrong answer."""
    return schemas.table_from_rows([
        {"row_id": row_id, "source": f"onpolicy:{sampler}", "split": split,
         "prompt": [{"role": "user", "content": question}], "chosen": [{"role": "assistant", "content": "2"}],
         "rejected": [{"role": "assistant", "content": "3"}]}
        for row_id, split, question in rows
    ], schemas.PREFERENCE_COMPARISONS)


def test_accumulated_comparisons_keep_every_policy_with_unique_ids():
    sft = _comparisons("tinker://sft", [("p0", "train", "1 + 1?"), ("p1", "heldout", "0 + 2?")])
    round1 = _comparisons("tinker://rlhf-1", [("p0", "train", "1 + 1?"), ("p2", "train", "2 + 0?")])
    round2 = _comparisons("tinker://rlhf-2", [("p0", "train", "1 + 1?"), ("p1", "heldout", "0 + 2?")])
    table = accumulate_comparisons(accumulate_comparisons(sft, round1), round2)
    rows = table.to_pylist()
    assert [r["row_id"] for r in rows] == ["p0", "p1", "p0@1", "p2", "p0@2", "p1@2"]
    assert [sampler_of(r) for r in rows] == ["tinker://sft"] * 2 + ["tinker://rlhf-1"] * 2 + ["tinker://rlhf-2"] * 2
    assert schemas.schema_problems(table, schemas.PREFERENCE_COMPARISONS) == []


def test_accumulating_refuses_a_sampler_twice_and_a_prompt_in_both_splits():
    sft = _comparisons("tinker://sft", [("p0", "train", "1 + 1?")])
    with pytest.raises(ValueError, match="already hold the answers of tinker://sft"):
        accumulate_comparisons(sft, _comparisons("tinker://sft", [("p1", "train", "0 + 2?")]))
    with pytest.raises(ValueError, match=r"1 prompt\(s\) are held out in one table and trained on in the other \(first: q0\)"):
        accumulate_comparisons(sft, _comparisons("tinker://rlhf", [("q0", "heldout", "1 + 1?")]))
