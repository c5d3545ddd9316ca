"""Trajectories -> training datums for the RL losses.

A trajectory is a list of (observation, action) turns. Turns are concatenated into one token sequence
as long as each observation *extends* the sequence so far (it starts with every earlier observation and
action token): a multi-turn chat whose history is re-rendered unchanged is then one datum, trained in one
forward pass. When an observation does not extend it (the env rewrote history, e.g. stripped reasoning),
the sequence so far becomes a datum and a new one starts.

Per token of the sequence: observation tokens get mask 0, advantage 0 and logprob 0; action tokens get
mask 1, the trajectory's advantage and the sampler's logprob. Then the usual shift: position i of
``model_input`` predicts ``target_tokens[i]`` = token i+1, so every per-token array drops its first entry.
``mask`` stays in the datum for metrics and KL; :func:`loss_inputs` removes it before a datum is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tinker

from posttrain.rl.types import Trajectory, TrajectoryGroup

MASK_KEY = "mask"


@dataclass(frozen=True)
class DatumSource:
    """Which trajectory a datum came from (to attribute metrics and rows)."""

    group: int
    trajectory: int


@dataclass
class _Sequence:
    tokens: list[int]
    logprobs: list[float]
    advantages: list[float]
    mask: list[float]

    def extend(self, tokens: list[int], logprobs: list[float], advantage: float, is_action: bool) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if is_action else [0.0] * len(tokens)
        self.advantages += [advantage if is_action else 0.0] * len(tokens)
        self.mask += [1.0 if is_action else 0.0] * len(tokens)

    def to_datum(self) -> tinker.Datum:
        return tinker.Datum(
            model_input=tinker.ModelInput.from_ints(self.tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(self.tokens[1:], dtype=np.int64),
                "logprobs": np.asarray(self.logprobs[1:], dtype=np.float32),
                "advantages": np.asarray(self.advantages[1:], dtype=np.float32),
                MASK_KEY: np.asarray(self.mask[1:], dtype=np.float32),
            },
        )


def observation_tokens(observation: tinker.ModelInput) -> list[int]:
    """The tokens of a text-only observation (image chunks have no RL support here yet)."""
    try:
        return list(observation.to_ints())
    except (ValueError, TypeError) as error:
        raise ValueError(f"RL observations must be token-only ModelInputs: {error}") from error


def trajectory_to_datums(trajectory: Trajectory, advantage: float) -> list[tinker.Datum]:
    datums: list[tinker.Datum] = []
    current = _Sequence([], [], [], [])
    for transition in trajectory.transitions:
        observation = observation_tokens(transition.observation)
        if current.tokens and observation[: len(current.tokens)] == current.tokens:
            new_observation = observation[len(current.tokens) :]
        else:
            if current.tokens:
                datums.append(current.to_datum())
                current = _Sequence([], [], [], [])
            new_observation = observation
        current.extend(new_observation, [], advantage, is_action=False)
        action = transition.action
        current.extend(list(action.tokens), list(action.logprobs), advantage, is_action=True)
    if len(current.tokens) >= 2:
        datums.append(current.to_datum())
    return datums


def assemble_datums(groups_P: list[TrajectoryGroup], advantages_P: list[np.ndarray]) -> tuple[list[tinker.Datum], list[DatumSource]]:
    """Every trajectory's datums, with the (group, trajectory) each came from."""
    datums: list[tinker.Datum] = []
    sources: list[DatumSource] = []
    for group_index, (group, advantages_G) in enumerate(zip(groups_P, advantages_P, strict=True)):
        for trajectory_index, (trajectory, advantage) in enumerate(zip(group.trajectories_G, advantages_G, strict=True)):
            for datum in trajectory_to_datums(trajectory, float(advantage)):
                datums.append(datum)
                sources.append(DatumSource(group_index, trajectory_index))
    return datums, sources


def mask_of(datum: tinker.Datum) -> np.ndarray:
    return datum.loss_fn_inputs[MASK_KEY].to_numpy().astype(np.float64)


def array_of(datum: tinker.Datum, key: str) -> np.ndarray:
    return datum.loss_fn_inputs[key].to_numpy().astype(np.float64)


def with_advantages(datum: tinker.Datum, advantages: np.ndarray) -> tinker.Datum:
    inputs = dict(datum.loss_fn_inputs)
    inputs["advantages"] = np.asarray(advantages, dtype=np.float32)
    return tinker.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)


def loss_inputs(datum: tinker.Datum, loss_fn: str) -> tinker.Datum:
    """The datum as a loss receives it: without ``mask`` (hosted Tinker accepts only its own keys);
    GSPO's sequence ratio averages over the sampled tokens, so it gets the mask as ``sequence_ratio_mask``."""
    inputs = {key: value for key, value in datum.loss_fn_inputs.items() if key != MASK_KEY}
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = datum.loss_fn_inputs[MASK_KEY]
    return tinker.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)
