"""Code RL: write a Python function, graded by its hidden tests in the sandbox.

Single turn. The model sees ``[system?, user: problem prompt]`` (the prompt asks for one ```python
block; :func:`code_prompt` adds that request when a source's prompt lacks it) and answers once.
Reward (cookbook): ``format_coef·(has_code_block − 1) + all_tests_pass`` (``posttrain.rl.code_reward``;
the program is the last fenced block).

Grading needs the whole group: ``CodeEnv.step`` only reads the answer back, and
:meth:`CodeGroupBuilder.compute_group_rewards` submits all G programs to the sandbox pool at once, so a
group's programs run concurrently (bounded by the pool) instead of one after another. Each sample's
sandbox status and the tail of its test output go to the rollout rows (``trajectory_logs``); the step
metrics get ``env/correct`` (hence ``accuracy``), ``env/has_code_block`` and the share of each status.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from posttrain.completers import ChatRenderer, StopCondition, message_text
from posttrain.datasets.problems import CodeProblem, code_problems_from_table
from posttrain.datasets.schemas import CODE_PROBLEMS, TRAIN_SPLIT, validate_table
from posttrain.rl.code_reward import FORMAT_COEF, NO_CODE_STATUS, CodeGrade, code_rewards
from posttrain.rl.envs.problem_dataset import batch_indices
from posttrain.rl.types import Action, Env, EnvGroupBuilder, Logs, Metrics, Observation, RLDataset, StepResult, Trajectory
from posttrain.sandbox import STATUSES, Limits, ProblemTests, SandboxPool

CODE_BLOCK_REQUEST = "Reply with the whole function in one ```python code block."
DEFAULT_TIMEOUT_S = 5.0  # generated tasks run in milliseconds; a hung program should not stall a step
TEST_OUTPUT_CHARS = 600  # tail of a sample's test output kept in its rollout row


def code_prompt(problem: CodeProblem) -> str:
    """The problem's prompt, with the request for a fenced python block when it does not ask for one."""
    return problem.prompt if "```python" in problem.prompt else f"{problem.prompt.rstrip()}\n\n{CODE_BLOCK_REQUEST}"


def code_messages(problem: CodeProblem, system: str | None = None) -> list[dict[str, str]]:
    """What the policy is asked, in training and in evaluation alike."""
    prefix = [{"role": "system", "content": system}] if system else []
    return prefix + [{"role": "user", "content": code_prompt(problem)}]


def test_output_tail(grade: CodeGrade) -> str:
    """The end of what the tests printed (the assertion or traceback is usually last on stderr)."""
    text = "\n".join(part for part in (grade.stdout_tail.strip(), grade.stderr_tail.strip()) if part)
    return text[-TEST_OUTPUT_CHARS:]


def grade_metrics(grade: CodeGrade) -> Metrics:
    statuses = {f"status/{status}": float(grade.status == status) for status in (*STATUSES, NO_CODE_STATUS)}
    return {"correct": float(grade.all_tests_pass), "has_code_block": float(grade.has_code_block), **statuses}


class CodeEnv(Env):
    """One answer to one problem; its grade is set by the group (see the module docstring)."""

    def __init__(self, renderer: ChatRenderer, problem: CodeProblem, *, system: str | None = None):
        self.renderer = renderer
        self.problem = problem
        self.system = system
        self.response: str | None = None
        self.grade: CodeGrade | None = None

    def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.renderer.build_generation_prompt(code_messages(self.problem, self.system)), self.renderer.get_stop_sequences()

    def step(self, action: Action) -> StepResult:
        message, _ = self.renderer.parse_response(list(action))
        self.response = message_text(message)
        return StepResult(reward=0.0, episode_done=True)


