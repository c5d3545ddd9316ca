"""The RL recipe on the real SDK against localtinker's tiny random model."""

import pytest
import tinker

from posttrain.renderers import get_renderer
from posttrain.rl.config import RLConfig
from posttrain.rl.envs import build_rl_dataset
from posttrain.rl.recipe import RLRecipe
from posttrain.training.config import TrainingConfig
from posttrain.training.core import train
from tests.fixtures.server import TINY_MODEL
from tests.posttrain.supervised.tiny_data import tiny_tokenizer

LOSS_CONFIGS = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 3.0},
    "dro": {"beta": 0.05},
}


class RecordingTrainingClient:
    """The real training client, with each forward_backward call's loss name, config and datums recorded."""

    def __init__(self, client: tinker.TrainingClient):
        self._client = client
        self.calls: list[tuple[str, dict | None, list[tinker.Datum]]] = []

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        self.calls.append((loss_fn, loss_fn_config, list(data)))
        return self._client.forward_backward(data, loss_fn, loss_fn_config)

    def __getattr__(self, name):
        return getattr(self._client, name)


def make_config(tmp_path, **overrides) -> RLConfig:
    training = TrainingConfig(base_model=TINY_MODEL, lora_rank=4, learning_rate=1e-3, log_dir=str(tmp_path / "run"), seed=3)
    values = dict(group_size=3, groups_per_batch=4, max_tokens=6, num_batches=3)
    values.update(overrides)
    return RLConfig(training=training, **values)


def recipe_for(config: RLConfig, env: str = "arithmetic") -> RLRecipe:
    renderer = get_renderer("chatml", tiny_tokenizer())
    dataset = build_rl_dataset(env, renderer, group_size=config.group_size, groups_per_batch=config.groups_per_batch,
                               seed=config.training.seed, num_batches=config.num_batches, options=config.env_options)
    return RLRecipe(config, dataset, tiny_tokenizer())


