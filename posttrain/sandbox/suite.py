"""The tests of a code problem (posttrain.datasets CODE_PROBLEMS row) as something the sandbox runs.

Three test shapes occur in the data: HumanEval's `check(candidate)` program (`test_code` +
`entry_point`), stdin/stdout cases (DeepCoder, LiveCodeBench, TACO "stdin"), and functional cases
whose input is one JSON value per line, passed as arguments to `entry_point` (a plain function, or a
method of LeetCode's `class Solution`) and whose output is the JSON of the return value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.sandbox.limits import Limits
from posttrain.sandbox.result import ExecutionResult
from posttrain.sandbox.runner import StdinCase, run_stdin_tests, run_tests

FUNCTIONAL_PRELUDE = "from typing import *\n"
"""LeetCode-style starter code annotates with `List[int]` without importing it; graders prepend this."""

_FUNCTIONAL_RUNNER = '''
import json as _json

def _posttrain_candidate():
    solution = globals().get("Solution")
    if solution is not None and hasattr(solution, {name!r}):
        return getattr(solution(), {name!r})
    return globals()[{name!r}]

def _posttrain_decode(text):
    try:
        return _json.loads(text)
    except ValueError:
        return text

for _index, (_inputs, _expected) in enumerate({cases!r}):
    _args = [_posttrain_decode(line) for line in _inputs.splitlines() if line.strip()]
    _got = _posttrain_candidate()(*_args)
    assert _got == _posttrain_decode(_expected), f"case {{_index}}: expected {{_expected[:200]!r}}, got {{_got!r:.200}}"
'''


@dataclass(frozen=True)
class ProblemTests:
    """`test_code` runs in the program's namespace after it (empty when there is none); `stdin_cases`
    each run the program as a script. `prelude` is prepended to the program before running."""

    test_code: str = ""
    stdin_cases: tuple[StdinCase, ...] = ()
    prelude: str = ""

    def __post_init__(self) -> None:
        if not self.test_code.strip() and not self.stdin_cases:
            raise ValueError("ProblemTests: no test code and no stdin cases; a problem needs at least one test")

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ProblemTests:
        """From a CODE_PROBLEMS row (dict) or a posttrain.datasets.problems.CodeProblem."""
        get = row.get if isinstance(row, Mapping) else lambda key, default=None: getattr(row, key, default)
        entry_point = get("entry_point") or ""
        parts: list[str] = []
        test_code = get("test_code") or ""
        if test_code.strip():
            if "def check(" in test_code and not entry_point:
                raise ValueError(f"problem {get('row_id')!r}: check(candidate) tests need an entry_point")
            parts.append(test_code + (f"\ncheck({entry_point})\n" if "def check(" in test_code else ""))
        cases = [_case_fields(case) for case in get("tests") or ()]
        functional = [(c["input"], c["output"]) for c in cases if c["kind"] == "functional"]
        if functional:
            if not entry_point:
                raise ValueError(f"problem {get('row_id')!r}: functional tests need an entry_point")
            parts.append(_FUNCTIONAL_RUNNER.format(name=entry_point, cases=functional))
        stdin = tuple(StdinCase(c["input"], c["output"]) for c in cases if c["kind"] == "stdin")
        return cls(test_code="\n".join(parts), stdin_cases=stdin, prelude=FUNCTIONAL_PRELUDE if functional else "")

    def run(self, program: str, limits: Limits, *, allow_rlimit_only: bool | None = None) -> ExecutionResult:
        """Run every test; the first result that is not "passed" is the outcome."""
        source = self.prelude + program
        result = None
        if self.test_code.strip():
            result = run_tests(source, self.test_code, limits=limits, allow_rlimit_only=allow_rlimit_only)
            if not result.passed:
                return result
        if self.stdin_cases:
            result = run_stdin_tests(source, self.stdin_cases, limits=limits, allow_rlimit_only=allow_rlimit_only)
        return result  # type: ignore[return-value]  # __post_init__ guarantees one of the two ran


def _case_fields(case: Any) -> dict[str, str]:
    if isinstance(case, Mapping):
        return {"input": case["input"], "output": case["output"], "kind": case["kind"]}
    return {"input": case.input, "output": case.output, "kind": case.kind}
