"""A multi-turn env: guess a secret integer, told "higher" or "lower" after each wrong guess.

Reward 1 when a guess hits the secret within ``max_turns`` turns, else 0 (the episode ends at the hit or
after the last turn). Each next observation is the whole conversation re-rendered, so with a renderer
whose history renders unchanged the turns of an episode merge into one training datum.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.completers import ChatRenderer, StopCondition, message_text
from posttrain.eval.answers import last_number, to_number
from posttrain.rl.types import Action, Env, EnvGroupBuilder, Observation, RLDataset, StepResult


def instructions(low: int, high: int, max_turns: int) -> str:
    return (
        f"I am thinking of a whole number between {low} and {high}. You have {max_turns} guesses. "
        "Reply with just your guess; I will say higher or lower."
    )


class GuessNumberEnv(Env):
    def __init__(self, renderer: ChatRenderer, secret: int, *, low: int = 1, high: int = 100, max_turns: int = 7):
        if not low <= secret <= high:
            raise ValueError(f"guess_number: secret {secret} is outside [{low}, {high}]")
        if max_turns < 1:
            raise ValueError(f"guess_number: max_turns must be >= 1, got {max_turns}")
        self.renderer = renderer
        self.secret = secret
        self.max_turns = max_turns
        self.turns = 0
        self.messages: list[dict[str, str]] = [{"role": "user", "content": instructions(low, high, max_turns)}]

    def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.renderer.build_generation_prompt(self.messages), self.renderer.get_stop_sequences()

    def step(self, action: Action) -> StepResult:
        self.turns += 1
        message, _ = self.renderer.parse_response(list(action))
        text = message_text(message)
        guess = _guess(text)
        solved = guess == self.secret
        done = solved or self.turns >= self.max_turns
        metrics = {"solved": float(solved), "correct": float(solved), "turns": float(self.turns), "parsed_guess": float(guess is not None)}
        if done:
            return StepResult(reward=1.0 if solved else 0.0, episode_done=True, metrics=metrics)
        self.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": _feedback(guess, self.secret)}]
        return StepResult(
            reward=0.0,
            episode_done=False,
            next_observation=self.renderer.build_generation_prompt(self.messages),
            next_stop=self.renderer.get_stop_sequences(),
            metrics=metrics,
        )


def _guess(text: str) -> int | None:
    number = last_number(text)
    value = to_number(number) if number is not None else None
    return int(value) if value is not None and value.is_integer() else None


def _feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return "I could not read a number. Reply with just your guess."
    return "Higher." if guess < secret else "Lower."


@dataclass(frozen=True)
class GuessNumberGroupBuilder(EnvGroupBuilder):
    renderer: ChatRenderer
    secret: int
    group_size: int
    low: int = 1
    high: int = 100
    max_turns: int = 7

    def make_envs(self) -> Sequence[Env]:
        return [
            GuessNumberEnv(self.renderer, self.secret, low=self.low, high=self.high, max_turns=self.max_turns)
            for _ in range(self.group_size)
        ]

    def logging_tags(self) -> list[str]:
        return ["guess_number"]


class GuessNumberDataset(RLDataset):
    """Secrets drawn from (seed, batch index); one secret per group."""

    def __init__(
        self,
        renderer: ChatRenderer,
        *,
        group_size: int,
        groups_per_batch: int,
        num_batches: int,
        seed: int = 0,
        low: int = 1,
        high: int = 100,
        max_turns: int = 7,
    ):
        if min(group_size, groups_per_batch, num_batches, max_turns) < 1 or low > high:
            raise ValueError(
                f"guess_number: group_size ({group_size}), groups_per_batch ({groups_per_batch}), num_batches "
                f"({num_batches}) and max_turns ({max_turns}) must be >= 1, and low ({low}) <= high ({high})"
            )
        self.renderer = renderer
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.num_batches = num_batches
        self.seed = seed
        self.low, self.high, self.max_turns = low, high, max_turns

    def __len__(self) -> int:
        return self.num_batches

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside this dataset's {len(self)} batches")
        rng = random.Random(f"guess_number:{self.seed}:{index}")
        return [
            GuessNumberGroupBuilder(self.renderer, rng.randint(self.low, self.high), self.group_size, self.low, self.high, self.max_turns)
            for _ in range(self.groups_per_batch)
        ]

    def identity(self) -> dict[str, object]:
        return {
            "dataset": "guess_number",
            "group_size": self.group_size,
            "groups_per_batch": self.groups_per_batch,
            "num_batches": self.num_batches,
            "seed": self.seed,
            "range": [self.low, self.high],
            "max_turns": self.max_turns,
        }