@pytest.mark.parametrize("mode", ["sync", "streaming"])
def test_each_loss_is_sent_with_its_config_and_a_step_reports_rows_and_metrics(service_client, tmp_path, mode):
    client = RecordingTrainingClient(service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result())
    for loss_fn, loss_config in LOSS_CONFIGS.items():
        config = make_config(tmp_path, loss_fn=loss_fn, loss_fn_config=loss_config, mode=mode, num_substeps=2,
                             remove_constant_reward_groups=False)
        recipe = recipe_for(config)
        recipe.start(client, service_client, 0)
        client.calls.clear()
        outcome = recipe.submit_step(0, client, tinker.AdamParams(learning_rate=1e-3)).result()
        recipe.close()

        assert len(client.calls) == 2  # num_substeps forward_backward calls, then one optim_step
        assert all(call[0] == loss_fn and call[1] == (loss_config or None) for call in client.calls)
        sent = [datum for call in client.calls for datum in call[2]]
        assert len(sent) == 12 and all(set(d.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"} for d in sent)
        assert len(outcome.rows) == 12
        row = outcome.rows[0]
        assert row["sampler_path"].startswith("tinker://") and row["sampler_step"] == 0 and row["num_turns"] == 1
        assert len(row["completion_tokens"]) == len(row["sampler_logprobs"]) and row["prompt"].count("What is") == 1
        for group in {r["group"] for r in outcome.rows}:
            members = [r for r in outcome.rows if r["group"] == group]
            mean = sum(r["reward"] for r in members) / len(members)
            assert [r["advantage"] for r in members] == pytest.approx([r["reward"] - mean for r in members], abs=1e-9)
        metrics = outcome.metrics
        assert metrics["reward/mean"] == pytest.approx(sum(r["reward"] for r in outcome.rows) / 12)
        assert metrics["num_groups"] == 4 and "accuracy" in metrics
        assert not [key for key in metrics if key.startswith(("staleness/", "async/"))]  # sync: no all-zero off-policy series
        # On-policy: the learner reproduces the sampler's logprobs (float32 numerics only).
        assert abs(metrics["kl_sample_train_k1"]) < 1e-3 and metrics["entropy"] > 0


def test_a_step_is_a_pure_function_of_seed_step_and_weights(service_client, tmp_path):
    config = make_config(tmp_path)
    rows = []
    for _ in range(2):
        client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
        recipe = recipe_for(config)
        recipe.start(client, service_client, 0)
        rows.append(recipe.submit_step(1, client, tinker.AdamParams(learning_rate=1e-3)).result().rows)
        recipe.close()
    assert [r["completion_tokens"] for r in rows[0]] == [r["completion_tokens"] for r in rows[1]]


@pytest.mark.parametrize("policy", ["drop", "requeue"])
def test_async_mode_never_trains_on_groups_older_than_max_steps_off_policy(service_client, tmp_path, policy):
    config = make_config(tmp_path, mode="async", max_steps_off_policy=0, stale_policy=policy, num_batches=12, groups_per_batch=2)
    client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()
    recipe = recipe_for(config)
    recipe.start(client, service_client, 0)
    try:
        outcomes = [recipe.submit_step(step, client, tinker.AdamParams(learning_rate=1e-3)).result() for step in range(3)]
    finally:
        recipe.close()
    for step, outcome in enumerate(outcomes):
        assert {row["sampler_step"] for row in outcome.rows} == {step}  # off-policy by at most 0 steps
        assert outcome.metrics["staleness/max"] == 0.0
    stale_key = "async/dropped_stale_groups" if policy == "drop" else "async/requeued_stale_groups"
    assert sum(o.metrics[stale_key] for o in outcomes) >= 1  # the work-ahead was sampled by older policies
    labels = [row["group"] for o in outcomes for row in o.rows]
    if policy == "requeue":  # a requeued group is trained later, sampled again by a newer policy
        assert "0.0" in labels or "0.1" in labels


def test_bad_rl_config_is_refused_with_every_problem_named(tmp_path):
    config = make_config(tmp_path, loss_fn="reinforce", mode="turbo", group_size=0)
    with pytest.raises(ValueError) as error:
        config.validate()
    message = str(error.value)
    assert "loss_fn 'reinforce'" in message and "mode 'turbo'" in message and "group_size must be >= 1" in message
    with pytest.raises(ValueError, match="needs loss_fn_config"):
        make_config(tmp_path, loss_fn="dro").validate()


class RecordingService:
    """Records which sampler a recipe asks for (the test is about the choice, not about sampling)."""

    def __init__(self):
        self.calls: list[dict] = []

    def create_sampling_client(self, **kwargs):
        self.calls.append(kwargs)
        return type("Done", (), {"result": lambda _self: kwargs})()


def test_the_kl_penalty_is_measured_from_the_parent_checkpoint_unless_base_is_asked_for(tmp_path):
    renderer = get_renderer("chatml", tiny_tokenizer())
    dataset = build_rl_dataset("arithmetic", renderer, group_size=2, groups_per_batch=1, seed=0, num_batches=1)
    parent_state, parent_sampler = "tinker://sft/weights/40", "tinker://sft/sampler_weights/40"

    def config(**overrides) -> RLConfig:
        values = {"kl_penalty_coef": 0.05, **overrides}
        init_from = values.pop("init_from", parent_state)
        made = make_config(tmp_path, **values)
        made.training.init_from = init_from
        return made

    with pytest.raises(ValueError, match="kl_reference='parent' needs the sampler weights of the parent checkpoint tinker://sft/weights/40"):
        RLRecipe(config(), dataset)
    service = RecordingService()
    from_parent = RLRecipe(config(), dataset, None, parent_sampler)
    assert from_parent.kl_reference(service) == {"model_path": parent_sampler}
    assert from_parent.identity()["rl"]["kl_reference"] == parent_sampler
    from_base = RLRecipe(config(kl_reference="base"), dataset, None, parent_sampler)
    assert from_base.kl_reference(service) == {"base_model": TINY_MODEL} and from_base.identity()["rl"]["kl_reference"] == "base"
    # A run that starts from no checkpoint has the base model as its parent.
    fresh = RLRecipe(config(init_from=None), dataset, None, parent_sampler)
    assert fresh.kl_reference(service) == {"base_model": TINY_MODEL} and fresh.identity()["rl"]["kl_reference"] == "base"
    assert any("kl_reference 'sft'" in problem for problem in config(kl_reference="sft").problems())


def test_rl_recipe_trains_through_the_core_with_checkpoints_and_rows(service_client, tmp_path):
    config = make_config(tmp_path, num_batches=2, kl_penalty_coef=0.05)
    config.training.save_every = 1
    sink_rows = []

    class Sink:
        def write_rows(self, step, rows):
            sink_rows.extend(rows)

        def truncate_from(self, step):
            sink_rows[:] = [row for row in sink_rows if row["step"] < step]

    result = train(config.training, recipe_for(config), service_client, row_sinks=[Sink()])
    assert result.total_steps == 2 and [c.batch for c in result.checkpoints] == [1, 2]
    assert sorted({row["step"] for row in sink_rows}) == [0, 1] and len(sink_rows) == 24
    assert "kl_policy_reference" in result.final_metrics or "reward/mean" in result.final_metrics
