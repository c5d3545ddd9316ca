"""The preference-model and RLHF recipes on the real SDK against localtinker's tiny random model."""

import json

import pytest

from posttrain.preference.comparison_eval import PreferenceAccuracyEvaluator
from posttrain.preference.comparison_format import ComparisonRenderer, labeled_comparisons_from_table
from posttrain.preference.env import PreferenceDataset, TournamentSettings, prompts_from_comparisons
from posttrain.preference.rlhf import PreferenceModelConfig, PreferenceModelRecipe, RLHFConfig, RLHFRecipe
from posttrain.renderers import get_renderer
from posttrain.training.config import TrainingConfig
from posttrain.training.core import train
from posttrain.training.rows import JsonlRowSink
from tests.posttrain.preference.tiny_pairs import TINY_MODEL, comparisons_table, tiny_tokenizer


def training(tmp_path, name, **overrides) -> TrainingConfig:
    return TrainingConfig(base_model=TINY_MODEL, lora_rank=4, learning_rate=1e-3, log_dir=str(tmp_path / name), seed=1, **overrides)


@pytest.mark.slow
def test_a_preference_model_trains_then_judges_rlhf_groups_whose_rows_carry_pairwise_scores(service_client, tmp_path):
    table = comparisons_table(12, heldout_every=4)
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    pm_config = PreferenceModelConfig(training=training(tmp_path, "pm", max_steps=2), batch_size=4)
    pm_recipe = PreferenceModelRecipe(pm_config, labeled_comparisons_from_table(table, "train"), renderer)
    assert pm_recipe.num_steps() == 2 * 9 // 4 and pm_recipe.identity()["orders"] == "both"
    heldout = [c.comparison for c in labeled_comparisons_from_table(table, "heldout") if c.label == "A"]
    pm = train(pm_config.training, pm_recipe, service_client, evaluators=[PreferenceAccuracyEvaluator(heldout, renderer)])
    assert pm.sampler_path.startswith("tinker://") and 0.0 <= pm.final_metrics["eval/comparison_accuracy"] <= 1.0
    assert 0.0 <= pm.final_metrics["eval/orders_agree"] <= 1.0

    config = RLHFConfig(training=training(tmp_path, "rlhf", max_steps=1), group_size=3, groups_per_batch=2, max_tokens=4,
                        loss_fn="ppo", kl_penalty_coef=0.01, kl_reference="base", remove_constant_reward_groups=False)
    config.validate()
    dataset = PreferenceDataset(prompts_from_comparisons(table), renderer.renderer, group_size=3, groups_per_batch=2,
                                settings=TournamentSettings(config.tournament, config.tournament_chunk_size, config.format_coef))
    rows = JsonlRowSink(tmp_path / "rollouts.jsonl")
    result = train(config.training, RLHFRecipe(config, dataset, renderer, pm.sampler_path, tiny_tokenizer()), service_client, row_sinks=[rows])
    assert result.total_steps == 1 and result.final_metrics["env/comparisons"] == 3.0
    assert "kl_policy_reference" in result.final_metrics and "env/position_bias" in result.final_metrics
    written = rows.read()
    assert len(written) == 6
    for row in written:
        scores = json.loads(row["pairwise_scores"])
        assert len(scores) == 2  # one way in a group of 3: two opponents each
        win = sum(s["win"] for s in scores) / 2
        assert win - config.format_coef - 1e-6 <= row["reward"] <= win + 1e-6  # win fraction, minus the format penalty


def test_rlhf_refuses_a_judge_that_is_not_a_tinker_path_and_a_bad_tournament(tmp_path):
    config = RLHFConfig(training=training(tmp_path, "x"), tournament="swiss")
    assert any("tournament 'swiss'" in problem for problem in config.problems())
    assert any("group_size" in p for p in RLHFConfig(training=training(tmp_path, "x"), group_size=1).problems())
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    dataset = PreferenceDataset(prompts_from_comparisons(comparisons_table(4)), renderer.renderer, group_size=2, groups_per_batch=1)
    with pytest.raises(ValueError, match="sampler_weights"):
        RLHFRecipe(RLHFConfig(training=training(tmp_path, "y")), dataset, renderer, "latest:preference_model")
    with pytest.raises(ValueError, match="no comparisons"):
        PreferenceModelRecipe(PreferenceModelConfig(training=training(tmp_path, "z")), [], renderer)


def test_rlhf_measures_its_kl_from_the_sft_parent_it_starts_from(tmp_path):
    """The choice itself is the RL recipe's (tests/posttrain/rl/test_recipe.py); RLHF passes its parent through."""
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    dataset = PreferenceDataset(prompts_from_comparisons(comparisons_table(4)), renderer.renderer, group_size=2, groups_per_batch=1)
    judge, parent = "tinker://pm/sampler_weights/1", "tinker://sft/sampler_weights/40"
    config = RLHFConfig(training=training(tmp_path, "b", init_from="tinker://sft/weights/40"), kl_penalty_coef=0.05)
    recipe = RLHFRecipe(config, dataset, renderer, judge, None, parent)
    assert recipe.identity()["rl"]["kl_reference"] == parent and recipe.identity()["preference_model"] == judge
