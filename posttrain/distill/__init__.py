"""Distillation: on-policy (the student samples, teachers score each token) and prompt distillation
(a teacher with a system prompt answers prompts; the student is fine-tuned on the answers without it)."""

from posttrain.distill.advantages import add_teacher_advantages, reverse_kl_advantages
from posttrain.distill.config import DistillConfig
from posttrain.distill.recipe import DistillRecipe
from posttrain.distill.teachers import ANY_DATASET, Teacher, TeacherRouting, TeacherTokenizerMismatch, check_teacher_tokenizers

__all__ = [
    "ANY_DATASET",
    "DistillConfig",
    "DistillRecipe",
    "Teacher",
    "TeacherRouting",
    "TeacherTokenizerMismatch",
    "add_teacher_advantages",
    "check_teacher_tokenizers",
    "reverse_kl_advantages",
]
