"""Easy function-writing tasks with hidden unit tests, generated offline: "code_tasks:easy?count=400".

Each task asks for one small Python function (`add_three(x)` returns x + 3, reverse a string, sum a
list, the larger of two numbers, ...) that a 135M model can learn to write. A task is a template plus
a parameter (the 3 in add_three), so the catalog holds several hundred distinct functions. The hidden
tests are HumanEval-style `check(candidate)` code whose expected values are computed by running the
task's reference solution, so reference and tests cannot disagree.

Determinism: the seed picks which functions are drawn and the test inputs; the row id and the prompt
depend on the function alone (`code_tasks:easy/add_three`), so the hash-based held-out split keeps a
function on the same side whatever the seed, count or order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

SOURCE_PREFIX = "code_tasks:"
LEVELS = ("easy",)
TESTS_PER_TASK = 5
INSTRUCTION = "Reply with the whole function in one ```python code block."
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")
LETTERS = "abcdefghijklmnopqrstuvwxyz"

InputMaker = Callable[[random.Random], tuple[Any, ...]]


@dataclass(frozen=True)
class CodeTask:
    """One function to write: its name, parameters, an English description, the reference body (one
    return expression) and a maker of random argument tuples."""

    name: str
    params: tuple[str, ...]
    description: str
    body: str
    make_inputs: InputMaker

    @property
    def signature(self) -> str:
        return f"def {self.name}({', '.join(self.params)}):"

    @property
    def reference_solution(self) -> str:
        return f"{self.signature}\n    return {self.body}\n"

    def reference(self) -> Callable[..., Any]:
        namespace: dict[str, Any] = {}
        exec(self.reference_solution, namespace)  # noqa: S102 - our own template code, not model output
        return namespace[self.name]


def _ints(low: int = -50, high: int = 50) -> InputMaker:
    return lambda rng: (rng.randint(low, high),)


def _int_pair(rng: random.Random) -> tuple[int, int]:
    return rng.randint(-50, 50), rng.randint(-50, 50)


def _int_list(rng: random.Random) -> tuple[list[int]]:
    return ([rng.randint(-20, 20) for _ in range(rng.randint(1, 6))],)


def _word(rng: random.Random) -> tuple[str]:
    return ("".join(rng.choice(LETTERS[:8]) for _ in range(rng.randint(1, 7))),)


def _word_with(letter: str) -> InputMaker:
    """Words over a few letters plus `letter`, so tasks about that letter see it often."""
    alphabet = LETTERS[:5] + letter * 2
    return lambda rng: ("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))),)


def _word_pair(rng: random.Random) -> tuple[str, str]:
    return _word(rng)[0], _word(rng)[0]


def _word_list(rng: random.Random) -> tuple[list[str]]:
    return ([_word(rng)[0] for _ in range(rng.randint(1, 4))],)


def _number_name(k: int) -> str:
    return NUMBER_WORDS[k] if k < len(NUMBER_WORDS) else str(k)


def _parameterized() -> Iterator[CodeTask]:
    for k in range(1, 21):
        w = _number_name(k)
        yield CodeTask(f"add_{w}", ("x",), f"returns x + {k}", f"x + {k}", _ints())
        yield CodeTask(f"subtract_{w}", ("x",), f"returns x - {k}", f"x - {k}", _ints())
        yield CodeTask(f"add_{w}_to_each", ("xs",), f"returns a new list with {k} added to every element of the list xs", f"[x + {k} for x in xs]", _int_list)
        yield CodeTask(f"count_greater_than_{w}", ("xs",), f"returns how many elements of the list xs are greater than {k}", f"sum(1 for x in xs if x > {k})", _int_list)
        yield CodeTask(f"is_greater_than_{w}", ("x",), f"returns True if x is greater than {k}, else False", f"x > {k}", _ints(-15, 15))
    for k in range(2, 17):
        w = _number_name(k)
        yield CodeTask(f"multiply_by_{w}", ("x",), f"returns x * {k}", f"x * {k}", _ints())
        yield CodeTask(f"is_divisible_by_{w}", ("x",), f"returns True if x is divisible by {k}, else False", f"x % {k} == 0", _ints(0, 100))
        yield CodeTask(f"remainder_by_{w}", ("x",), f"returns the remainder of x divided by {k}", f"x % {k}", _ints(0, 100))
        yield CodeTask(f"multiply_each_by_{w}", ("xs",), f"returns a new list with every element of the list xs multiplied by {k}", f"[x * {k} for x in xs]", _int_list)
    for k in range(2, 8):
        w = _number_name(k)
        yield CodeTask(f"repeat_{w}_times", ("s",), f"returns the string s repeated {k} times", f"s * {k}", _word)
        yield CodeTask(f"first_{w}_elements", ("xs",), f"returns the first {k} elements of the list xs", f"xs[:{k}]", _int_list)
    for a in range(2, 10):
        for b in range(1, 10):
            yield CodeTask(f"times_{_number_name(a)}_plus_{_number_name(b)}", ("x",), f"returns {a} * x + {b}", f"{a} * x + {b}", _ints())
    for c in LETTERS:
        yield CodeTask(f"count_letter_{c}", ("s",), f"returns how many times the letter '{c}' occurs in the string s", f"s.count('{c}')", _word_with(c))
        yield CodeTask(f"starts_with_{c}", ("s",), f"returns True if the string s starts with the letter '{c}', else False", f"s.startswith('{c}')", _word_with(c))
        yield CodeTask(f"ends_with_{c}", ("s",), f"returns True if the string s ends with the letter '{c}', else False", f"s.endswith('{c}')", _word_with(c))
        yield CodeTask(f"remove_letter_{c}", ("s",), f"returns the string s with every letter '{c}' removed", f"s.replace('{c}', '')", _word_with(c))
        yield CodeTask(f"append_letter_{c}", ("s",), f"returns the string s with the letter '{c}' added at the end", f"s + '{c}'", _word_with(c))
    for sep, label in (("-", "dash"), (",", "comma"), (" ", "space"), ("_", "underscore"), (":", "colon")):
        yield CodeTask(f"join_with_{label}", ("words",), f"returns the strings in the list words joined with '{sep}' between them", f"'{sep}'.join(words)", _word_list)


def _fixed() -> Iterator[CodeTask]:
    yield CodeTask("reverse_string", ("s",), "returns the string s reversed", "s[::-1]", _word)
    yield CodeTask("string_length", ("s",), "returns the number of characters in the string s", "len(s)", _word)
    yield CodeTask("to_upper", ("s",), "returns the string s in upper case", "s.upper()", _word)
    yield CodeTask("concat_strings", ("a", "b"), "returns the string a followed by the string b", "a + b", _word_pair)
    yield CodeTask("first_char", ("s",), "returns the first character of the string s", "s[0]", _word)
    yield CodeTask("last_char", ("s",), "returns the last character of the string s", "s[-1]", _word)
    yield CodeTask("is_palindrome", ("s",), "returns True if the string s reads the same backwards, else False", "s == s[::-1]", _word)
    yield CodeTask("sum_list", ("xs",), "returns the sum of the numbers in the list xs", "sum(xs)", _int_list)
    yield CodeTask("max_of_list", ("xs",), "returns the largest number in the list xs", "max(xs)", _int_list)
    yield CodeTask("min_of_list", ("xs",), "returns the smallest number in the list xs", "min(xs)", _int_list)
    yield CodeTask("list_length", ("xs",), "returns the number of elements in the list xs", "len(xs)", _int_list)
    yield CodeTask("first_element", ("xs",), "returns the first element of the list xs", "xs[0]", _int_list)
    yield CodeTask("last_element", ("xs",), "returns the last element of the list xs", "xs[-1]", _int_list)
    yield CodeTask("reverse_list", ("xs",), "returns the list xs in reverse order", "xs[::-1]", _int_list)
    yield CodeTask("sort_list", ("xs",), "returns the numbers of the list xs sorted from smallest to largest", "sorted(xs)", _int_list)
    yield CodeTask("count_evens", ("xs",), "returns how many numbers in the list xs are even", "sum(1 for x in xs if x % 2 == 0)", _int_list)
    yield CodeTask("keep_positive", ("xs",), "returns a list of the numbers in xs that are greater than 0, in order", "[x for x in xs if x > 0]", _int_list)
    yield CodeTask("max_of_two", ("a", "b"), "returns the larger of the two numbers a and b", "max(a, b)", _int_pair)
    yield CodeTask("min_of_two", ("a", "b"), "returns the smaller of the two numbers a and b", "min(a, b)", _int_pair)
    yield CodeTask("add_numbers", ("a", "b"), "returns the sum a + b", "a + b", _int_pair)
    yield CodeTask("multiply_numbers", ("a", "b"), "returns the product a * b", "a * b", _int_pair)
    yield CodeTask("difference", ("a", "b"), "returns a - b", "a - b", _int_pair)
    yield CodeTask("square", ("x",), "returns x squared", "x * x", _ints())
    yield CodeTask("absolute_value", ("x",), "returns the absolute value of x", "abs(x)", _ints())
    yield CodeTask("is_even", ("x",), "returns True if x is even, else False", "x % 2 == 0", _ints())
    yield CodeTask("is_negative", ("x",), "returns True if x is less than 0, else False", "x < 0", _ints())
    yield CodeTask("negate", ("x",), "returns -x", "-x", _ints())


def catalog() -> list[CodeTask]:
    """Every easy task, in a fixed order."""
    return [*_fixed(), *_parameterized()]


def parse_source(source: str) -> tuple[str, int | None]:
    """"code_tasks:easy?count=400" -> ("easy", 400); count None when not given."""
    spec = source.removeprefix(SOURCE_PREFIX)
    level, _, query = spec.partition("?")
    level = level.strip() or "easy"
    if level not in LEVELS:
        raise ValueError(f"{source!r}: unknown code task level {level!r}; expected one of {list(LEVELS)}")
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    unknown = sorted(set(options) - {"count"})
    if unknown:
        raise ValueError(f"{source!r}: unknown option(s) {unknown}; the only option is count=<rows>")
    count = options.get("count")
    if count is not None and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"{source!r}: count must be a positive integer, got {count!r}")
    return level, int(count) if count is not None else None


def code_rows(source: str, count: int, seed: int) -> list[dict[str, Any]]:
    """`count` CODE_PROBLEMS rows (without `split`) drawn from the catalog by `seed`."""
    level, _ = parse_source(source)
    tasks = catalog()
    if count > len(tasks):
        raise ValueError(f"{source!r}: asked for {count} tasks but the {level} catalog has {len(tasks)}; lower count")
    chosen = random.Random(f"code_tasks/{level}/{seed}").sample(tasks, count)
    return [_row(task, level, seed) for task in chosen]


def _row(task: CodeTask, level: str, seed: int) -> dict[str, Any]:
    rng = random.Random(f"code_tasks/{level}/{seed}/{task.name}")
    reference = task.reference()
    asserts = []
    for _ in range(TESTS_PER_TASK):
        args = task.make_inputs(rng)
        expected = reference(*args)
        asserts.append(f"    assert candidate({', '.join(map(repr, args))}) == {expected!r}")
    return {
        "row_id": f"{SOURCE_PREFIX}{level}/{task.name}",
        "source": f"{SOURCE_PREFIX}{level}",
        "prompt": f"Write a Python function `{task.name}({', '.join(task.params)})` that {task.description}. {INSTRUCTION}",
        "starter_code": task.signature + "\n",
        "entry_point": task.name,
        "test_code": "def check(candidate):\n" + "\n".join(asserts) + "\n",
        "tests": [],
        "reference_solution": task.reference_solution,
    }
