"""Demo-sized experiment on real SmolLM2-135M-Instruct (slow): on-policy distillation from an SFT teacher.

Teacher: LoRA SFT on two-number addition (``pipelines.demo`` DEMO_SOURCE / DEMO_TRAINING). Student: a fresh
LoRA on the base model, distilled on-policy from the teacher on the same problems' train split. Reported:
held-out greedy accuracy of base, teacher and student checkpoints, and the steps / CPU-seconds the student
needed to reach the teacher's accuracy against the teacher's own SFT training. CPU-seconds are this
process's (the localtinker server runs in it), evaluation excluded.

    .venv/bin/python -m pytest -q -m slow tests/posttrain/distill/test_distill_demo.py -s -p no:cacheprovider
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import tinker

from pipelines.demo import DEMO_SOURCE, DEMO_TRAINING
from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.datasets.tokens import render_chat_table, tokenizer_identity
from posttrain.distill import DistillConfig, DistillRecipe, Teacher, TeacherRouting
from posttrain.eval.accuracy import AccuracyEvaluator, problems_from_table
from posttrain.eval.base import EvalTarget
from posttrain.renderers import get_renderer
from posttrain.rl.envs import build_rl_dataset
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import RenderedTokens
from posttrain.supervised.recipe import SupervisedRecipe
from posttrain.training.config import TrainingConfig
from posttrain.training.core import train

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
HELDOUT_PROBLEMS = 48
MAX_TOKENS = 24
STUDENT_STEPS = 20
EVAL_EVERY = 5


@dataclass
class Figures:
    base_accuracy: float = 0.0
    teacher_accuracy: float = 0.0
    teacher_steps: int = 0
    teacher_cpu_s: float = 0.0
    teacher_wall_s: float = 0.0
    student_curve: list[tuple[int, float, float, float]] = field(default_factory=list)  # step, accuracy, cpu s, teacher_kl

    def student_reached_teacher(self) -> tuple[int, float] | None:
        return next(((step, cpu) for step, accuracy, cpu, _ in self.student_curve if accuracy >= self.teacher_accuracy), None)

    def report(self) -> str:
        lines = [f"held-out greedy accuracy ({HELDOUT_PROBLEMS} problems): base {self.base_accuracy:.3f}, teacher {self.teacher_accuracy:.3f}",
                 f"teacher SFT: {self.teacher_steps} steps x {DEMO_TRAINING['batch_size']} examples, {self.teacher_cpu_s:.0f} CPU-s ({self.teacher_wall_s:.0f} s wall)",
                 "student (on-policy distillation, fresh LoRA): step, accuracy, CPU-s of training so far, teacher_kl of the step"]
        lines += [f"  {step:>3}  {accuracy:.3f}  {cpu:7.0f}  {kl:.4f}" for step, accuracy, cpu, kl in self.student_curve]
        reached = self.student_reached_teacher()
        lines.append(f"student reached the teacher's accuracy at step {reached[0]} after {reached[1]:.0f} CPU-s" if reached
                     else f"student did not reach the teacher's accuracy within {STUDENT_STEPS} steps")
        return "\n".join(lines)


def run_experiment(tmp_path, service: tinker.ServiceClient) -> Figures:
    from resources.models import load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2)
    renderer = get_renderer("chatml", tokenizer)
    chat = load(LoadSpec(kind="chat", source=DEMO_SOURCE, limit=600, heldout_fraction=0.1)).table
    problems = load(LoadSpec(kind="rl", source=DEMO_SOURCE, limit=600, heldout_fraction=0.1)).table
    accuracy = AccuracyEvaluator(renderer, problems_from_table(problems, HELDOUT_SPLIT, HELDOUT_PROBLEMS), prefix="", max_tokens=MAX_TOKENS)

    def score(sampler_path: str | None) -> float:
        target = (EvalTarget.from_checkpoint(service, sampler_path, tokenizer) if sampler_path
                  else EvalTarget.from_base_model(service, SMOLLM2, tokenizer))
        return accuracy(target)["accuracy"]

    figures = Figures(base_accuracy=score(None))
    tokens = render_chat_table(chat, renderer, "last_assistant_message", 512)
    sft = SupervisedConfig(
        training=TrainingConfig(base_model=SMOLLM2, lora_rank=DEMO_TRAINING["lora_rank"], learning_rate=DEMO_TRAINING["learning_rate"],
                                max_steps=DEMO_TRAINING["max_steps"], save_every=0, log_dir=str(tmp_path / "teacher")),
        batch_size=DEMO_TRAINING["batch_size"],
    )
    cpu, wall = time.process_time(), time.monotonic()
    teacher_run = train(sft.training, SupervisedRecipe(sft, RenderedTokens(tokens, split=TRAIN_SPLIT)), service)
    figures.teacher_cpu_s, figures.teacher_wall_s = time.process_time() - cpu, time.monotonic() - wall
    figures.teacher_steps = teacher_run.total_steps
    figures.teacher_accuracy = score(teacher_run.sampler_path)

    config = DistillConfig(
        training=TrainingConfig(base_model=SMOLLM2, lora_rank=16, learning_rate=1e-3, lr_schedule="constant", max_steps=STUDENT_STEPS,
                                save_every=EVAL_EVERY, log_dir=str(tmp_path / "student")),
        env="problems", group_size=4, groups_per_batch=8, max_tokens=MAX_TOKENS, teachers={"*": teacher_run.sampler_path},
    )
    dataset = build_rl_dataset("problems", renderer, group_size=4, groups_per_batch=8, table=problems, seed=0)
    identity = tokenizer_identity(tokenizer, SMOLLM2)
    routing = TeacherRouting({"*": Teacher("sft-teacher", SMOLLM2, teacher_run.sampler_path, identity)})
    started, eval_cpu = time.process_time(), [0.0]

    def on_checkpoint(record) -> None:
        training_cpu = time.process_time() - started - eval_cpu[0]  # evaluation of earlier checkpoints excluded
        before = time.process_time()
        step_accuracy = score(record.sampler_path)
        eval_cpu[0] += time.process_time() - before
        kl = float(record.extra.get("metrics", {}).get("teacher_kl", float("nan")))
        figures.student_curve.append((record.batch, step_accuracy, training_cpu, kl))

    train(config.training, DistillRecipe(config, dataset, routing, tokenizer), service, on_checkpoint=on_checkpoint)
    return figures


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_a_fresh_student_distilled_on_policy_approaches_its_sft_teacher(tmp_path):
    import torch

    from localtinker.server import start_server

    torch.set_num_threads(1)
    with start_server(tmp_path / "storage", dtype="float32") as server:
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local")
        figures = run_experiment(tmp_path, service)
        service.close("success").result(timeout=60)
    print("\n" + figures.report())
    assert figures.teacher_accuracy > figures.base_accuracy  # the teacher knows something the base does not
    assert figures.student_curve[-1][1] > figures.base_accuracy  # and the student learned some of it