@dataclass(frozen=True)
class CodeGroupBuilder(EnvGroupBuilder):
    """``group_size`` answers to one problem, graded together through ``pool`` (None = the process pool)."""

    renderer: ChatRenderer
    problem: CodeProblem
    group_size: int
    limits: Limits
    pool: SandboxPool | None = None
    format_coef: float = FORMAT_COEF
    system: str | None = None

    def make_envs(self) -> Sequence[Env]:
        return [CodeEnv(self.renderer, self.problem, system=self.system) for _ in range(self.group_size)]

    def compute_group_rewards(self, trajectories: Sequence[Trajectory], envs: Sequence[Env]) -> list[tuple[float, Metrics]]:
        code_envs = [_answered(env) for env in envs]
        tests = ProblemTests.from_row(self.problem)
        grades = code_rewards(
            [env.response for env in code_envs], [tests] * len(code_envs), limits=self.limits, pool=self.pool, format_coef=self.format_coef
        )
        for env, grade in zip(code_envs, grades, strict=True):
            env.grade = grade
        return [(grade.reward, grade_metrics(grade)) for grade in grades]

    def trajectory_logs(self, envs: Sequence[Env]) -> list[Logs]:
        logs = []
        for env in envs:
            grade = _answered(env).grade
            if grade is None:
                raise RuntimeError("CodeGroupBuilder.trajectory_logs before compute_group_rewards: the group is not graded yet")
            logs.append({"sandbox_status": grade.status, "test_output": test_output_tail(grade)})
        return logs

    def logging_tags(self) -> list[str]:
        return ["code"]


def _answered(env: Env) -> CodeEnv:
    if not isinstance(env, CodeEnv) or env.response is None:
        raise RuntimeError(f"CodeGroupBuilder got {type(env).__name__} without an answer; grade only envs it made, after step()")
    return env


class CodeDataset(RLDataset):
    """Batches of code problems: a seeded shuffle per epoch, ``groups_per_batch`` problems per batch."""

    def __init__(
        self,
        problems: Sequence[CodeProblem],
        renderer: ChatRenderer,
        *,
        group_size: int,
        groups_per_batch: int,
        seed: int = 0,
        num_epochs: int = 1,
        format_coef: float = FORMAT_COEF,
        system: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pool: SandboxPool | None = None,
    ):
        if not problems:
            raise ValueError("CodeDataset got no problems: check the code_problems table's split and limit")
        if min(group_size, groups_per_batch, num_epochs) < 1:
            raise ValueError(
                f"code env: group_size ({group_size}), groups_per_batch ({groups_per_batch}) and num_epochs ({num_epochs}) must be >= 1"
            )
        if groups_per_batch > len(problems):
            raise ValueError(f"code env: groups_per_batch={groups_per_batch} exceeds the {len(problems)} problems; lower it or add problems")
        for problem in problems:
            ProblemTests.from_row(problem)  # a problem without runnable tests fails here, not mid-run
        self.problems = list(problems)
        self.renderer = renderer
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.seed = seed
        self.num_epochs = num_epochs
        self.format_coef = format_coef
        self.system = system
        self.limits = Limits(timeout_s=timeout_s)
        self.pool = pool

    def __len__(self) -> int:
        return len(self.problems) // self.groups_per_batch * self.num_epochs

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside this dataset's {len(self)} batches")
        return [
            CodeGroupBuilder(self.renderer, self.problems[i], self.group_size, self.limits, self.pool, self.format_coef, self.system)
            for i in batch_indices(len(self.problems), self.groups_per_batch, self.seed, index)
        ]

    def identity(self) -> dict[str, object]:
        digest = hashlib.sha256("\n".join(p.row_id for p in self.problems).encode()).hexdigest()[:16]
        return {
            "dataset": "code",
            "problems_digest": digest,
            "num_problems": len(self.problems),
            "group_size": self.group_size,
            "groups_per_batch": self.groups_per_batch,
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "format_coef": self.format_coef,
            "timeout_s": self.limits.timeout_s,
        }


def problems_from_code_table(table: pa.Table, split: str | None = TRAIN_SPLIT) -> list[CodeProblem]:
    """The problems of a ``code_problems`` table (checked against the schema), one split by default."""
    validate_table(table, CODE_PROBLEMS)
    return code_problems_from_table(table, split)
