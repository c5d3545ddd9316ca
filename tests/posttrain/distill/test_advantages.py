"""The reverse-KL advantage formula on fixed logprobs, teacher routing, the tokenizer refusal and config errors."""

import numpy as np
import pytest
import tinker

from posttrain.datasets.tokens import TokenizerIdentity, tokenizer_identity
from posttrain.distill import (
    DistillConfig,
    Teacher,
    TeacherRouting,
    TeacherTokenizerMismatch,
    add_teacher_advantages,
    check_teacher_tokenizers,
    reverse_kl_advantages,
)
from posttrain.distill.teachers import dataset_of
from posttrain.rl.envs.problem_env import ProblemGroupBuilder
from posttrain.datasets.problems import RLProblem

STUDENT = np.array([-1.0, -0.5, -2.0, -0.1])
TEACHER = np.array([-1.5, -0.5, -0.5, -3.0])
MASK = np.array([0.0, 1.0, 1.0, 1.0])
SAME = TokenizerIdentity("student-model", "a" * 64)


def _teacher(name="t", digest="a" * 64):
    return Teacher(name=name, base_model="m", sampler_path=f"tinker://{name}/sampler_weights/1", tokenizer=TokenizerIdentity("m", digest))


def test_advantage_is_minus_coef_times_the_log_ratio_on_sampled_tokens_only():
    advantages = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=2.0)
    # d = student - teacher = [0.5, 0, -1.5, 2.9]; the first token is an observation (mask 0)
    assert advantages == pytest.approx([0.0, 0.0, 3.0, -5.8])


def test_discount_sums_later_advantages_into_each_token():
    advantages = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=1.0, discount=0.5)
    per_token = [0.0, 0.0, 1.5, -2.9]
    expected = [per_token[0] + 0.5 * (per_token[1] + 0.5 * (per_token[2] + 0.5 * per_token[3])),
                per_token[1] + 0.5 * (per_token[2] + 0.5 * per_token[3]),
                per_token[2] + 0.5 * per_token[3],
                per_token[3]]
    assert advantages == pytest.approx(expected)


def test_teacher_advantages_are_added_to_the_task_advantage_and_kl_is_per_sampled_token():
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 4, 5], dtype=np.int64),
            "logprobs": STUDENT.astype(np.float32),
            "advantages": (MASK * 0.25).astype(np.float32),
            "mask": MASK.astype(np.float32),
        },
    )
    (updated,), scores = add_teacher_advantages([datum], [TEACHER], coef=1.0)
    assert updated.loss_fn_inputs["advantages"].to_numpy() == pytest.approx([0.0, 0.25, 1.75, -2.65])
    assert scores.mean_kl() == pytest.approx((0.0 - 1.5 + 2.9) / 3)  # observation token excluded


@pytest.mark.parametrize("coef, discount, wrong", [(-1.0, 0.0, "kl_coef"), (1.0, 1.0, "kl_discount")])
def test_bad_coefficients_are_refused_by_name(coef, discount, wrong):
    with pytest.raises(ValueError, match=wrong):
        reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=coef, discount=discount)


def test_misaligned_teacher_logprobs_are_refused():
    with pytest.raises(ValueError, match="align token for token"):
        reverse_kl_advantages(STUDENT, TEACHER[:3], MASK, coef=1.0)


def test_groups_route_to_the_teacher_of_their_dataset_and_star_catches_the_rest():
    add, other = _teacher("add"), _teacher("other")
    routing = TeacherRouting({"add": add, "*": other})
    problem = RLProblem("r1", "train", "add", "What is 1 + 2?", "3", "", "{}")
    builder = ProblemGroupBuilder(renderer=None, problem=problem, group_size=2)
    assert dataset_of(builder, "problems") == "add" and routing.teacher_for("add") is add
    assert routing.teacher_for("mul") is other
    untagged = ProblemGroupBuilder(renderer=None, problem=RLProblem("r2", "train", "", "q", "1", "", "{}"), group_size=2)
    assert dataset_of(untagged, "arithmetic") == "arithmetic"
    with pytest.raises(ValueError, match="no teacher for dataset 'mul'.*add 'mul' or '\\*'"):
        TeacherRouting({"add": add}).teacher_for("mul")


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(qwen3_tokenizer):
    from tests.posttrain.supervised.tiny_data import tiny_tokenizer

    student = tokenizer_identity(tiny_tokenizer(), "localtinker/tiny-random")
    qwen = Teacher("qwen-teacher", "Qwen/Qwen3-8B", None, tokenizer_identity(qwen3_tokenizer, "Qwen/Qwen3-8B"))
    check_teacher_tokenizers(student, TeacherRouting({"*": Teacher("same", "m", None, student)}))
    with pytest.raises(TeacherTokenizerMismatch) as error:
        check_teacher_tokenizers(student, TeacherRouting({"add": qwen}))
    message = str(error.value)
    assert "'Qwen/Qwen3-8B'" in message and "'localtinker/tiny-random'" in message and "qwen-teacher" in message
    assert student.digest[:12] in message and qwen.tokenizer.digest[:12] in message


@pytest.mark.parametrize(
    "overrides, wrong",
    [
        ({"kl_coef": 0.0}, "both 0"),
        ({"kl_discount": 1.5}, "kl_discount"),
        ({"teachers": {}}, "teachers is empty"),
        ({"teachers": {" ": ""}}, "empty dataset name"),
        ({"temperature": 0.0}, "temperature"),
        ({"group_size": 0}, "group_size"),
    ],
)
def test_config_errors_name_the_field(overrides, wrong):
    with pytest.raises(ValueError, match=wrong):
        DistillConfig(**overrides).validate()


def test_config_maps_to_an_importance_sampling_rl_config_that_keeps_constant_groups():
    rl = DistillConfig(group_size=3).rl_config()
    assert rl.loss_fn == "importance_sampling" and not rl.remove_constant_reward_groups and rl.group_size == 3
