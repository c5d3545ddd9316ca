"""Evaluators on real models served by an in-process localtinker (tiny model), through the real SDK."""

import math

import pytest
import tinker

from posttrain.eval import EvalTarget, TaskProblem, evaluate_accuracy, evaluate_nll
from posttrain.renderers import get_renderer
from posttrain.supervised import SupervisedConfig, train_supervised
from tests.posttrain.supervised.tiny_data import TINY_MODEL, arithmetic_data, arithmetic_rows, tiny_tokenizer

QUESTIONS = ["What is 20 + 22?", "What is 40 + 2?", "What is 7 * 6?"]


def test_nll_and_bpb_agree_between_training_and_sampling_clients_and_count_answer_bytes(service_client, tmp_path):
    tokenizer = tiny_tokenizer()
    data = arithmetic_data(tokenizer, 4)
    config = SupervisedConfig.from_dict(dict(base_model=TINY_MODEL, lora_rank=4, learning_rate=3e-2, batch_size=2,
                                             num_epochs=2, log_dir=str(tmp_path / "run")))
    result = train_supervised(config, data, service_client)

    from_sampler = evaluate_nll(EvalTarget.from_checkpoint(service_client, result.sampler_path, tokenizer), data)
    trainer = service_client.create_training_client_from_state(result.state_path).result()
    from_trainer = evaluate_nll(EvalTarget(training_client=trainer), data)  # tokenizer named by the server
    base = evaluate_nll(EvalTarget.from_base_model(service_client, TINY_MODEL), data, tokenizer)

    answers = [row["target_tokens"][-len([w for w in row["weights"] if w > 0]):] for row in arithmetic_rows(tokenizer, 4)]
    special = set(tokenizer.all_special_ids)
    expected_bytes = sum(len(tokenizer.decode([t for t in tokens if t not in special]).encode()) for tokens in answers)
    for measured in (from_sampler, from_trainer, base):
        assert math.isfinite(measured.nll) and measured.nll > 0
        assert measured.num_bytes == expected_bytes
        assert measured.num_tokens == sum(len(tokens) for tokens in answers)
        content_nll = sum(example.content_nll_sum for example in measured.examples)  # special tokens: no bytes, no bits
        assert measured.bits_per_byte == pytest.approx(content_nll / math.log(2) / measured.num_bytes)
    assert from_sampler.nll == pytest.approx(from_trainer.nll, rel=1e-3)
    assert from_trainer.nll < base.nll - 1.0  # trained on exactly these examples


def test_accuracy_grades_real_greedy_samples_parsed_by_the_renderer(service_client):
    tokenizer = tiny_tokenizer()
    renderer = get_renderer("chatml", tokenizer)
    problems = [TaskProblem(question=q, answer="42", row_id=f"p{i}") for i, q in enumerate(QUESTIONS)]
    target = EvalTarget.from_base_model(service_client, TINY_MODEL)

    result = evaluate_accuracy(target, renderer, problems, max_tokens=6)
    assert len(result.rows) == 3 and 0.0 <= result.accuracy <= 1.0
    assert result.accuracy == sum(row.correct for row in result.rows) / 3

    # The rows are the renderer's reading of what the server really sampled (greedy, so reproducible).
    params = tinker.SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=0, stop=renderer.get_stop_sequences())
    futures = [
        target.sampling_client().sample(renderer.build_generation_prompt([{"role": "user", "content": p.question}]), 1, params)
        for p in problems
    ]
    for future, row in zip(futures, result.rows):
        sequence = future.result().sequences[0]
        message, termination = renderer.parse_response(list(sequence.tokens))
        assert row.response == message["content"] and row.num_tokens == len(sequence.tokens)
        assert row.well_formed == termination.is_clean
        assert row.stop_reason == str(sequence.stop_reason)

    # The accuracy is the mean of the grades of those samples: grade them differently, get another number.
    def says_nothing_numeric(extracted, problem):
        return 1.0 if extracted is None or not extracted.lstrip("-").isdigit() else 0.0

    flipped = evaluate_accuracy(target, renderer, problems, max_tokens=6, grade=says_nothing_numeric)
    assert [row.response for row in flipped.rows] == [row.response for row in result.rows]
    assert [row.correct for row in flipped.rows] == [says_nothing_numeric(row.extracted, None) == 1.0 for row in result.rows]

