"""The pairwise-preference group: reward = win fraction in the group's tournament."""

import json

import pytest

from posttrain.datasets.loaders import LoadSpec, load
from posttrain.preference.env import (
    PairwisePreferenceGroupBuilder,
    PreferenceDataset,
    PreferencePrompt,
    TournamentSettings,
    prompts_from_comparisons,
    prompts_from_problems,
)
from posttrain.rl.rollouts import run_episodes
from posttrain.renderers import get_renderer
from tests.posttrain.preference.judges import ShorterIsBetter
from tests.posttrain.preference.tiny_pairs import comparisons_table, tiny_tokenizer


class ScriptedCompleter:
    """Answers prompt k of a turn with ``answers[k]`` (the rollout code asks for one sample per env)."""

    def __init__(self, renderer, answers):
        self.renderer, self.answers, self.index = renderer, answers, 0

    def submit(self, observation, stop, num_samples=1, seed=None):
        from posttrain.completers import TokensWithLogprobs

        answers = self.answers[self.index : self.index + num_samples]
        self.index += num_samples
        tokens = [self.renderer.tokenizer.encode(a + "<|im_end|>", add_special_tokens=False) for a in answers]

        class Pending:
            def result(self_inner):
                return [TokensWithLogprobs(t, [-1.0] * len(t), "stop") for t in tokens]

        return Pending()


class AnswersFirst(ShorterIsBetter):
    """A judge that, like a preference model trained with references, has answered the prompt itself."""

    answers_first = True

    def __init__(self, answer: str):
        super().__init__()
        self.answer = answer

    def own_answer(self, prompt):
        return self.answer


def rewards_for(answers, settings=TournamentSettings(format_coef=0.0), prompt=None, judge=None):
    renderer = get_renderer("chatml", tiny_tokenizer())
    prompt = prompt or PreferencePrompt("p0", [{"role": "user", "content": "Say something."}])
    judge = judge or ShorterIsBetter()
    builder = PairwisePreferenceGroupBuilder(renderer, prompt, len(answers), judge, settings)
    envs = builder.make_envs()
    trajectories = run_episodes(envs, ScriptedCompleter(renderer, answers), seed=0)
    return builder.compute_group_rewards(trajectories, envs), builder.trajectory_logs(envs), judge


def test_each_sample_is_rewarded_with_its_win_fraction():
    rewards, logs, judge = rewards_for(["a", "bbb", "cc", "bbb"])
    # "a" beats all 3; "cc" beats both "bbb"; each "bbb" loses to "a" and "cc" and ties the other
    assert [r for r, _ in rewards] == pytest.approx([1.0, 0.5 / 3, 2 / 3, 0.5 / 3])
    assert len(judge.calls) == 6  # one way: 4·3/2 comparisons
    assert all(metrics["win_fraction"] == reward for reward, metrics in rewards)
    assert rewards[0][1]["position_bias"] == 0.0 and rewards[0][1]["orders_agree"] == 1.0
    assert rewards[0][1]["identical_pairs"] == 0.0  # ShorterIsBetter judges every pair, the two "bbb" included
    scores = json.loads(logs[0]["pairwise_scores"])
    assert scores == [{"opponent": 1, "win": 1.0}, {"opponent": 2, "win": 1.0}, {"opponent": 3, "win": 1.0}]
    assert "judge_verifier_agreement" not in rewards[0][1]  # no verifier on this prompt


def test_the_judges_agreement_with_the_verifier_is_logged_on_right_against_wrong_pairs():
    """A prompt with a verifier: the judge (shorter wins) prefers the right answer over the two longer wrong ones
    and the short wrong one over it; pairs of two wrong answers say nothing about the verifier."""
    table = load(LoadSpec(kind="rl", source="reasoning_gym:basic_arithmetic", limit=2)).table
    prompt = prompts_from_problems(table, split=None)[0]
    right = prompt.problem.answer
    rewards, _, _ = rewards_for([right, "7", right + "0", right + "00"], prompt=prompt)
    metrics = rewards[0][1]
    assert metrics["judge_verifier_agreement"] == pytest.approx(2 / 3)
    assert metrics["judge_p_right"] == pytest.approx(2 / 3)
    assert [m["judge_verifier_agreement"] for _, m in rewards] == [metrics["judge_verifier_agreement"]] * 4


def test_a_judge_that_answers_first_has_its_own_answer_graded_where_the_prompt_has_a_verifier():
    table = load(LoadSpec(kind="rl", source="reasoning_gym:basic_arithmetic", limit=2)).table
    prompt = prompts_from_problems(table, split=None)[0]
    right = prompt.problem.answer
    for own, graded in ((right, 1.0), (right + "1", 0.0)):
        rewards, _, _ = rewards_for([right, "7"], prompt=prompt, judge=AnswersFirst(own))
        assert rewards[0][1]["judge_answer_correct"] == graded
    rewards, _, _ = rewards_for(["a", "bb"], judge=AnswersFirst("a"))  # no verifier: nothing to grade it with
    assert "judge_answer_correct" not in rewards[0][1]
    rewards, _, _ = rewards_for([right, "7"], prompt=prompt)  # a judge that does not answer first
    assert "judge_answer_correct" not in rewards[0][1]


def test_both_ways_and_chunks_change_who_meets_whom_not_the_meaning():
    both, _, judge = rewards_for(["a", "bbb", "cc", "bbb"], TournamentSettings("all_pairs_both_ways", format_coef=0.0))
    assert [r for r, _ in both] == pytest.approx([1.0, 0.5 / 3, 2 / 3, 0.5 / 3]) and len(judge.calls) == 12
    chunked, _, judge = rewards_for(["a", "bbb", "cc", "bbb"], TournamentSettings(chunk_size=2, format_coef=0.0))
    assert [r for r, _ in chunked] == pytest.approx([1.0, 0.0, 1.0, 0.0]) and len(judge.calls) == 2


def test_a_dataset_of_comparison_prompts_needs_its_judge_bound_and_repeats_its_batches():
    prompts = prompts_from_comparisons(comparisons_table(10, heldout_every=5), "train")
    assert len(prompts) == len({json.dumps(p.messages) for p in prompts}) and all(p.problem is None for p in prompts)
    with pytest.raises(ValueError, match="no prompts"):
        PreferenceDataset([], get_renderer("chatml", tiny_tokenizer()), group_size=2, groups_per_batch=1)
    dataset = PreferenceDataset(prompts, get_renderer("chatml", tiny_tokenizer()), group_size=2, groups_per_batch=2)
    with pytest.raises(RuntimeError, match="bind"):
        dataset.get_batch(0)
    dataset.bind(ShorterIsBetter())
    assert [b.prompt.row_id for b in dataset.get_batch(1)] == [b.prompt.row_id for b in dataset.get_batch(1)]
    assert dataset.identity()["tournament"] == "all_pairs_one_way"
