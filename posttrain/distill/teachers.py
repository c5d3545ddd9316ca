"""Teachers of an on-policy distillation run, and which teacher scores which group.

A :class:`Teacher` is any model a Tinker sampling client can score with: a checkpoint's sampler weights
or a base model. Several teachers may serve one run: every *dataset* names its teacher, and a group is
routed by the dataset it came from (:func:`dataset_of`: the problem's task for table-backed envs, the
env's own tag, else the env name). ``"*"`` names the teacher of every dataset not listed.

A teacher scores the student's tokens by id, so it must read them with the same tokenizer: a teacher
whose tokenizer differs from the student's is refused up front (:func:`check_teacher_tokenizers`),
comparing tokenizer digests (``posttrain.datasets.tokens.TokenizerIdentity``), never names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import tinker

from posttrain.datasets.tokens import TokenizerIdentity
from posttrain.rl.kl import full_sequence
from posttrain.rl.types import EnvGroupBuilder

ANY_DATASET = "*"


class TeacherTokenizerMismatch(ValueError):
    """A teacher would score token ids produced by a different tokenizer than its own."""


@dataclass(frozen=True)
class Teacher:
    name: str  # how lineage names it: a checkpoint partition key, a tinker:// path, or the base model
    base_model: str
    sampler_path: str | None  # None: the base model's own weights
    tokenizer: TokenizerIdentity

    def create_sampling_client(self, service_client: tinker.ServiceClient) -> tinker.SamplingClient:
        if self.sampler_path:
            return service_client.create_sampling_client(model_path=self.sampler_path).result()
        return service_client.create_sampling_client(base_model=self.base_model).result()

    def key(self) -> str:
        return self.sampler_path or f"base:{self.base_model}"


@dataclass(frozen=True)
class TeacherRouting:
    """Dataset name -> teacher; ``"*"`` for every dataset not named."""

    teachers: Mapping[str, Teacher]

    def __post_init__(self) -> None:
        if not self.teachers:
            raise ValueError("distillation needs at least one teacher: give teachers={'*': <teacher>} or one per dataset")

    def teacher_for(self, dataset: str) -> Teacher:
        teacher = self.teachers.get(dataset) or self.teachers.get(ANY_DATASET)
        if teacher is None:
            raise ValueError(
                f"no teacher for dataset {dataset!r}: teachers are given for {sorted(self.teachers)}; "
                f"add {dataset!r} or '{ANY_DATASET}' (every other dataset) to teachers"
            )
        return teacher

    def distinct(self) -> dict[str, Teacher]:
        """Each teacher once, by :meth:`Teacher.key` (two datasets may share one)."""
        return {teacher.key(): teacher for teacher in self.teachers.values()}

    def describe(self) -> dict[str, str]:
        return {dataset: teacher.key() for dataset, teacher in sorted(self.teachers.items())}


def check_teacher_tokenizers(student: TokenizerIdentity, routing: TeacherRouting) -> None:
    """Raise :class:`TeacherTokenizerMismatch` naming both tokenizers when any teacher's differs from the student's."""
    for dataset, teacher in sorted(routing.teachers.items()):
        if teacher.tokenizer.digest != student.digest:
            raise TeacherTokenizerMismatch(
                f"teacher {teacher.name!r} (dataset {dataset!r}, base model {teacher.base_model!r}) uses tokenizer "
                f"{teacher.tokenizer.describe()}, but the student uses {student.describe()}: a teacher scores the "
                "student's token ids, so both must share one tokenizer; pick a teacher trained on a base model "
                "with the student's tokenizer (or use prompt distillation, which exchanges text)"
            )


def dataset_of(builder: EnvGroupBuilder, fallback: str) -> str:
    """The dataset a group belongs to: its builder's first logging tag (a problem's task), else ``fallback``."""
    tags = builder.logging_tags()
    return tags[0] if tags else fallback


def teacher_logprobs(clients_D: list[tinker.SamplingClient], datums: list[tinker.Datum]) -> list[np.ndarray]:
    """lp_teacher of each target token of each datum, by that datum's teacher (all submitted before any is awaited)."""
    futures = [client.compute_logprobs(full_sequence(datum)) for client, datum in zip(clients_D, datums, strict=True)]
    return [np.asarray([0.0 if value is None else value for value in future.result()[1:]], dtype=np.float64) for future in futures]
