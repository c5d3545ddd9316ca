"""On-policy distillation on the real SDK against localtinker's tiny model: routing, the advantages sent,
and exact resume after a crash (the training core's checkpoints)."""

from pathlib import Path

import numpy as np
import pytest
import tinker

from posttrain.checkpoints import last_checkpoint
from posttrain.datasets.problems import RLProblem
from posttrain.datasets.tokens import tokenizer_identity
from posttrain.distill import DistillConfig, DistillRecipe, Teacher, TeacherRouting
from posttrain.renderers import get_renderer
from posttrain.rl.envs.problem_dataset import ProblemDataset
from posttrain.rl.kl import full_sequence
from posttrain.supervised import datum_from_tokens
from posttrain.training.config import TrainingConfig
from posttrain.training.core import train
from posttrain.training.rows import JsonlRowSink
from tests.fixtures.server import TINY_MODEL
from tests.posttrain.rl.test_recipe import RecordingTrainingClient
from tests.posttrain.supervised.tiny_data import tiny_tokenizer

PROBLEMS = [
    RLProblem("a1", "train", "add", "What is 2 + 3?", "5", "", "{}"),
    RLProblem("a2", "train", "add", "What is 4 + 1?", "5", "", "{}"),
    RLProblem("m1", "train", "mul", "What is 2 * 3?", "6", "", "{}"),
    RLProblem("m2", "train", "mul", "What is 4 * 2?", "8", "", "{}"),
]


class _Crash(RuntimeError):
    pass


def make_config(tmp_path, name="run", **overrides) -> DistillConfig:
    training = TrainingConfig(base_model=TINY_MODEL, lora_rank=4, learning_rate=1e-2, log_dir=str(tmp_path / name), seed=5, save_every=2)
    values = dict(env="problems", group_size=2, groups_per_batch=4, max_tokens=6, teachers={"add": "", "mul": "perturbed"})
    values.update(overrides)
    return DistillConfig(training=training, **values)


def dataset(config: DistillConfig, epochs: int = 1) -> ProblemDataset:
    renderer = get_renderer("chatml", tiny_tokenizer())
    return ProblemDataset(PROBLEMS, renderer, group_size=config.group_size, groups_per_batch=config.groups_per_batch,
                          seed=config.training.seed, num_epochs=epochs)


@pytest.fixture(scope="module")
def perturbed_teacher_path(tinker_server) -> str:
    """Sampler weights of a tiny LoRA pushed away from the base model by one large step."""
    service = tinker.ServiceClient(base_url=tinker_server.base_url, api_key="tml-local")
    client = service.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    tokens = tiny_tokenizer().encode("The answer is 42. The answer is 42.", add_special_tokens=False)
    client.forward_backward([datum_from_tokens(tokens[:-1], tokens[1:], [1.0] * (len(tokens) - 1))], "cross_entropy").result()
    client.optim_step(tinker.AdamParams(learning_rate=0.05)).result()
    path = client.save_weights_for_sampler("perturbed-teacher").result().path
    service.close("success").result(timeout=60)
    return path


def routing(perturbed_path: str) -> TeacherRouting:
    identity = tokenizer_identity(tiny_tokenizer(), TINY_MODEL)
    return TeacherRouting({
        "add": Teacher("base", TINY_MODEL, None, identity),
        "mul": Teacher("perturbed", TINY_MODEL, perturbed_path, identity),
    })


