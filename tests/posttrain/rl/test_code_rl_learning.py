"""Code RL learns on the real SmolLM2-135M-Instruct: held-out pass rate at temperature 1 rises (slow: CPU minutes).

The base model is already right greedily on most easy tasks, but far less often when sampling at
temperature 1; a few RL steps on the train split raise the sampled pass rate on *held-out* tasks.
"""

import pytest

from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.problems import code_problems_from_table
from posttrain.eval.base import EvalTarget
from posttrain.eval.code_pass import evaluate_code_pass
from posttrain.renderers import get_renderer
from posttrain.rl.config import RLConfig
from posttrain.rl.envs import build_rl_dataset
from posttrain.rl.recipe import RLRecipe
from posttrain.training.config import TrainingConfig
from posttrain.training.core import train

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HELDOUT_PROBLEMS = 20
STEPS, GROUP_SIZE, GROUPS_PER_BATCH, LEARNING_RATE = 8, 4, 4, 2e-4


@pytest.mark.slow
def test_rl_on_generated_code_tasks_raises_held_out_sampled_pass_rate(service_client, smollm2_tokenizer, tmp_path):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    table = load(LoadSpec(kind="code", source="code_tasks:easy?count=400", heldout_fraction=0.1)).table
    heldout = code_problems_from_table(table, "heldout")[:HELDOUT_PROBLEMS]
    before = evaluate_code_pass(EvalTarget.from_base_model(service_client, MODEL, smollm2_tokenizer), renderer, heldout, k=4, max_tokens=96)

    training = TrainingConfig(base_model=MODEL, lora_rank=16, learning_rate=LEARNING_RATE, lr_schedule="constant",
                              max_steps=STEPS, log_dir=str(tmp_path / "run"), seed=0, save_every=0)
    config = RLConfig(training=training, env="code", group_size=GROUP_SIZE, groups_per_batch=GROUPS_PER_BATCH, max_tokens=64)
    dataset = build_rl_dataset("code", renderer, group_size=GROUP_SIZE, groups_per_batch=GROUPS_PER_BATCH, seed=0, table=table)
    result = train(training, RLRecipe(config, dataset, smollm2_tokenizer), service_client)
    after = evaluate_code_pass(EvalTarget.from_checkpoint(service_client, result.sampler_path, smollm2_tokenizer), renderer, heldout, k=4, max_tokens=96)

    print(f"held-out code tasks, base: {before.metrics()}\nafter {STEPS} RL steps: {after.metrics()}")  # pytest -s shows it
    # Measured (2 loaded CPU cores, ~45 min): sampled pass@1 0.35 -> 0.525, pass@4 0.75 -> 1.0, greedy 0.90 -> 0.90.
    # Training is not bit-reproducible (which requests share a decode step depends on timing). At learning rate
    # 4e-4 greedy pass@1 ended at 0.95, 0.85, 0.60, 0.75, 0.75, 0.90 in six runs (2026-11-25, idle Zen 5); at
    # 2e-4 at 0.95, 0.90, 0.90, with sampled pass@1 0.45, 0.4875, 0.4375 and pass@4 0.95, 1.0, 0.95.
    assert after.sampled_pass_at_1 > before.sampled_pass_at_1, (before.metrics(), after.metrics())
    assert after.pass_at_k >= before.pass_at_k and after.pass_at_1 >= before.pass_at_1 - 0.05  # greedy does not get worse
