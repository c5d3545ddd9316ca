"""RL against a preference model: each sample's reward is its win fraction in its group's tournament.

- :class:`PreferenceEnv` — one single-turn episode: the prompt conversation, the policy's answer. Its
  step gives no reward; the group gives it (the cookbook's ``PreferenceEnv``).
- :class:`PairwisePreferenceGroupBuilder` — ``group_size`` envs on one prompt; once all have answered,
  the pairs of the tournament (``posttrain.preference.tournament``) are judged by the preference model
  (both orders by default) and each sample's reward is ``win_fraction + format_coef·(well_formed − 1)``.
  Where the prompt comes with a verifier (an ``rl_problems`` row) the answer is also graded and logged as
  ``correct`` — a metric, never a reward, so it shows whether the preference model is being gamed. On the
  pairs of one right and one wrong answer, the group also logs how often the judge favours the right one
  (``judge_verifier_agreement``) and its mean probability for it (``judge_p_right``): the reward's signal,
  live, where a verifier's would be 1 and 1. A judge that answers first also has its own answer graded
  (``judge_answer_correct``): the ceiling of what its reference can teach.
  Each sample's pairwise scores (opponent, win) go to its rollout row (``pairwise_scores``, JSON).
- :class:`PreferenceDataset` — prompts in seeded batches (``posttrain.rl.envs.problem_dataset``'s
  order: a pure function of (prompts, seed, index), so resume is exact). The judge is bound by the
  recipe once its sampling client exists (:meth:`PreferenceDataset.bind`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from posttrain.completers import ChatRenderer, StopCondition, is_well_formed, message_text
from posttrain.datasets.problems import RLProblem, rl_problems_from_table
from posttrain.datasets.schemas import PREFERENCE_COMPARISONS, RL_PROBLEMS, TRAIN_SPLIT, validate_table
from posttrain.eval.answers import extract_answer
from posttrain.preference.comparison_format import Comparison
from posttrain.preference.preference_model import PreferenceModel, verdict_correct
from posttrain.preference.tournament import TOURNAMENT_PATTERNS, tournament_pairs, win_fractions
from posttrain.rl.envs.problem_dataset import batch_indices
from posttrain.rl.envs.problem_env import CORRECT_SCORE, DEFAULT_FORMAT_COEF, grader_for
from posttrain.rl.types import Action, Env, EnvGroupBuilder, Logs, Metrics, Observation, RLDataset, StepResult, Trajectory


@dataclass(frozen=True)
class PreferencePrompt:
    """A prompt conversation to answer, with its verifier when it has one."""

    row_id: str
    messages: list[dict[str, str]]
    problem: RLProblem | None = None

    def grade(self, answer_text: str) -> float | None:
        """1.0 / 0.0 by the problem's verifier, None without one."""
        if self.problem is None:
            return None
        answer = extract_answer(answer_text)
        return float(answer is not None and grader_for(self.problem)(answer) >= CORRECT_SCORE)


def prompts_from_problems(table: pa.Table, split: str | None = TRAIN_SPLIT, system: str | None = None) -> list[PreferencePrompt]:
    """An ``rl_problems`` table's questions as prompts, each with its verifier."""
    validate_table(table, RL_PROBLEMS)
    prefix = [{"role": "system", "content": system}] if system else []
    return [
        PreferencePrompt(problem.row_id, [*prefix, {"role": "user", "content": problem.question}], problem)
        for problem in rl_problems_from_table(table, split)
    ]


def prompts_from_comparisons(table: pa.Table, split: str | None = TRAIN_SPLIT) -> list[PreferencePrompt]:
    """The distinct prompt conversations of a ``preference_comparisons`` table (no verifier)."""
    validate_table(table, PREFERENCE_COMPARISONS)
    if split is not None:
        table = table.filter(pc.equal(table.column("split"), split))
    seen: dict[str, PreferencePrompt] = {}
    for row in table.select(["row_id", "prompt"]).to_pylist():
        key = json.dumps(row["prompt"], sort_keys=True)
        seen.setdefault(key, PreferencePrompt(row["row_id"], list(row["prompt"])))
    return list(seen.values())


