"""Two benchmarks that need no download: GSM8K-format sums and a multiple-choice variant.

They ask what `make demo`'s recipes train on (two-number sums, "Calculate 43 + 12."), so the leaderboard
shows the demo's checkpoints against their base model on a fresh offline clone, and the automation's
default suite always has something it can run. ``arithmetic_gsm8k`` is graded like ``gsm8k`` (its prompt,
math-verify on the ``ANSWER:`` line); ``arithmetic_choice`` asks with inspect's multiple-choice prompt, as ``mmlu`` does,
but takes the pick however the model states it (``B``, ``B) 55``, or the option's text ``55``: see
:mod:`posttrain.benchmarks.choice_answer`), since the demo's models learn to answer with the bare sum.
Problems come from a fixed seed, so every model answers the same ones (paired comparisons).

They are benchmarks by name (``--task arithmetic_gsm8k``); this file is also an inspect task file
(``--task posttrain/benchmarks/arithmetic.py@arithmetic_choice``, ``inspect eval``), the shape a new one takes.
"""

import random

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import generate, multiple_choice, prompt_template

from posttrain.benchmarks.choice_answer import choice_answer
from posttrain.benchmarks.graders import MATH_PROMPT, math_answer


def _sums(count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 99), rng.randint(1, 99)) for _ in range(count)]


@task
def arithmetic_gsm8k(count: int = 100, seed: int = 1234, max_tokens: int = 64) -> Task:
    samples = [Sample(id=f"sum-{a}-{b}-{i}", input=f"Calculate {a} + {b}.", target=str(a + b)) for i, (a, b) in enumerate(_sums(count, seed))]
    return Task(dataset=samples, solver=[prompt_template(MATH_PROMPT), generate()], scorer=math_answer(),
                config=GenerateConfig(temperature=0.0, max_tokens=max_tokens), name="arithmetic_gsm8k")


@task
def arithmetic_choice(count: int = 100, seed: int = 4321, max_tokens: int = 16) -> Task:
    rng = random.Random(seed)
    samples = []
    for i, (a, b) in enumerate(_sums(count, seed)):
        right = a + b
        options = {right, right + 1, right - 1, right + 10}
        shuffled = sorted(options, key=lambda _: rng.random())
        samples.append(Sample(id=f"choice-{a}-{b}-{i}", input=f"Calculate {a} + {b}.", choices=[str(o) for o in shuffled],
                              target="ABCD"[shuffled.index(right)]))
    return Task(dataset=samples, solver=[multiple_choice()], scorer=choice_answer(), config=GenerateConfig(temperature=0.0, max_tokens=max_tokens),
                name="arithmetic_choice")


GENERATED_TASKS = {"arithmetic_gsm8k": arithmetic_gsm8k, "arithmetic_choice": arithmetic_choice}
