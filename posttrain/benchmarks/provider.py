"""The inspect-ai model provider ``tinker/<model>``: inspect's chat turns sampled through the tinker SDK.

``<model>`` is a base model name (``tinker/HuggingFaceTB/SmolLM2-135M-Instruct``) or a checkpoint's sampler
weights (``tinker/tinker://<run>/sampler_weights/<name>``). The conversation is rendered to tokens by our
renderer (``renderer=`` model arg, default ``auto``: the tokenizer's family, else its own chat template), sampled
with ``SamplingClient.sample`` and parsed back by the same renderer, exactly as training rendered it — the same
code against hosted Tinker and localtinker, since both speak the SDK's protocol.

Each inspect sample awaits its own request, and inspect runs up to ``max_connections`` of them at
once (64 by default here), so a localtinker server receives them together and batches them in its
decoder. ``num_choices`` becomes ``num_samples`` of one request (one prompt, n continuations).

Model args: ``renderer``, ``tokenizer`` (a local directory or hub id; default: the SDK's tokenizer for
the sampler's base model), ``max_connections``. Endpoint: ``base_url`` / ``api_key`` (inspect's
``--model-base-url`` / ``TINKER_BASE_URL`` and ``TINKER_API_KEY``); inspect logs neither key nor client.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import tinker
from inspect_ai.model import (
    ChatCompletionChoice,
    ChatMessage,
    ChatMessageAssistant,
    GenerateConfig,
    ModelAPI,
    ModelOutput,
    ModelUsage,
    modelapi,
)
from inspect_ai.model._model import RetryDecision
from inspect_ai.tool import ToolChoice, ToolInfo

from posttrain.completers import is_well_formed, message_text
from posttrain.renderers.registry import DEFAULT_RENDERER, get_renderer

PROVIDER = "tinker"
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_MAX_TOKENS = 512
SAMPLER_PATH_PREFIX = "tinker://"


class TinkerModelAPI(ModelAPI):
    """inspect-ai ``ModelAPI`` over a ``tinker.SamplingClient`` and one of our renderers."""

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig = GenerateConfig(),
        renderer: str = DEFAULT_RENDERER,
        tokenizer: str | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        **model_args: Any,
    ) -> None:
        if model_args:
            raise ValueError(
                f"tinker/{model_name}: unknown model args {sorted(model_args)}; the tinker provider takes "
                "renderer, tokenizer and max_connections (-M name=value)"
            )
        super().__init__(
            model_name=model_name,
            base_url=base_url or os.environ.get("TINKER_BASE_URL"),
            api_key=api_key,
            api_key_vars=["TINKER_API_KEY"],
            config=config,
        )
        if not model_name:
            raise ValueError("model 'tinker/': name a base model or a tinker:// sampler path after 'tinker/'")
        self.renderer_name = renderer
        self.tokenizer_source = tokenizer
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._service: tinker.ServiceClient | None = None
        self._sampler: tinker.SamplingClient | None = None
        self._renderer: Any = None

    # -- inspect hooks ---------------------------------------------------------------------------

    def max_connections(self) -> int:
        return self._max_connections

    def max_tokens(self) -> int | None:
        return DEFAULT_MAX_TOKENS

    def connection_key(self) -> str:
        return f"{self.base_url or 'hosted'}|{self.model_name}"

    def should_retry(self, ex: Exception) -> bool | RetryDecision:
        return retry_decision(ex)

    async def count_text_tokens(self, text: str) -> int:
        """Counted by the model's own tokenizer (inspect's default fetches tiktoken's vocabulary online)."""
        _, renderer = await asyncio.to_thread(self._ready)
        return len(renderer.codec.encode_content(text))

    def is_auth_failure(self, ex: Exception) -> bool:
        return isinstance(ex, tinker.AuthenticationError)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            service, self._service, self._sampler = self._service, None, None
        if service is not None:
            service.close("success").result(timeout=30)

    async def generate(
        self,
        input: list[ChatMessage],
        tools: list[ToolInfo],
        tool_choice: ToolChoice,
        config: GenerateConfig,
    ) -> ModelOutput:
        if tools:
            raise ValueError(f"tinker/{self.model_name}: tool calling is not supported by the tinker provider")
        sampler, renderer = await asyncio.to_thread(self._ready)
        messages = [chat_message_dict(message) for message in input]
        prompt = renderer.build_generation_prompt(messages)
        num_samples = max(1, config.num_choices or 1)
        params = sampling_params(config, renderer, self.max_tokens())
        response = await sampler.sample(prompt, num_samples, params)
        return self._output(response, renderer, prompt.length, bool(config.logprobs))

    # -- helpers ---------------------------------------------------------------------------------

    def _ready(self) -> tuple[tinker.SamplingClient, Any]:
        """The sampling client and renderer, made once on first use (blocking SDK calls, off the loop)."""
        with self._lock:
            if self._sampler is None:
                self._service = tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key)
                if self.model_name.startswith(SAMPLER_PATH_PREFIX):
                    sampler = self._service.create_sampling_client(model_path=self.model_name).result()
                else:
                    sampler = self._service.create_sampling_client(base_model=self.model_name).result()
                tokenizer = self._load_tokenizer(sampler)
                self._renderer = get_renderer(self.renderer_name, tokenizer)
                self._sampler = sampler
            return self._sampler, self._renderer

    def _load_tokenizer(self, sampler: tinker.SamplingClient) -> Any:
        if self.renderer_name.startswith("tml:"):
            return None
        if self.tokenizer_source:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.tokenizer_source)
        return sampler.get_tokenizer()

    def _output(self, response: Any, renderer: Any, prompt_tokens: int, with_logprobs: bool) -> ModelOutput:
        choices, output_tokens = [], 0
        for sequence in response.sequences:
            tokens = [int(token) for token in sequence.tokens]
            output_tokens += len(tokens)
            message, termination = renderer.parse_response(tokens)
            text = message_text(message)
            stop_reason = "max_tokens" if str(sequence.stop_reason) == "length" else "stop"
            if stop_reason == "stop" and not is_well_formed(termination):
                stop_reason = "unknown"
            choices.append(
                ChatCompletionChoice(
                    message=ChatMessageAssistant(content=text, model=self.model_name, source="generate"),
                    stop_reason=stop_reason,
                    logprobs=_logprobs(renderer, tokens, sequence.logprobs) if with_logprobs else None,
                )
            )
        usage = ModelUsage(input_tokens=prompt_tokens, output_tokens=output_tokens, total_tokens=prompt_tokens + output_tokens)
        return ModelOutput(model=self.model_name, choices=choices, usage=usage)


