"""The OpenAI-compatible endpoint at ``/oai/api/v1`` (chat/completions, completions, models), as on hosted Tinker.

``model`` is a base model name or a ``tinker://`` checkpoint path. Prompts are rendered with the model's
own chat template, and every request joins the engine's sampling queue like an SDK ``asample`` (so it is
batched with other sampling). Streaming sends the finished completion as server-sent events, one chunk
per token: the engine reports a sequence when it is complete.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from localtinker.engine.api import (
    EngineUserError,
    ModelInfo,
    SampleExtras,
    SampleExtrasSpec,
    SampleResult,
    SampleSpec,
    UnknownModelError,
)

from ..core import Handler, ServiceCore
from ..errors import ProtocolError
from ..openai_api import (
    OpenAIError,
    OpenAIRequest,
    choice,
    chat_response,
    completion_response,
    parse_request,
    stream_events,
)

logger = logging.getLogger("localtinker.protocol")

OAI = "/oai/api/v1"


def openai_endpoint(handler: Handler) -> Handler:
    """Errors in OpenAI's shape, so the official client raises its matching exception."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except OpenAIError as e:
            return e.response()
        except UnknownModelError as e:
            return OpenAIError(404, str(e), "model", "model_not_found").response()
        except (EngineUserError, ProtocolError) as e:
            return OpenAIError(getattr(e, "status", 400), getattr(e, "message", str(e))).response()
        except Exception as e:  # noqa: BLE001 - a bad request must never take the server down
            logger.exception("OpenAI-compatible request failed", exc_info=e)
            return OpenAIError(500, f"internal error: {type(e).__name__}: {e}").response()

    return endpoint


class OpenAIRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core
        self._tokenizers: dict[str, Any] = {}
        self._supported: list[ModelInfo] | None = None

    def routes(self) -> list[Route]:
        return [
            Route(f"{OAI}/chat/completions", openai_endpoint(self.chat_completions), methods=["POST"]),
            Route(f"{OAI}/completions", openai_endpoint(self.completions), methods=["POST"]),
            Route(f"{OAI}/models", openai_endpoint(self.models), methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": info.base_model, "object": "model", "created": 0, "owned_by": "localtinker"}
                    for info in await self._supported_models()
                ],
            }
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from e
        parsed = parse_request(body, chat)
        sampler_id, base_model = await self._sampler(parsed.model)
        tokenizer = await self._tokenizer(base_model)
        prompts, texts = self._prompts(parsed, tokenizer)
        results = await asyncio.gather(*(self._sample(sampler_id, parsed.spec(p), parsed.extras()) for p in prompts))
        choices = [
            choice(seq, tokenizer, parsed.stop, found.topk_sample[i] if found and found.topk_sample else None)
            for result, found in results
            for i, seq in enumerate(result.sequences)
        ]
        prompt_tokens = sum(len(p) for p in prompts)
        if chat:
            response = chat_response(parsed, tokenizer, prompt_tokens, choices)
        else:
            response = completion_response(parsed, tokenizer, prompt_tokens, choices, texts)
        if parsed.stream:
            return StreamingResponse(stream_events(response, parsed), media_type="text/event-stream")
        return JSONResponse(response)

    # ---- model, tokenizer, prompt ------------------------------------------------------------------------

    async def _sampler(self, model: str) -> tuple[str, str]:
        """A sampler over ``model`` (re-created per request, so a re-saved checkpoint is picked up)."""
        is_path = model.startswith("tinker://")
        if is_path and "/external_weights/" in model:
            raise OpenAIError(
                400, f"{model} holds weights exported for download; use its sampler_weights or weights path", "model"
            )
        sampler_id = f"oai:{model}"
        try:
            base_model = await self.core.on_worker(
                f"openai sampler {model}",
                lambda e: e.create_sampler(sampler_id, None if is_path else model, model if is_path else None),
            )
        except (UnknownModelError, EngineUserError) as e:
            raise OpenAIError(
                404,
                f"The model {model!r} does not exist on this server: {e} Use a base model "
                f"(GET {OAI}/models lists them) or a tinker://<run>/sampler_weights/<name> path.",
                "model",
                "model_not_found",
            ) from e
        return sampler_id, base_model

    async def _supported_models(self) -> list[ModelInfo]:
        if self._supported is None:
            self._supported = await self.core.on_worker("supported_models", lambda e: e.supported_models())
        return self._supported

    async def _tokenizer(self, base_model: str) -> Any:
        known = {info.base_model: info.tokenizer_id for info in await self._supported_models()}
        tokenizer_id = known.get(base_model, base_model)
        if tokenizer_id not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[tokenizer_id] = await asyncio.to_thread(AutoTokenizer.from_pretrained, tokenizer_id)
        return self._tokenizers[tokenizer_id]

    @staticmethod
    def _prompts(parsed: OpenAIRequest, tokenizer: Any) -> tuple[list[list[int]], list[str]]:
        if parsed.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise OpenAIError(400, f"{parsed.model} has no chat template; use {OAI}/completions", "model")
            rendered = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True, tokenize=True)
            ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
            return [list(ids)], [""]
        if parsed.prompts is not None:
            return parsed.prompts, [tokenizer.decode(p) for p in parsed.prompts]
        assert parsed.texts is not None
        prompts = [tokenizer.encode(text) for text in parsed.texts]
        if any(not p for p in prompts):
            raise OpenAIError(400, "'prompt' is empty; send at least one token of text", "prompt")
        return prompts, parsed.texts

    async def _sample(
        self, sampler_id: str, spec: SampleSpec, extras: SampleExtrasSpec
    ) -> tuple[SampleResult, SampleExtras | None]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[SampleResult, SampleExtras | None]] = loop.create_future()

        def on_done(result: SampleResult, found: SampleExtras | None) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result((result, found)))

        def on_error(error: BaseException) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_exception(error))

        self.core.submit_sample(sampler_id, spec, extras, on_done, on_error)
        return await done
