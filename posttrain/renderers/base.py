"""The renderer interface (tinker-cookbook semantics) and the machinery every renderer shares.

A renderer turns a conversation into tokens twice over: as a *generation prompt* (what the model is
given before it answers) and as a *supervised example* (tokens plus a per-token loss weight). Each
concrete renderer only says how one message looks, as a list of :class:`Piece` s split into a
``header`` (given to the model, never trained except under ``ALL_TOKENS``) and an ``output`` (what
the model produces; trained when ``TrainOnWhat`` selects the message). Pieces are either template
text (special tokens recognised) or message content (encoded literally); see ``codec.py``.

Keeping rendering as a plan of pieces, separate from encoding, is what lets ``batch.py`` encode the
contents of thousands of conversations in one tokenizer call and still produce exactly the tokens of
:meth:`Renderer.build_supervised_example`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from itertools import chain
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import tinker

from posttrain.renderers.codec import TokenCodec, as_codec
from posttrain.renderers.types import (
    Message,
    ParseTermination,
    RendererError,
    Role,
    TrainOnWhat,
    validate_message,
)

logger = logging.getLogger(__name__)


class Piece(NamedTuple):
    """A run of text rendered together: template text, or message content when ``literal``.
    (A tuple: datasets create millions of them.)"""

    text: str
    literal: bool = False


def template(text: str) -> Piece:
    return Piece(text, False)


def content(text: str) -> Piece:
    return Piece(text, True)


@dataclass(frozen=True)
class RenderedMessage:
    """One message as pieces. ``stop_overlap`` is appended only after the final message (role_colon).

    ``trailer`` follows the output and is context, never a target (weight 0 except under ``ALL_TOKENS``):
    a separator the format writes after the stop token (ChatML's ``\n`` after ``<|im_end|>``). The
    sampler stops at the stop token and never produces it, so training on it would teach nothing the
    model is ever asked to produce.
    """

    header: list[Piece] = field(default_factory=list)
    output: list[Piece] = field(default_factory=list)
    stop_overlap: list[Piece] = field(default_factory=list)
    trailer: list[Piece] = field(default_factory=list)


class RenderContext(NamedTuple):
    """Where a message sits in its conversation, for formats that depend on position."""

    idx: int
    is_last: bool
    prev_message: Message | None
    next_message: Message | None
    last_user_index: int
    # First message of the turn being produced: the trailing run of assistant messages after the last
    # user message (just the final message when there is no user message). Formats that strip
    # reasoning from history keep it from here on.
    produced_turn_start: int
    in_prompt: bool = False  # the conversation is history for a generation prompt (nothing is produced)


@dataclass(frozen=True)
class SupervisedPlan:
    """A supervised example before encoding: its pieces and the loss weight of each piece's tokens."""

    messages: list[Message]  # validated and prepared
    train_on_what: TrainOnWhat
    pieces: list[Piece]
    weights: list[float]


def last_user_index(messages: Sequence[Message]) -> int:
    return max((i for i, message in enumerate(messages) if message["role"] == "user"), default=-1)


def produced_turn_start(messages: Sequence[Message]) -> int:
    last_user = last_user_index(messages)
    if last_user < 0:
        return max(len(messages) - 1, 0)
    start = len(messages)
    while start - 1 > last_user and messages[start - 1]["role"] == "assistant":
        start -= 1
    return start


class Renderer(ABC):
    """Chat format <-> tokens. Construct through ``posttrain.renderers.get_renderer(name, tokenizer)``."""

    name: str = ""
    renders_by_pieces = True  # False for adapters that render whole conversations (tml:*)

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.codec: TokenCodec = as_codec(tokenizer)
        self._template_cache: dict[str, list[int]] = {}

    # ----- what each format defines -------------------------------------------------------------

    @abstractmethod
    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage: ...

    @abstractmethod
    def get_stop_sequences(self) -> list[str] | list[int]:
        """Token ids (or strings) that end a sampled turn; pass them to ``SamplingParams(stop=...)``."""

    @abstractmethod
    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        """Sampled tokens -> assistant message; a best-effort message even when ``MALFORMED``."""

    def bos_pieces(self) -> list[Piece]:
        return []

    def prepare(self, messages: list[Message]) -> list[Message]:
        """Rewrites a (validated) conversation before rendering; formats that merge messages override it."""
        return messages

    def generation_suffix(self, role: Role, ctx: RenderContext) -> list[Piece]:
        """What follows the conversation in a generation prompt: by default the role's header."""
        return self.render_message({"role": role, "content": ""}, ctx).header

    @property
    def has_extension_property(self) -> bool:
        """Whether each turn's prompt is a prefix of the next (false when history is rewritten)."""
        return True

    prompt_is_rendered_history = False
    """True when a generation prompt is always the supervised rendering of the same messages followed
    by the answer's (untrained) header: then no prompt token can fall in a trained span and the
    prompt check in ``assemble_supervised`` is skipped (it costs a second render per example)."""

    merges_extending_examples = False
    """Without the extension property, ``build_supervised_examples`` gives one example per trained
    message; when True, an example the next one extends token for token is folded into it."""

    # ----- encoding -------------------------------------------------------------------------------

    def encode_template(self, text: str) -> list[int]:
        tokens = self._template_cache.get(text)
        if tokens is None:
            tokens = self._template_cache[text] = self.codec.encode_template(text)
        return tokens

    def encode_pieces(self, pieces: Sequence[Piece]) -> list[list[int]]:
        """One token list per piece; content pieces are encoded in a single batched call."""
        literal_texts = [piece.text for piece in pieces if piece.literal]
        literal_tokens = iter(self.codec.encode_content_batch(literal_texts) if literal_texts else [])
        return [next(literal_tokens) if piece.literal else self.encode_template(piece.text) for piece in pieces]

    def _encode_one_by_one(self, pieces: Sequence[Piece]) -> list[list[int]]:
        return [
            self.codec.encode_content(piece.text) if piece.literal else self.encode_template(piece.text)
            for piece in pieces
        ]

    # ----- plans ------------------------------------------------------------------------------------

    def _contexts(self, messages: Sequence[Message], in_prompt: bool = False) -> list[RenderContext]:
        last_user = last_user_index(messages)
        turn_start = produced_turn_start(messages)
        return [
            RenderContext(
                idx=i,
                is_last=i == len(messages) - 1,
                prev_message=messages[i - 1] if i > 0 else None,
                next_message=messages[i + 1] if i + 1 < len(messages) else None,
                last_user_index=last_user,
                produced_turn_start=turn_start,
                in_prompt=in_prompt,
            )
            for i in range(len(messages))
        ]

    def generation_plan(
        self, messages: Sequence[Message], role: Role = "assistant", prefill: str | None = None
    ) -> list[Piece]:
        return self._generation_pieces(self.prepare(_checked(messages)), role, prefill)

    def _generation_pieces(self, messages: list[Message], role: Role = "assistant", prefill: str | None = None) -> list[Piece]:
        pieces = list(self.bos_pieces())
        for message, ctx in zip(messages, self._contexts(messages, in_prompt=True), strict=True):
            rendered = self.render_message(message, ctx)
            pieces += rendered.header
            pieces += rendered.output
            pieces += rendered.trailer
        suffix_ctx = RenderContext(
            idx=len(messages),
            is_last=True,
            prev_message=messages[-1] if messages else None,
            next_message=None,
            last_user_index=last_user_index(messages),
            produced_turn_start=len(messages),
            in_prompt=True,
        )
        pieces += self.generation_suffix(role, suffix_ctx)
        if prefill:
            pieces.append(content(prefill))
        return [piece for piece in pieces if piece.text]

    def supervised_plan(self, messages: Sequence[Message], train_on_what: TrainOnWhat) -> SupervisedPlan:
        """The pieces of a supervised example and the loss weight of each (validates the conversation)."""
        train_on_what = TrainOnWhat(train_on_what)
        checked = _checked(messages)
        _check_trainable_flags(checked, train_on_what)
        messages = self.prepare(checked)
        turn_start = last_user_index(messages[:-1]) + 1
        header_weight = 1.0 if train_on_what == TrainOnWhat.ALL_TOKENS else 0.0
        pieces = list(self.bos_pieces())
        weights = [0.0] * len(pieces)
        for message, ctx in zip(messages, self._contexts(messages), strict=True):
            rendered = self.render_message(message, ctx)
            weight = 1.0 if _output_is_trained(message, ctx, train_on_what, turn_start) else 0.0
            output = rendered.output + rendered.stop_overlap if ctx.is_last else rendered.output
            pieces += rendered.header + output + rendered.trailer
            weights += [header_weight] * len(rendered.header)
            weights += [weight] * len(output)
            weights += [header_weight] * len(rendered.trailer)
        keep = [i for i, piece in enumerate(pieces) if piece.text]
        return SupervisedPlan(messages, train_on_what, [pieces[i] for i in keep], [weights[i] for i in keep])

    def prompt_boundary(self, messages: Sequence[Message], train_on_what: TrainOnWhat) -> int | None:
        """Index of the message a generation prompt would stop before, for modes that train "the
        turn sampling would produce"; None otherwise."""
        if train_on_what == TrainOnWhat.LAST_ASSISTANT_MESSAGE:
            boundary = len(messages) - 1
        elif train_on_what == TrainOnWhat.LAST_ASSISTANT_TURN:
            boundary = last_user_index(messages) + 1
        else:
            return None
        if 0 <= boundary < len(messages) and messages[boundary]["role"] == "assistant":
            return boundary
        return None

    def assemble_supervised(self, plan: SupervisedPlan, plan_tokens: list[list[int]]) -> tuple[list[int], np.ndarray]:
        """Tokens and weights from an encoded plan, with the generation prompt's part never trained.

        A renderer whose prompt ends in a prefill (``<think>`` or an empty think block) renders that
        prefill inside the trained turn; training on it would teach the model a token it is always
        given, so every token the prompt for this turn already contains gets weight 0.
        """
        tokens = list(chain.from_iterable(plan_tokens))
        weights = np.repeat(
            np.asarray(plan.weights, dtype=np.float32), [len(piece_tokens) for piece_tokens in plan_tokens]
        )
        boundary = None if self.prompt_is_rendered_history else self.prompt_boundary(plan.messages, plan.train_on_what)
        if boundary is not None:
            known = dict(zip(plan.pieces, plan_tokens, strict=True))
            prompt_pieces = self._generation_pieces(plan.messages[:boundary])
            missing = [piece for piece in prompt_pieces if piece not in known]
            known.update(zip(missing, self._encode_one_by_one(missing), strict=True))
            prompt = list(chain.from_iterable(known[piece] for piece in prompt_pieces))
            if tokens[: len(prompt)] == prompt:
                weights[: len(prompt)] = 0.0
            else:
                self.on_prompt_mismatch(plan.messages)
        return tokens, weights

    def on_prompt_mismatch(self, messages: Sequence[Message]) -> None:
        """Called when a render does not start with its own generation prompt (default: accept)."""

    # ----- the public interface -----------------------------------------------------------------

    def build_generation_prompt(
        self, messages: Sequence[Message], role: Role = "assistant", prefill: str | None = None
    ) -> tinker.ModelInput:
        """The prompt to sample the next ``role`` message from; ``prefill`` starts that message."""
        pieces = self.generation_plan(messages, role, prefill)
        tokens = [token for piece_tokens in self._encode_one_by_one(pieces) for token in piece_tokens]
        return tinker.ModelInput.from_ints(tokens)

    def build_supervised_example(
        self,
        messages: Sequence[Message],
        train_on_what: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE,
    ) -> tuple[tinker.ModelInput, np.ndarray]:
        """Tokens of the whole conversation and a float32 weight per token (same length)."""
        plan = self.supervised_plan(messages, train_on_what)
        tokens, weights = self.assemble_supervised(plan, self._encode_one_by_one(plan.pieces))
        return tinker.ModelInput.from_ints(tokens), weights

    def build_supervised_examples(
        self,
        messages: Sequence[Message],
        train_on_what: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_TURN,
    ) -> list[tuple[tinker.ModelInput, np.ndarray]]:
        """One example per trained assistant message when history is rewritten (no extension
        property), so every trained message sees the context it is sampled from; else one."""
        if self.has_extension_property:
            return [self.build_supervised_example(messages, train_on_what)]
        train_on_what = TrainOnWhat(train_on_what)
        if train_on_what == TrainOnWhat.LAST_ASSISTANT_MESSAGE:
            candidates = range(len(messages) - 1, len(messages))
        elif train_on_what == TrainOnWhat.LAST_ASSISTANT_TURN:
            candidates = range(last_user_index(messages) + 1, len(messages))
        elif train_on_what == TrainOnWhat.ALL_ASSISTANT_MESSAGES:
            candidates = range(len(messages))
        else:
            raise RendererError(
                f"{self.name}: build_supervised_examples cannot split {train_on_what.value} into one "
                "example per produced turn; use build_supervised_example"
            )
        examples = [
            self.build_supervised_example(messages[: i + 1], TrainOnWhat.LAST_ASSISTANT_MESSAGE)
            for i in candidates
            if messages[i]["role"] == "assistant"
        ]
        return _merge_extending_examples(examples) if self.merges_extending_examples else examples

    def decode(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens)


def _merge_extending_examples(
    examples: list[tuple[tinker.ModelInput, np.ndarray]],
) -> list[tuple[tinker.ModelInput, np.ndarray]]:
    """Folds an example into the next when the next one's tokens extend it (the history rendered the
    same way), so one sequence trains both; as tml-renderers does."""
    merged: list[tuple[tinker.ModelInput, np.ndarray]] = []
    for model_input, weights in examples:
        if merged:
            previous_input, previous_weights = merged[-1]
            previous_tokens = previous_input.to_ints()
            if model_input.to_ints()[: len(previous_tokens)] == previous_tokens:
                weights = weights.copy()
                weights[: len(previous_weights)] = np.maximum(weights[: len(previous_weights)], previous_weights)
                merged[-1] = (model_input, weights)
                continue
        merged.append((model_input, weights))
    return merged


def _checked(messages: Sequence[Message]) -> list[Message]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RendererError(f"expected a list of messages, got {type(messages).__name__}")
    return [validate_message(message, f"message {i}") for i, message in enumerate(messages)]


def _check_trainable_flags(messages: Sequence[Message], train_on_what: TrainOnWhat) -> None:
    for i, message in enumerate(messages):
        has_flag = "trainable" in message
        if train_on_what == TrainOnWhat.CUSTOMIZED and not has_flag:
            raise RendererError(
                f"message {i} ({message['role']}) has no 'trainable' flag: with "
                "TrainOnWhat.CUSTOMIZED every message must say whether it is trained"
            )
        if train_on_what != TrainOnWhat.CUSTOMIZED and has_flag:
            raise RendererError(
                f"message {i} ({message['role']}) has a 'trainable' flag but train_on_what is "
                f"{train_on_what.value}: use TrainOnWhat.CUSTOMIZED or drop the flag"
            )


def _output_is_trained(
    message: Message, ctx: RenderContext, train_on_what: TrainOnWhat, turn_start: int
) -> bool:
    is_assistant = message["role"] == "assistant"
    match train_on_what:
        case TrainOnWhat.LAST_ASSISTANT_MESSAGE:
            return ctx.is_last and is_assistant
        case TrainOnWhat.LAST_ASSISTANT_TURN:
            return is_assistant and ctx.idx >= turn_start
        case TrainOnWhat.ALL_ASSISTANT_MESSAGES:
            return is_assistant
        case TrainOnWhat.ALL_MESSAGES | TrainOnWhat.ALL_TOKENS:
            return True
        case TrainOnWhat.ALL_USER_AND_SYSTEM_MESSAGES:
            return message["role"] in ("user", "system")
        case TrainOnWhat.CUSTOMIZED:
            return bool(message["trainable"])
    raise RendererError(f"unknown train_on_what {train_on_what!r}; choose one of {[m.value for m in TrainOnWhat]}")


def parse_for_stop_token(
    tokens: Sequence[int], codec: TokenCodec, stop_token: int
) -> tuple[str, ParseTermination]:
    """Splits a sampled turn at its one stop token: text before it and how the turn ended."""
    tokens = list(tokens)
    count = tokens.count(stop_token)
    if count == 0:
        return codec.decode(tokens), ParseTermination.MALFORMED
    end = tokens.index(stop_token)
    if count > 1:
        logger.warning("response has %d stop tokens; the sampler was not given the stop sequence", count)
        return codec.decode(tokens[:end]), ParseTermination.MALFORMED
    return codec.decode(tokens[:end]), ParseTermination.STOP_SEQUENCE