class PreferenceEnv(Env):
    def __init__(self, renderer: ChatRenderer, prompt: PreferencePrompt):
        self.renderer = renderer
        self.prompt = prompt
        self.answer: dict[str, str] | None = None
        self.well_formed = False
        self.pairwise: list[dict[str, float]] = []  # filled by the group: [{"opponent": k, "win": w}, ...]
        self.correct: float | None = None  # by the prompt's verifier, where it has one

    def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.renderer.build_generation_prompt(self.prompt.messages), self.renderer.get_stop_sequences()

    def step(self, action: Action) -> StepResult:
        message, termination = self.renderer.parse_response(list(action))
        self.answer = {"role": "assistant", "content": message_text(message)}
        self.well_formed = is_well_formed(termination)
        metrics = {"format": float(self.well_formed)}
        correct = self.correct = self.prompt.grade(self.answer["content"])
        if correct is not None:
            metrics["correct"] = correct
        return StepResult(reward=0.0, episode_done=True, metrics=metrics)


@dataclass(frozen=True)
class TournamentSettings:
    pattern: str = "all_pairs_one_way"
    chunk_size: int = 0
    format_coef: float = DEFAULT_FORMAT_COEF

    def __post_init__(self) -> None:
        if self.pattern not in TOURNAMENT_PATTERNS:
            raise ValueError(f"tournament pattern {self.pattern!r} is not one of {TOURNAMENT_PATTERNS}")
        if self.chunk_size < 0 or self.chunk_size == 1:
            raise ValueError(f"tournament chunk_size must be 0 (no chunks) or >= 2, got {self.chunk_size}")


@dataclass(frozen=True)
class PairwisePreferenceGroupBuilder(EnvGroupBuilder):
    renderer: ChatRenderer
    prompt: PreferencePrompt
    group_size: int
    judge: PreferenceModel
    settings: TournamentSettings = field(default_factory=TournamentSettings)

    def make_envs(self) -> Sequence[Env]:
        return [PreferenceEnv(self.renderer, self.prompt) for _ in range(self.group_size)]

    def compute_group_rewards(self, trajectories: Sequence[Trajectory], envs: Sequence[Env]) -> list[tuple[float, Metrics]]:
        answers = [env.answer for env in envs]  # type: ignore[attr-defined]
        if any(answer is None for answer in answers):
            raise RuntimeError("PairwisePreferenceGroupBuilder: a preference env finished without an answer")
        pairs = tournament_pairs(len(envs), self.settings.pattern, self.settings.chunk_size)
        verdicts = self.judge.judge([Comparison(self.prompt.messages, [answers[i]], [answers[j]]) for i, j in pairs])
        wins = win_fractions(len(envs), pairs, [verdict.second_wins for verdict in verdicts])
        for (i, j), verdict in zip(pairs, verdicts):
            envs[i].pairwise.append({"opponent": j, "win": round(verdict.first_wins, 6)})  # type: ignore[attr-defined]
            envs[j].pairwise.append({"opponent": i, "win": round(verdict.second_wins, 6)})  # type: ignore[attr-defined]
        both = [verdict for verdict in verdicts if verdict.swapped is not None]
        group_metrics: Metrics = {"comparisons": float(len(pairs)), "identical_pairs": sum(v.identical for v in verdicts) / len(verdicts)}
        if both:
            group_metrics["position_bias"] = sum(v.position_bias for v in both) / len(both)
            group_metrics["orders_agree"] = sum(bool(v.orders_agree) for v in both) / len(both)
        group_metrics |= verifier_agreement(pairs, verdicts, [env.correct for env in envs])  # type: ignore[attr-defined]
        own_answer = self.judge.own_answer(self.prompt.messages) if getattr(self.judge, "answers_first", False) else None
        if own_answer is not None and (graded := self.prompt.grade(own_answer)) is not None:
            group_metrics["judge_answer_correct"] = graded
        results = []
        for env, win in zip(envs, wins):
            format_penalty = self.settings.format_coef * (float(env.well_formed) - 1.0)  # type: ignore[attr-defined]
            results.append((win + format_penalty, {**group_metrics, "win_fraction": win}))
        return results

    def trajectory_logs(self, envs: Sequence[Env]) -> list[Logs]:
        return [{"pairwise_scores": json.dumps(env.pairwise)} for env in envs]  # type: ignore[attr-defined]

    def logging_tags(self) -> list[str]:
        return [self.prompt.problem.task] if self.prompt.problem and self.prompt.problem.task else []


