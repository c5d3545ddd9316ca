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

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

SUPPORTED_LOSSES: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")


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


# Hosted Tinker's accepted checkpoint TTLs (SaveWeightsRequest.ttl_seconds): 1 hour to 10 years.
CHECKPOINT_TTL_RANGE_S: tuple[int, int] = (3600, 10 * 365 * 24 * 3600)


def checkpoint_ttl_problem(ttl_seconds: object) -> str | None:
    """Why ``ttl_seconds`` is not an accepted checkpoint TTL (None = it is; a None TTL means never expire)."""
    low, high = CHECKPOINT_TTL_RANGE_S
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not low <= ttl_seconds <= high:
        return (
            f"ttl_seconds={ttl_seconds!r} must be a whole number of seconds between {low} (1 hour) and {high} "
            "(10 years), as on hosted Tinker; pass None to keep the checkpoint until it is deleted."
        )
    return None


def adam_spec_problems(spec: AdamSpec) -> list[str]:
    """What is wrong with ``spec`` (empty when valid). The one rule set both the protocol (a 400 before
    queueing) and the engine (a failed future) apply, so they can never disagree. ``eps`` must be > 0:
    with eps = 0 a parameter whose moments are zero divides 0 by 0 and turns NaN."""
    rules = (
        ("learning_rate", lambda v: v >= 0, ">= 0"),
        ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("eps", lambda v: v > 0, "> 0 (e.g. the SDK default 1e-12)"),
        ("weight_decay", lambda v: v >= 0, ">= 0"),
        ("grad_clip_norm", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    )
    problems = []
    for name, ok, rule in rules:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            problems.append(f"AdamParams.{name} must be finite and {rule}, got {value!r}")
    return problems


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
    max_tokens: int | None = None  # the SDK default: no cap but the model context (or EOS / a stop)
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
class SampleExtrasSpec:
    """What an ``asample`` asks for beyond tokens and logprobs (SDK ``SampleRequest`` fields of the same names).

    Every figure is of the request's temperature-scaled next-token distribution (temperature 0: 1), the
    distribution the sampled logprobs come from.
    """

    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: np.ndarray | None = None  # int64 [len(prompt) - 1, K]; -1 = nothing asked
    prompt_alt_tokens_k: int = 0

    @property
    def wanted(self) -> bool:
        return bool(
            self.topk_prompt_logprobs or self.topk_sample_logprobs or self.prompt_alt_tokens_k
            or self.target_prompt_logprobs is not None
        )


@dataclass
class TopK:
    """Top-k (token id, logprob) per position as dense [positions, k] matrices; a row of ids 0 and logprobs
    ``TOPK_MASK`` is a position with nothing reported (the SDK's ``TopkLogprobs`` sentinel)."""

    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32


TOPK_MASK = -99999.0


@dataclass
class SampleExtras:
    topk_prompt: TopK | None = None  # [len(prompt), k], row 0 masked
    topk_sample: list[TopK] | None = None  # per sequence, [len(tokens), k]
    target_prompt: np.ndarray | None = None  # float32, the shape of the request's ids; 0.0 where it had -1
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None  # int64 ids, float32 logprobs [len(prompt) - 1, k]


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
    kind: str  # "weights" (state: LoRA + Adam) | "sampler_weights" | "external_weights" (PEFT, for download)
    name: str
    created_at: float
    size_bytes: int
    expires_at: float | None = None  # unix time after which the checkpoint is deleted; None = never
    public: bool = False  # published (RestClient.publish_checkpoint_from_tinker_path); a flag locally


@dataclass(frozen=True)
class CheckpointFiles:
    """An external-weights checkpoint's files, which the protocol serves through signed URLs."""

    files: dict[str, Path]  # file name relative to the checkpoint root -> absolute path
    expires_at: float | None  # the checkpoint's expiry (unix time), None = never


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

    def save_state(self, model_id: str, name: str, ttl_seconds: int | None = None) -> str:
        """Saves LoRA weights + Adam moments + step; returns ``tinker://<run>/weights/<name>``.
        ``ttl_seconds`` (see :func:`checkpoint_ttl_problem`): the checkpoint is deleted that long after saving."""
        ...

    def save_sampler_weights(self, model_id: str, name: str, ttl_seconds: int | None = None) -> str:
        """Returns ``tinker://<run>/sampler_weights/<name>``."""
        ...

    def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        """Publishes or unpublishes a checkpoint (idempotent)."""
        ...

    def save_external_weights(self, model_id: str, name: str, ttl_seconds: int | None = None) -> str:
        """Saves the LoRA weights in PEFT's format; returns ``tinker://<run>/external_weights/<name>``."""
        ...

    def external_weights_files(self, tinker_path: str) -> CheckpointFiles:
        """The files of an external-weights checkpoint (for download URLs)."""
        ...

    def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        """Expires the checkpoint ``ttl_seconds`` from now, or never when None."""
        ...

    def load_state(self, model_id: str, path: str, with_optimizer: bool, base_model: str | None) -> ModelInfo:
        """Creates ``model_id`` from a saved state (a new training client)."""
        ...

    def load_state_into(self, model_id: str, path: str, with_optimizer: bool) -> None:
        """Loads a checkpoint into an existing training model (TrainingClient.load_state*, deprecated)."""
        ...

    def create_sampler(self, sampler_id: str, base_model: str | None, model_path: str | None) -> str:
        """Registers a sampler over a base model or a ``tinker://`` (sampler_)weights path; returns its base model."""
        ...

    def create_ephemeral_sampler(self, sampler_id: str, model_id: str) -> str:
        """A sampler over the *current* weights of a training model (save_weights_and_get_sampling_client)."""
        ...

    def sample_batch(self, requests: list[tuple[str, SampleSpec]]) -> list[SampleResult | Exception]:
        """Runs many (sampler_id, spec) requests to completion. An engine may also offer ``sample_stream()``
        (continuous batching, see ``sample_stream.py``); the worker then uses that instead."""
        ...

    def sample_extras(self, sampler_id: str, spec: SampleSpec, extras: SampleExtrasSpec, result: SampleResult) -> SampleExtras:
        """Top-k, target and alternative-token logprobs for a finished sample (scoring.py)."""
        ...

    def list_checkpoints(self, run_id: str | None = None) -> list[CheckpointInfo]: ...

    def release(self, model_ids: list[str], sampler_ids: list[str]) -> None:
        """Frees training models and samplers whose session has finished (their checkpoints stay)."""
        ...

    def delete_checkpoint(self, tinker_path: str) -> None: ...
