"""Completers: the two ways a policy is asked for output (tinker-cookbook's vocabulary).

- :class:`TokenCompleter` — tokens in, tokens out: a ``ModelInput`` and a stop condition go to the
  sampling client, the sampled tokens come back with their per-token sampler logprobs and the stop
  reason. RL environments speak this level: the logprobs are what importance-sampling losses need.
- :class:`MessageCompleter` — messages in, a parsed assistant message out: a renderer builds the
  generation prompt, its stop sequences end the turn, and ``renderer.parse_response`` reads the
  tokens back. Evaluators and chat-level environments speak this level.

Both *submit* first and return a pending handle, so a caller can put every request in flight before
awaiting any (``submit(...)`` then ``.result()``); ``complete(...)`` is the one-request shortcut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import tinker

StopCondition = list[str] | list[int]
"""What ends a sampled turn: stop strings, or stop token ids (never a mix), as ``SamplingParams.stop``."""


def normalize_stop(stop: str | Sequence[str] | Sequence[int] | None) -> StopCondition | None:
    """``stop`` as Tinker accepts it, or a ValueError naming what is wrong with it.

    One string becomes a one-element list; a list must hold only non-empty strings or only token ids
    (Tinker's ``stop`` is one or the other); ``None`` and ``[]`` mean "EOS or max_tokens".
    """
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    items = list(stop)
    if not items:
        return None
    if all(isinstance(item, str) for item in items):
        if any(not item for item in items):
            raise ValueError(f"stop {items!r}: stop strings must be non-empty")
        return items
    if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        if any(item < 0 for item in items):
            raise ValueError(f"stop {items!r}: stop token ids must be >= 0")
        return items
    raise ValueError(
        f"stop {items!r}: give either stop strings or stop token ids, not a mix "
        "(a renderer's get_stop_sequences() is always one or the other)"
    )


@dataclass(frozen=True)
class TokensWithLogprobs:
    """One sampled continuation: its tokens, the sampler's logprob of each, and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (a stop string/token or EOS) or "length" (max_tokens)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.logprobs)} logprobs; the sampler must return one per token")


@dataclass(frozen=True)
class SamplingSettings:
    """Per-request sampling knobs shared by every call of one completer."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def params(self, stop: StopCondition | None, seed: int | None) -> tinker.SamplingParams:
        return tinker.SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed, stop=stop
        )


class PendingTokens:
    """The in-flight sample request of :meth:`TokenCompleter.submit`."""

    def __init__(self, future: Any, num_samples: int):
        self._future = future
        self._num_samples = num_samples

    def result(self) -> list[TokensWithLogprobs]:
        sequences = self._future.result().sequences
        if len(sequences) != self._num_samples:
            raise RuntimeError(f"asked the sampler for {self._num_samples} samples, got {len(sequences)}")
        return [_tokens_with_logprobs(sequence) for sequence in sequences]


class TokenCompleter:
    """A sampling client plus sampling settings: ``ModelInput`` + stop -> :class:`TokensWithLogprobs`."""

    def __init__(self, sampling_client: tinker.SamplingClient, settings: SamplingSettings):
        if settings.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {settings.max_tokens}")
        self.sampling_client = sampling_client
        self.settings = settings

    def submit(
        self,
        model_input: tinker.ModelInput,
        stop: str | Sequence[str] | Sequence[int] | None,
        *,
        num_samples: int = 1,
        seed: int | None = None,
    ) -> PendingTokens:
        params = self.settings.params(normalize_stop(stop), seed)
        return PendingTokens(self.sampling_client.sample(model_input, num_samples, params), num_samples)

    def complete(self, model_input: tinker.ModelInput, stop: str | Sequence[str] | Sequence[int] | None, *, seed: int | None = None) -> TokensWithLogprobs:
        return self.submit(model_input, stop, seed=seed).result()[0]


class ChatRenderer(Protocol):
    """The slice of ``posttrain.renderers.Renderer`` a message completer needs."""

    def build_generation_prompt(self, messages: list[dict[str, Any]], role: str = "assistant", prefill: str | None = None) -> tinker.ModelInput: ...

    def get_stop_sequences(self) -> list[str] | list[int]: ...

    def parse_response(self, tokens: list[int]) -> tuple[dict[str, Any], Any]: ...


@dataclass(frozen=True)
class ParsedCompletion:
    """A sampled assistant turn, read back by the renderer."""

    message: dict[str, Any]
    text: str  # the message's visible text (content parts joined)
    well_formed: bool  # ended with the renderer's stop sequence or EOS (not truncated, not malformed)
    sampled: TokensWithLogprobs


class PendingMessages:
    """The in-flight request of :meth:`MessageCompleter.submit`."""

    def __init__(self, pending: PendingTokens, renderer: ChatRenderer):
        self._pending = pending
        self._renderer = renderer

    def result(self) -> list[ParsedCompletion]:
        completions = []
        for sampled in self._pending.result():
            message, termination = self._renderer.parse_response(list(sampled.tokens))
            completions.append(ParsedCompletion(message, message_text(message), is_well_formed(termination), sampled))
        return completions


class MessageCompleter:
    """A renderer over a :class:`TokenCompleter`: conversation -> parsed assistant message(s)."""

    def __init__(self, token_completer: TokenCompleter, renderer: ChatRenderer):
        self.token_completer = token_completer
        self.renderer = renderer

    def submit(self, messages: list[dict[str, Any]], *, num_samples: int = 1, seed: int | None = None) -> PendingMessages:
        prompt = self.renderer.build_generation_prompt(messages)
        pending = self.token_completer.submit(prompt, self.renderer.get_stop_sequences(), num_samples=num_samples, seed=seed)
        return PendingMessages(pending, self.renderer)

    def complete(self, messages: list[dict[str, Any]], *, seed: int | None = None) -> ParsedCompletion:
        return self.submit(messages, seed=seed).result()[0]


def message_text(message: Any) -> str:
    """The visible text of a parsed message (text parts joined; thinking parts left out)."""
    content = message.get("content", "") if isinstance(message, dict) else getattr(message, "content", message)
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return "" if content is None else str(content)


def is_well_formed(termination: Any) -> bool:
    """True when a response ended the way the renderer expects (stop sequence or EOS)."""
    if isinstance(termination, bool):
        return termination
    if hasattr(termination, "is_clean"):
        return bool(termination.is_clean)
    label = str(getattr(termination, "value", termination)).lower()
    return not any(bad in label for bad in ("malformed", "length", "truncat"))


def _tokens_with_logprobs(sequence: Any) -> TokensWithLogprobs:
    tokens = [int(token) for token in sequence.tokens]
    logprobs = sequence.logprobs
    if logprobs is None:
        raise RuntimeError("the sampler returned no logprobs; RL and completers need the per-token sampler logprobs")
    return TokensWithLogprobs(tokens, [float(value) for value in logprobs], str(sequence.stop_reason))
