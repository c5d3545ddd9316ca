"""Per-token reverse-KL advantages from a teacher: the signal of on-policy distillation.

For each token t the student sampled, its sampler logprob lp_student_t and the teacher's logprob
lp_teacher_t of the same token (``compute_logprobs`` on the whole sequence) give d_t = lp_student_t −
lp_teacher_t, a one-sample estimate of the reverse KL(student‖teacher) at that token. Policy gradient on
A_t = −coef·d_t lowers it: tokens the teacher finds likelier than the student are reinforced, the others
discouraged, one token at a time (dense, unlike a sequence reward). With ``discount`` γ > 0 a token also
collects the γ-discounted advantages of the tokens after it (what the token led to).

The result is *added* to the advantage a datum already carries (a task reward's group advantage, or 0
for pure distillation) and trained with ``importance_sampling``. Not centred, unlike the RL KL penalty
(``posttrain.rl.kl``): here the KL is the objective, not a regulariser around a reward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tinker

from posttrain.rl.data import array_of, mask_of, with_advantages
from posttrain.rl.kl import discounted_future_sum


def reverse_kl_advantages(
    student_logprobs: np.ndarray, teacher_logprobs: np.ndarray, mask: np.ndarray, coef: float, discount: float = 0.0
) -> np.ndarray:
    """A_t = −coef·mask_t·(lp_student_t − lp_teacher_t), γ-discounted over later tokens when ``discount`` > 0."""
    if coef < 0:
        raise ValueError(f"distillation kl_coef must be >= 0, got {coef}")
    if not 0.0 <= discount < 1.0:
        raise ValueError(f"distillation kl_discount must be in [0, 1), got {discount}")
    student, teacher, mask = (np.asarray(a, dtype=np.float64) for a in (student_logprobs, teacher_logprobs, mask))
    if not student.shape == teacher.shape == mask.shape:
        raise ValueError(
            f"student logprobs {student.shape}, teacher logprobs {teacher.shape} and mask {mask.shape} must align "
            "token for token (teacher logprobs of the same shifted sequence)"
        )
    advantages = -coef * mask * (student - teacher)
    return discounted_future_sum(advantages, discount) if discount > 0 else advantages


@dataclass(frozen=True)
class TeacherScores:
    """Per datum: the summed reverse KL over its sampled tokens, and how many tokens that is."""

    kl_sum_D: list[float]
    tokens_D: list[float]

    def mean_kl(self, indices: list[int] | None = None) -> float:
        chosen = range(len(self.kl_sum_D)) if indices is None else indices
        tokens = sum(self.tokens_D[i] for i in chosen)
        return sum(self.kl_sum_D[i] for i in chosen) / tokens if tokens else 0.0


def add_teacher_advantages(
    datums: list[tinker.Datum], teacher_logprobs_D: list[np.ndarray], coef: float, discount: float = 0.0
) -> tuple[list[tinker.Datum], TeacherScores]:
    """Datums whose advantages gained the reverse-KL term, and the per-datum KL that produced it."""
    updated, kl_sums, counts = [], [], []
    for datum, teacher in zip(datums, teacher_logprobs_D, strict=True):
        student, mask = array_of(datum, "logprobs"), mask_of(datum)
        extra = reverse_kl_advantages(student, teacher, mask, coef, discount)
        updated.append(with_advantages(datum, array_of(datum, "advantages") + extra))
        kl_sums.append(float(((student - teacher) * mask).sum()))
        counts.append(float(mask.sum()))
    return updated, TeacherScores(kl_sums, counts)
