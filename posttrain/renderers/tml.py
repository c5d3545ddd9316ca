"""tml-renderers' native renderers behind our ``Renderer`` interface: names ``tml:<family>``.

The PyPI package ``tml-renderers`` (Thinking Machines) implements many chat formats in Rust, each with
its tokenizer built in, so these renderers need no tokenizer argument (``get_renderer("tml:kimi_k2")``;
a tokenizer passed anyway is not used, their own is exposed as ``renderer.tokenizer``). Conversations
are our plain message dicts; ``TrainOnWhat`` is mapped to per-message loss weights the way
tinker-cookbook's adapter does (an assistant message not selected gets weight 0), so only the modes
that select assistant messages are available: LAST_ASSISTANT_MESSAGE, LAST_ASSISTANT_TURN,
ALL_ASSISTANT_MESSAGES, CUSTOMIZED.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tinker

from posttrain.renderers.base import Renderer, RenderContext, RenderedMessage, last_user_index
from posttrain.renderers.codec import TmlCodec
from posttrain.renderers.types import Message, ParseTermination, RendererError, Role, TrainOnWhat, validate_message


def _factories() -> dict[str, Callable[[], Any]]:
    from tml_renderers import renderers as r

    return {
        "qwen3": r.Qwen3,
        "qwen3_disable_thinking": r.Qwen3.disable_thinking,
        "qwen3_instruct": r.Qwen3.instruct,
        "qwen3_5": r.Qwen35,
        "qwen3_5_disable_thinking": r.Qwen35.disable_thinking,
        "qwen3_8": r.Qwen38,
        "qwen3_8_low": r.Qwen38.low,
        "qwen3_8_medium": r.Qwen38.medium,
        "qwen3_8_disable_thinking": r.Qwen38.disable_thinking,
        "deepseekv3": r.DeepSeekV31,
        "deepseekv3_thinking": r.DeepSeekV31.thinking,
        "deepseekv3_0": r.DeepSeekV3,
        "deepseek_r1": r.DeepSeekR1,
        "deepseekv4": r.DeepSeekV4,
        "deepseekv4_chat": r.DeepSeekV4.chat,
        "deepseekv4_1": r.DeepSeekV41,
        "deepseekv4_1_chat": r.DeepSeekV41.chat,
        "kimi_k2": r.KimiK2,
        "kimi_k2_preserve_thinking": r.KimiK2.preserve_thinking_history,
        "kimi_k25": r.KimiK25,
        "kimi_k25_disable_thinking": r.KimiK25.disable_thinking,
        "glm5_2": r.Glm52,
        "glm5_3": r.Glm53,
        "glm5_3_flash": r.Glm53Flash,
        "gpt_oss_low": r.GptOss.low,
        "gpt_oss_medium": r.GptOss,
        "gpt_oss_high": r.GptOss.high,
        "nemotron3": r.Nemotron3,
        "nemotron3_disable_thinking": r.Nemotron3.disable_thinking,
        "nemotron3_ultra": r.Nemotron3.ultra,
    }


def tml_families() -> list[str]:
    """The tml-renderers families available as ``tml:<family>``."""
    return sorted(_factories())


class TmlRenderer(Renderer):
    """Adapter: whole conversations are rendered by tml-renderers, not piece by piece."""

    renders_by_pieces = False

    def __init__(self, family: str):
        factories = _factories()
        if family not in factories:
            raise RendererError(f"unknown tml-renderers family {family!r}; known: {sorted(factories)}")
        self.name = f"tml:{family}"
        self.native = factories[family]()
        super().__init__(self.native.tokenizer)
        assert isinstance(self.codec, TmlCodec)

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        raise NotImplementedError(f"{self.name} renders whole conversations through tml-renderers")

    @property
    def has_extension_property(self) -> bool:
        return False

    def _message_list(self, messages: Sequence[Message], trained: set[int] | None = None) -> Any:
        from tml_renderers import chat

        untrained = chat.MessageMetadata(training_metadata=chat.TrainingMetadata(0.0, False))
        native = []
        for index, message in enumerate(messages):
            validate_message(message, f"{self.name} message {index}")
            oss = {key: value for key, value in message.items() if key != "trainable"}
            try:
                parts = chat.OpenAIMessage.from_oss_dict(oss).to_messages()
            except Exception as error:
                raise RendererError(f"{self.name}: message {index} cannot be converted: {error}") from error
            if trained is not None and message["role"] == "assistant" and index not in trained:
                parts = [
                    part.copy(message_metadata=untrained) if part.author.kind == chat.AuthorKind.Model else part
                    for part in parts
                ]
            native += parts
        return chat.MessageList(native)

    def build_generation_prompt(
        self, messages: Sequence[Message], role: Role = "assistant", prefill: str | None = None
    ) -> tinker.ModelInput:
        if role != "assistant":
            raise RendererError(f"{self.name} can only prompt for an assistant message, not {role!r}")
        spans, _ = self.native.render_for_completion(self._message_list(messages))
        tokens = _span_tokens(spans)
        if prefill:
            tokens += self.codec.encode_content(prefill)
        return tinker.ModelInput.from_ints(tokens)

    def _examples(self, messages: Sequence[Message], train_on_what: TrainOnWhat) -> list[tuple[tinker.ModelInput, np.ndarray]]:
        trained = _trained_assistant_indices(messages, TrainOnWhat(train_on_what), self.name)
        try:
            examples = self.native.render_for_sft(self._message_list(messages, trained))
        except ValueError as error:
            raise RendererError(f"{self.name}: {error}") from error
        return [
            (
                tinker.ModelInput.from_ints(_span_tokens(example.input_token_spans)),
                np.asarray(example.per_token_loss_weight_unshifted, dtype=np.float32),
            )
            for example in examples
        ]

    def build_supervised_example(
        self, messages: Sequence[Message], train_on_what: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE
    ) -> tuple[tinker.ModelInput, np.ndarray]:
        examples = self._examples(messages, train_on_what)
        if len(examples) != 1:
            raise RendererError(
                f"{self.name} renders this conversation as {len(examples)} examples (one per trained "
                "assistant message, each with its own history): use build_supervised_examples"
            )
        return examples[0]

    def build_supervised_examples(
        self, messages: Sequence[Message], train_on_what: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_TURN
    ) -> list[tuple[tinker.ModelInput, np.ndarray]]:
        return self._examples(messages, train_on_what)

    def get_stop_sequences(self) -> list[int] | list[str]:
        stop = self.native.stop()
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else list(stop)

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        from tml_renderers import chat

        _, parser = self.native.render_for_completion([])
        fallback: Message = {"role": "assistant", "content": self.codec.decode(tokens)}
        try:
            parsed = parser.parse_tokens(list(tokens))
        except ValueError:
            return fallback, ParseTermination.MALFORMED
        body = [message for message in parsed if not isinstance(message.content, chat.ModelEndSampling)]
        ended = len(body) != len(parsed)
        dicts = chat.OpenAIMessage.to_oss_messages(chat.OpenAIMessage.from_messages(body)) if body else []
        message = dicts[-1] if dicts else fallback
        return message, ParseTermination.STOP_SEQUENCE if ended else ParseTermination.MALFORMED


def _span_tokens(spans: Sequence[Any]) -> list[int]:
    tokens: list[int] = []
    for span in spans:
        inner = span.span
        if not hasattr(inner, "tokens"):
            raise RendererError(f"tml-renderers produced a non-text span ({type(inner).__name__}); only text is supported")
        tokens += inner.tokens
    return tokens


def _trained_assistant_indices(messages: Sequence[Message], train_on_what: TrainOnWhat, name: str) -> set[int]:
    assistants = {i for i, message in enumerate(messages) if message["role"] == "assistant"}
    match train_on_what:
        case TrainOnWhat.ALL_ASSISTANT_MESSAGES:
            return assistants
        case TrainOnWhat.LAST_ASSISTANT_MESSAGE:
            return {len(messages) - 1} & assistants
        case TrainOnWhat.LAST_ASSISTANT_TURN:
            start = last_user_index(messages) + 1
            return {i for i in assistants if i >= start}
        case TrainOnWhat.CUSTOMIZED:
            return {i for i in assistants if messages[i].get("trainable", False)}
    raise RendererError(
        f"{name} trains assistant messages only: train_on_what must be last_assistant_message, "
        f"last_assistant_turn, all_assistant_messages or customized, not {train_on_what.value}"
    )