def verifier_agreement(pairs: Sequence[tuple[int, int]], verdicts: Sequence, graded: Sequence[float | None]) -> Metrics:
    """On the judged pairs whose two answers the verifier grades differently: the share the judge gives to the
    right answer (a tie counts ½) and its mean probability of the right one winning; empty where no pair is."""
    right_wins = [verdict.first_wins if graded[i] > graded[j] else verdict.second_wins
                  for (i, j), verdict in zip(pairs, verdicts)
                  if graded[i] is not None and graded[j] is not None and graded[i] != graded[j]]
    if not right_wins:
        return {}
    agreement = [verdict_correct(w) for w in right_wins]
    return {"judge_verifier_agreement": sum(agreement) / len(agreement), "judge_p_right": sum(right_wins) / len(right_wins)}


class PreferenceDataset(RLDataset):
    """Batches of ``groups_per_batch`` prompts (seeded order per epoch), each a tournament group."""

    def __init__(
        self,
        prompts: Sequence[PreferencePrompt],
        renderer: ChatRenderer,
        *,
        group_size: int,
        groups_per_batch: int,
        seed: int = 0,
        num_epochs: int = 1,
        settings: TournamentSettings = TournamentSettings(),
    ):
        if not prompts:
            raise ValueError("PreferenceDataset got no prompts: check the prompt table's split and row count")
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 for a tournament, got {group_size}")
        if groups_per_batch < 1 or num_epochs < 1:
            raise ValueError(f"groups_per_batch ({groups_per_batch}) and num_epochs ({num_epochs}) must be >= 1")
        if groups_per_batch > len(prompts):
            raise ValueError(f"groups_per_batch={groups_per_batch} exceeds the {len(prompts)} prompts; lower it or add prompts")
        tournament_pairs(group_size, settings.pattern, settings.chunk_size)  # refuses a bad pattern or chunking now
        self.prompts = list(prompts)
        self.renderer = renderer
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.seed = seed
        self.num_epochs = num_epochs
        self.settings = settings
        self.judge: PreferenceModel | None = None

    def bind(self, judge: PreferenceModel) -> None:
        self.judge = judge

    def __len__(self) -> int:
        return (len(self.prompts) // self.groups_per_batch) * self.num_epochs

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if self.judge is None:
            raise RuntimeError("PreferenceDataset.get_batch before bind(judge): the RLHF recipe binds the preference model in start()")
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside this dataset's {len(self)} batches")
        chosen = batch_indices(len(self.prompts), self.groups_per_batch, self.seed, index)
        return [PairwisePreferenceGroupBuilder(self.renderer, self.prompts[i], self.group_size, self.judge, self.settings) for i in chosen]

    def identity(self) -> dict[str, object]:
        digest = hashlib.sha256("\n".join(p.row_id for p in self.prompts).encode()).hexdigest()[:16]
        return {
            "dataset": type(self).__name__,
            "prompts_digest": digest,
            "num_prompts": len(self.prompts),
            "group_size": self.group_size,
            "groups_per_batch": self.groups_per_batch,
            "seed": self.seed,
            "num_epochs": self.num_epochs,
            "tournament": self.settings.pattern,
            "chunk_size": self.settings.chunk_size,
            "format_coef": self.settings.format_coef,
        }
