from posttrain.rl.data import MASK_KEY, assemble_datums, loss_inputs, trajectory_to_datums
from posttrain.rl.types import Trajectory
from tests.posttrain.rl.helpers import group, turn

import numpy as np


def arrays(datum):
    return {key: value.to_numpy().tolist() for key, value in datum.loss_fn_inputs.items()}


def test_single_turn_datum_is_shifted_and_masks_the_observation():
    trajectory = Trajectory([turn([10, 11, 12], [20, 21], logprobs=[-1.0, -2.0])])
    [datum] = trajectory_to_datums(trajectory, advantage=0.5)
    assert datum.model_input.to_ints() == [10, 11, 12, 20]
    values = arrays(datum)
    assert values["target_tokens"] == [11, 12, 20, 21]
    assert values[MASK_KEY] == [0.0, 0.0, 1.0, 1.0]
    assert values["logprobs"] == [0.0, 0.0, -1.0, -2.0]
    assert values["advantages"] == [0.0, 0.0, 0.5, 0.5]


def test_turns_whose_observation_extends_the_history_merge_into_one_datum():
    first = turn([1, 2], [3, 4], logprobs=[-0.1, -0.2], done=False)
    second = turn([1, 2, 3, 4, 5, 6], [7], logprobs=[-0.3])  # ob1 + ac1 + new observation tokens 5, 6
    [datum] = trajectory_to_datums(Trajectory([first, second]), advantage=-1.0)
    values = arrays(datum)
    assert datum.model_input.to_ints() == [1, 2, 3, 4, 5, 6]
    assert values["target_tokens"] == [2, 3, 4, 5, 6, 7]
    assert values[MASK_KEY] == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert np.allclose(values["logprobs"], [0.0, -0.1, -0.2, 0.0, 0.0, -0.3])
    assert values["advantages"] == [0.0, -1.0, -1.0, 0.0, 0.0, -1.0]


def test_a_turn_whose_observation_rewrites_history_starts_a_new_datum():
    first = turn([1, 2], [3], done=False)
    rewritten = turn([1, 9, 5], [6, 7])  # not a continuation of [1, 2, 3]
    first_datum, second_datum = trajectory_to_datums(Trajectory([first, rewritten]), advantage=1.0)
    assert arrays(first_datum)["target_tokens"] == [2, 3] and arrays(first_datum)[MASK_KEY] == [0.0, 1.0]
    assert second_datum.model_input.to_ints() == [1, 9, 5, 6]
    assert arrays(second_datum)[MASK_KEY] == [0.0, 0.0, 1.0, 1.0]


def test_assembled_datums_remember_their_group_and_trajectory_and_drop_the_mask_for_the_loss():
    datums, sources = assemble_datums([group([1.0, 0.0]), group([0.0, 1.0])], [np.array([0.5, -0.5]), np.array([-0.5, 0.5])])
    assert [(s.group, s.trajectory) for s in sources] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [arrays(d)["advantages"][-1] for d in datums] == [0.5, -0.5, -0.5, 0.5]
    sent = loss_inputs(datums[0], "importance_sampling")
    assert set(sent.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}
    gspo = loss_inputs(datums[0], "gspo")
    assert gspo.loss_fn_inputs["sequence_ratio_mask"].to_numpy().tolist() == arrays(datums[0])[MASK_KEY]
