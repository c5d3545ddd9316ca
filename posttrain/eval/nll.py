"""Held-out negative log-likelihood and bits per byte on rendered token sequences.

Only *trained* positions count (``weights > 0``: the assistant's tokens), so the number answers "how
likely is the reference answer", not "how predictable is the prompt". Weights are a mask here; their
values do not rescale anything.

- ``nll``: mean NLL per trained token, in nats (the stop token included: predicting the end is part
  of answering).
- ``bits_per_byte``: scores *content* tokens only: the NLL in bits of the trained tokens that are not
  special (control) tokens, divided by the UTF-8 bytes of exactly those tokens (each contiguous span
  decoded on its own). Numerator and denominator count the same tokens; a special token such as
  ``<|im_end|>`` has no text bytes, so it is left out of both rather than adding bits with no bytes.
  Unlike ``nll`` it does not depend on the tokenizer, so models with different vocabularies compare
  fairly.

Scoring uses ``training_client.forward(data, "cross_entropy")`` when the target has a training client
(no weights are saved), else ``sampling_client.compute_logprobs`` on the unshifted sequence
``model_input + [last target]`` (base models, saved checkpoints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import tinker

from posttrain.eval.base import EvalTarget
from posttrain.datums import datum_targets, datum_weights


@dataclass
class ExampleNll:
    nll_sum: float  # nats over trained tokens
    num_tokens: int
    content_nll_sum: float  # nats over trained content (non-special) tokens: the bits-per-byte numerator
    num_bytes: int  # UTF-8 bytes of those content tokens


@dataclass
class NllResult:
    nll: float
    bits_per_byte: float
    num_tokens: int
    num_bytes: int
    examples: list[ExampleNll] = field(default_factory=list)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {
            f"{prefix}nll": self.nll,
            f"{prefix}bpb": self.bits_per_byte,
            f"{prefix}num_tokens": float(self.num_tokens),
        }


def target_logprobs(target: EvalTarget, data: Sequence[tinker.Datum], batch_size: int = 16) -> list[np.ndarray]:
    """Per datum, the model's logprob of each ``target_tokens`` entry (float64 arrays).

    All requests are submitted before any is awaited, so the server can batch them.
    """
    if target.training_client is not None:
        futures = [
            target.training_client.forward(list(data[start : start + batch_size]), "cross_entropy")
            for start in range(0, len(data), batch_size)
        ]
        scored: list[np.ndarray] = []
        for future in futures:
            for output in future.result().loss_fn_outputs:
                scored.append(np.asarray(output["logprobs"].to_numpy(), dtype=np.float64).reshape(-1))
        return scored
    sampling_client = target.sampling_client()
    futures = [sampling_client.compute_logprobs(tinker.ModelInput.from_ints(_unshifted(datum))) for datum in data]
    return [np.asarray([math.nan if lp is None else lp for lp in future.result()[1:]], dtype=np.float64) for future in futures]


def _unshifted(datum: tinker.Datum) -> list[int]:
    inputs = datum.model_input.to_ints()
    targets = datum_targets(datum).tolist()
    if inputs[1:] != targets[:-1]:
        raise ValueError(
            "compute_logprobs scoring needs a plain next-token datum (model_input[1:] == target_tokens[:-1]); "
            "score this data with a training client instead"
        )
    return inputs + targets[-1:]


def special_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids of the tokenizer's special (control) tokens: they carry no text bytes."""
    return np.asarray(sorted(getattr(tokenizer, "all_special_ids", []) or []), dtype=np.int64)


def example_nll(tokenizer: Any, targets: np.ndarray, logprobs: np.ndarray, weights: np.ndarray) -> ExampleNll:
    """NLL of the trained targets, and the bits-per-byte terms over the trained content tokens."""
    trained = weights > 0
    content = trained & ~np.isin(targets, special_token_ids(tokenizer))
    return ExampleNll(
        nll_sum=-float(logprobs[trained].sum()),
        num_tokens=int(trained.sum()),
        content_nll_sum=-float(logprobs[content].sum()),
        num_bytes=span_bytes(tokenizer, targets, content),
    )


def span_bytes(tokenizer: Any, targets: np.ndarray, selected: np.ndarray) -> int:
    """UTF-8 bytes of the selected tokens of ``targets`` (each contiguous span decoded on its own)."""
    total, start = 0, None
    for index, flag in enumerate(list(selected) + [False]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            total += len(tokenizer.decode(targets[start:index].tolist()).encode("utf-8"))
            start = None
    return total


def evaluate_nll(
    target: EvalTarget, data: Sequence[tinker.Datum], tokenizer: Any | None = None, batch_size: int = 16
) -> NllResult:
    """NLL/bpb of ``target`` on ``data``; ``tokenizer`` defaults to the target's own (for byte counts)."""
    if not data:
        raise ValueError("evaluate_nll got no data: pass at least one held-out Datum")
    tokenizer = tokenizer if tokenizer is not None else target.tokenizer()
    examples = []
    for datum, logprobs in zip(data, target_logprobs(target, data, batch_size)):
        targets = datum_targets(datum)
        if len(logprobs) != len(targets):
            raise ValueError(f"scorer returned {len(logprobs)} logprobs for {len(targets)} target tokens")
        examples.append(example_nll(tokenizer, targets, logprobs, datum_weights(datum)))
    nll_sum = sum(example.nll_sum for example in examples)
    num_tokens = sum(example.num_tokens for example in examples)
    content_nll_sum = sum(example.content_nll_sum for example in examples)
    num_bytes = sum(example.num_bytes for example in examples)
    return NllResult(
        nll=nll_sum / num_tokens if num_tokens else math.nan,
        bits_per_byte=content_nll_sum / math.log(2) / num_bytes if num_bytes else math.nan,
        num_tokens=num_tokens,
        num_bytes=num_bytes,
        examples=examples,
    )


class NllEvaluator:
    """An :class:`~posttrain.eval.base.Evaluator` reporting ``{prefix}nll`` and ``{prefix}bpb``.

    ``keys``: one item key per datum (e.g. the held-out rows' ids) for :meth:`score_items`; default the position.
    """

    def __init__(
        self,
        data: Sequence[tinker.Datum],
        tokenizer: Any | None = None,
        prefix: str = "eval/",
        batch_size: int = 16,
        keys: Sequence[str] | None = None,
    ):
        self.data = list(data)
        self.tokenizer = tokenizer
        self.prefix = prefix
        self.batch_size = batch_size
        self.keys = list(keys) if keys is not None else [str(index) for index in range(len(self.data))]
        if len(self.keys) != len(self.data):
            raise ValueError(f"NllEvaluator: {len(self.keys)} keys for {len(self.data)} data; pass one key per datum")

    def _evaluate(self, target: EvalTarget) -> NllResult:
        if self.tokenizer is None:
            self.tokenizer = target.tokenizer()  # resolved once, reused at every evaluation
        return evaluate_nll(target, self.data, self.tokenizer, self.batch_size)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        return self._evaluate(target).metrics(self.prefix)

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per held-out sequence: its NLL per trained token and its bits per byte (sequences without content bytes skip bpb)."""
        examples = self._evaluate(target).examples
        return {
            f"{self.prefix}nll": {k: e.nll_sum / e.num_tokens for k, e in zip(self.keys, examples) if e.num_tokens},
            f"{self.prefix}bpb": {k: e.content_nll_sum / math.log(2) / e.num_bytes for k, e in zip(self.keys, examples) if e.num_bytes},
        }
