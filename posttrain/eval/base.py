"""What an evaluator is given and what it returns.

An evaluator scores *a model*, which may be a training client in the middle of a run (cheap NLL through
``forward``; sampling through an ephemeral snapshot), a saved checkpoint's sampler weights, or a base
model. :class:`EvalTarget` hides which: evaluators ask it for a logprob scorer or a sampling client,
and it creates the sampling client lazily, once.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import tinker


class Evaluator(Protocol):
    """Returns flat, already prefixed metrics (e.g. ``{"eval/nll": 1.9, "eval/bpb": 0.8}``)."""

    def __call__(self, target: EvalTarget) -> dict[str, float]: ...


class EvalTarget:
    """A model to evaluate: give a training client, a sampling client, or both."""

    def __init__(
        self,
        *,
        training_client: tinker.TrainingClient | None = None,
        sampling_client: tinker.SamplingClient | None = None,
        sampling_client_factory: Callable[[], tinker.SamplingClient] | None = None,
        tokenizer: Any | None = None,
    ):
        if training_client is None and sampling_client is None and sampling_client_factory is None:
            raise ValueError("EvalTarget needs a training_client, a sampling_client or a sampling_client_factory")
        self.training_client = training_client
        self._sampling_client = sampling_client
        self._factory = sampling_client_factory
        self._tokenizer = tokenizer

    @classmethod
    def from_checkpoint(cls, service_client: tinker.ServiceClient, sampler_path: str, tokenizer: Any | None = None) -> EvalTarget:
        """A saved checkpoint (``tinker://.../sampler_weights/<name>``)."""
        client = service_client.create_sampling_client(model_path=sampler_path).result()
        return cls(sampling_client=client, tokenizer=tokenizer)

    @classmethod
    def from_base_model(cls, service_client: tinker.ServiceClient, base_model: str, tokenizer: Any | None = None) -> EvalTarget:
        return cls(sampling_client=service_client.create_sampling_client(base_model=base_model).result(), tokenizer=tokenizer)

    def tokenizer(self) -> Any:
        """The tokenizer given at construction, else the training client's (the server names it in
        ``get_info``), else the sampling client's, which the SDK loads from the Hugging Face hub by base
        model name: offline, or for a localtinker model, pass ``tokenizer=`` instead."""
        if self._tokenizer is None:
            if self.training_client is not None:
                self._tokenizer = self.training_client.get_tokenizer()
            else:
                self._tokenizer = self.sampling_client().get_tokenizer()
        return self._tokenizer

    def sampling_client(self) -> tinker.SamplingClient:
        """A sampling client over the target's *current* weights (created on first use, then reused)."""
        if self._sampling_client is None:
            if self._factory is not None:
                self._sampling_client = self._factory()
            else:
                assert self.training_client is not None
                self._sampling_client = self.training_client.save_weights_and_get_sampling_client().result()
        return self._sampling_client


def run_evaluators(evaluators: list[Evaluator] | tuple[Evaluator, ...], target: EvalTarget) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for evaluator in evaluators:
        metrics.update(evaluator(target))
    return metrics