def test_each_group_is_scored_by_its_datasets_teacher_and_advantages_are_minus_the_log_ratio(
    service_client, tmp_path, perturbed_teacher_path
):
    config = make_config(tmp_path)
    recipe = DistillRecipe(config, dataset(config), routing(perturbed_teacher_path), tiny_tokenizer())
    client = RecordingTrainingClient(service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result())
    recipe.start(client, service_client, 0)
    outcome = recipe.submit_step(0, client, tinker.AdamParams(learning_rate=1e-3)).result()
    recipe.close()

    rows = outcome.rows
    assert len(rows) == 8 and {row["dataset"] for row in rows} == {"add", "mul"}
    for row in rows:
        assert row["teacher"] == ("base" if row["dataset"] == "add" else "perturbed")
        if row["dataset"] == "add":  # a fresh LoRA (B = 0) is its base model: no KL to it
            assert abs(row["teacher_kl"]) < 1e-3
        else:
            assert abs(row["teacher_kl"]) > 1e-2
    metrics = outcome.metrics
    tokens = [len(r["completion_tokens"]) for r in rows]  # the step's KL is per sampled token, over every sample
    assert metrics["teacher_kl"] == pytest.approx(sum(r["teacher_kl"] * n for r, n in zip(rows, tokens)) / sum(tokens), rel=1e-6)
    assert abs(metrics["teacher_kl/add"]) < 1e-3 and "reward/mean" in metrics and "accuracy" in metrics

    ((loss_fn, _, sent),) = client.calls
    assert loss_fn == "importance_sampling" and all(set(d.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"} for d in sent)
    teacher = service_client.create_sampling_client(model_path=perturbed_teacher_path).result()
    mul_datums = [d for d in sent if "*" in tiny_tokenizer().decode(d.model_input.to_ints())]
    assert len(mul_datums) == 4
    for datum in mul_datums:
        lp_teacher = np.asarray([0.0 if v is None else v for v in teacher.compute_logprobs(full_sequence(datum)).result()[1:]])
        sampled = datum.loss_fn_inputs["logprobs"].to_numpy() != 0
        expected = -(datum.loss_fn_inputs["logprobs"].to_numpy() - lp_teacher)[sampled]
        assert datum.loss_fn_inputs["advantages"].to_numpy()[sampled] == pytest.approx(expected, abs=1e-4)


class CrashingRecipe(DistillRecipe):
    def submit_step(self, step, training_client, adam):
        if step == 3:
            raise _Crash("killed at step 3")
        return super().submit_step(step, training_client, adam)


def test_a_crashed_run_resumes_from_its_checkpoint_with_the_same_data_order_and_no_row_twice(service_client, tmp_path, perturbed_teacher_path):
    teachers = routing(perturbed_teacher_path)
    straight = make_config(tmp_path, "straight")
    straight_rows = JsonlRowSink(tmp_path / "straight" / "rows.jsonl")
    train(straight.training, DistillRecipe(straight, dataset(straight, 4), teachers, tiny_tokenizer()), service_client, row_sinks=[straight_rows])

    crashed = make_config(tmp_path, "crashed")
    rows = JsonlRowSink(tmp_path / "crashed" / "rows.jsonl")
    with pytest.raises(_Crash):
        train(crashed.training, CrashingRecipe(crashed, dataset(crashed, 4), teachers, tiny_tokenizer()), service_client, row_sinks=[rows])
    assert sorted({row["step"] for row in rows.read()}) == [0, 1]  # step 2 ran but its checkpoint was never written
    saved = last_checkpoint(Path(crashed.training.log_dir))
    result = train(crashed.training, DistillRecipe(crashed, dataset(crashed, 4), teachers, tiny_tokenizer()), service_client, row_sinks=[rows])

    assert result.start_step == 2 and result.total_steps == 4 and [c.batch for c in result.checkpoints] == [2, 4]
    def key(row):
        return row["step"], row["group"], row["sample"]
    expected = {key(row): row for row in straight_rows.read()}
    resumed = {key(row): row for row in rows.read()}
    assert sorted(resumed) == sorted(expected) and len(rows.read()) == 32  # 4 steps x 4 groups x 2 samples, none twice
    # Data order is exact: every step trains the same prompts as the uninterrupted run. Sampled tokens are not
    # compared between the runs: how many rows decode together depends on timing, BLAS sums 1-3 rows in another
    # order than 4 or more, and on the near-uniform tiny random model such a last-bit change moves an inverse-CDF
    # draw to a neighbouring token id, so two uninterrupted runs already differ on a loaded machine (21 of 32
    # samples alike once), and their weights with them. What resume guarantees is checked exactly: the same
    # prompts at every step, and sampling with the weights of the checkpoint it resumed from, bit for bit.
    for sample, row in resumed.items():
        assert row["prompt_tokens"] == expected[sample]["prompt_tokens"], sample
    first = resumed[(2, "2.0", 0)]
    probe = tinker.ModelInput.from_ints(first["prompt_tokens"] + first["completion_tokens"])
    def scores(path):
        return service_client.create_sampling_client(model_path=path).result().compute_logprobs(probe).result()[1:]
    at_resume = scores(first["sampler_path"])
    assert saved.batch == 2 and first["sampler_path"] != saved.sampler_path  # its own snapshot ...
    assert at_resume == scores(saved.sampler_path)  # ... of the weights it resumed from
    assert at_resume != scores(resumed[(3, "3.0", 0)]["sampler_path"])  # (one more step does change them)
