"""The boundary between localtinker's HTTP protocol layer and its compute engine.

The protocol layer (``localtinker.protocol``) decodes HTTP/JSON/protobuf into these plain
dataclasses, orders work per model by ``seq_id``, and calls an :class:`Engine` from one worker
thread. The engine knows nothing of HTTP, sessions or futures, so it can be tested alone and the
protocol can be tested against a fake engine.

Errors: the engine raises :class:`EngineUserError` for anything the *client* got wrong (unknown
model, bad loss name, token id out of vocab, mismatched tensor lengths, bad Adam params...). The
protocol turns it into a failed future with ``category: "user"`` (or a 4xx when detected before
queueing). Any other exception is a server error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

SUPPORTED_LOSSES: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


class EngineUserError(ValueError):
    """The request is wrong; the message says what and where, and how to fix it."""


class UnknownModelError(EngineUserError):
    """A base model name, model id, sampler id or tinker:// path that does not exist."""


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


@dataclass(frozen=True)
class AdamSpec:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class DatumArrays:
    """One decoded ``tinker.Datum``: the flattened input tokens and its loss inputs.

    ``loss_fn_inputs`` keeps every key the client sent (``target_tokens``, ``weights``,
    ``logprobs``, ``advantages``, and unknown ones such as ``mask`` which losses ignore).
    """

    tokens: np.ndarray  # int64 [T]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardResult:
    loss_fn_outputs: list[dict[str, np.ndarray]]  # per datum: {"logprobs": float32 [T], "elementwise_loss"?: ...}
    metrics: dict[str, float]  # at least "loss:sum"


@dataclass(frozen=True)
class SampleSpec:
    """One ``asample`` request; the engine batches many of these through one generation loop."""

    prompt_tokens: tuple[int, ...]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None = EOS only; () = not even EOS
    prompt_logprobs: bool = False


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # element 0 is None


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    base_model: str
    tokenizer_id: str  # a local directory AutoTokenizer.from_pretrained loads offline
    lora_rank: int
    arch: str
    max_context_length: int


@dataclass(frozen=True)
class CheckpointInfo:
    tinker_path: str
    run_id: str
    kind: str  # "weights" (state: LoRA + Adam) | "sampler_weights"
    name: str
    created_at: float
    size_bytes: int


class Engine(Protocol):
    """What the protocol layer needs from the compute side. All calls are synchronous."""

    def supported_models(self) -> list[ModelInfo]: ...

    def create_model(self, model_id: str, base_model: str, lora: LoraSpec) -> ModelInfo: ...

    def get_info(self, model_id: str) -> ModelInfo: ...

    def forward_backward(
        self,
        model_id: str,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardBackwardResult: ...

    def optim_step(self, model_id: str, adam: AdamSpec) -> dict[str, float]: ...

    def save_state(self, model_id: str, name: str) -> str:
        """Saves LoRA weights + Adam moments + step; returns ``tinker://<run>/weights/<name>``."""
        ...

    def save_sampler_weights(self, model_id: str, name: str) -> str:
        """Returns ``tinker://<run>/sampler_weights/<name>``."""
        ...

    def load_state(self, model_id: str, path: str, with_optimizer: bool, base_model: str | None) -> ModelInfo:
        """Creates ``model_id`` from a saved state (a new training client)."""
        ...

    def create_sampler(self, sampler_id: str, base_model: str | None, model_path: str | None) -> str:
        """Registers a sampler over a base model or a ``tinker://`` (sampler_)weights path; returns its base model."""
        ...

    def create_ephemeral_sampler(self, sampler_id: str, model_id: str) -> str:
        """A sampler over the *current* weights of a training model (save_weights_and_get_sampling_client)."""
        ...

    def sample_batch(self, requests: list[tuple[str, SampleSpec]]) -> list[SampleResult | Exception]:
        """Runs many (sampler_id, spec) requests through one KV-cached generation loop."""
        ...

    def list_checkpoints(self, run_id: str | None = None) -> list[CheckpointInfo]: ...

    def delete_checkpoint(self, tinker_path: str) -> None: ...