@modelapi(name=PROVIDER)
def tinker_model_api() -> type[ModelAPI]:
    """Registered with inspect as ``tinker/...`` (importing this module registers it)."""
    return TinkerModelAPI


def retry_decision(ex: BaseException) -> RetryDecision:
    """inspect's retry semantics for the SDK's errors: 429 scales concurrency down, 5xx / 408 / 409,
    dropped connections and server-side request failures retry as transient, everything else (bad
    request, auth, not found, a user-caused failure) fails at once."""
    if isinstance(ex, tinker.RateLimitError):
        return RetryDecision.rate_limit(_retry_after(ex))
    if isinstance(ex, (tinker.InternalServerError, tinker.APIConnectionError)):
        return RetryDecision.transient()
    if isinstance(ex, tinker.APIStatusError) and ex.status_code in (408, 409):
        return RetryDecision.transient()
    if isinstance(ex, tinker.RequestFailedError):
        return RetryDecision.transient() if str(ex.category).lower() == "server" else RetryDecision.no()
    return RetryDecision.no()


def sampling_params(config: GenerateConfig, renderer: Any, default_max_tokens: int | None) -> tinker.SamplingParams:
    """inspect's generate config as Tinker sampling params. Temperature 0 is greedy as ``top_k=1``
    (valid on every backend); the renderer's end-of-turn stops always apply, plus ``stop_seqs``."""
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    top_k = -1 if config.top_k is None else int(config.top_k)
    if temperature == 0.0:
        temperature, top_k = 1.0, 1
    return tinker.SamplingParams(
        max_tokens=config.max_tokens or default_max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=1.0 if config.top_p is None else float(config.top_p),
        seed=config.seed,
        stop=stop_condition(renderer, config.stop_seqs),
    )


def stop_condition(renderer: Any, stop_seqs: list[str] | None) -> list[str] | list[int] | None:
    """The renderer's stops plus inspect's ``stop_seqs``. Tinker takes strings or ids, never a mix, so
    a renderer that stops on token ids has them decoded to text when extra strings are asked for."""
    own = list(renderer.get_stop_sequences() or [])
    extra = [stop for stop in stop_seqs or [] if stop]
    if not extra:
        return own or None
    if own and isinstance(own[0], int):
        own = [renderer.decode([token]) for token in own]
    return list(dict.fromkeys([*own, *extra]))


def chat_message_dict(message: ChatMessage) -> dict[str, str]:
    """An inspect chat message as a renderer message: its role and its text (other parts refused)."""
    if isinstance(message.content, str):
        text = message.content
    else:
        parts = []
        for part in message.content:
            if part.type == "text":
                parts.append(part.text)
            elif part.type != "reasoning":
                raise ValueError(f"the tinker provider renders text only; a {message.role} message holds a {part.type} part")
        text = "".join(parts)
    role = "user" if message.role == "tool" else message.role
    return {"role": role, "content": text}


def _logprobs(renderer: Any, tokens: list[int], logprobs: list[float] | None) -> Any:
    from inspect_ai.model import Logprob, Logprobs

    if logprobs is None:
        return None
    pieces = [renderer.decode([token]) for token in tokens]
    return Logprobs(content=[Logprob(token=piece, logprob=float(value)) for piece, value in zip(pieces, logprobs)])


def _retry_after(ex: Any) -> float | None:
    response = getattr(ex, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
