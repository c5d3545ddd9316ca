"""The OpenAI-compatible endpoint at ``/oai/api/v1`` (chat/completions, completions, models), as on hosted Tinker.

``model`` is a base model name or a ``tinker://`` checkpoint path. Prompts are rendered with the model's
own chat template, and every request joins the engine's sampling queue like an SDK ``asample`` (so it is
batched with other sampling). Streaming sends text as the engine decodes it: the engine reports each
streaming request's tokens after every decode step. With ``logprobs`` the stream is made from the finished
completion instead (top-k figures are computed on the finished sequence), one chunk per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
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
    ChunkFormat,
    OpenAIError,
    OpenAIRequest,
    StreamedText,
    choice,
    chat_response,
    completion_response,
    new_id,
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
        if parsed.stream and not parsed.logprobs:
            return await self._stream(parsed, sampler_id, tokenizer, prompts, texts)
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

    # ---- streaming as the engine decodes ------------------------------------------------------------------

    async def _stream(
        self, parsed: OpenAIRequest, sampler_id: str, tokenizer: Any, prompts: list[list[int]], texts: list[str]
    ) -> Response:
        """Submits every prompt with a progress callback; the response starts with the first news from the
        engine, so a request the engine refuses still gets its HTTP error status."""
        loop = asyncio.get_running_loop()
        news: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()

        def post(kind: str, prompt: int) -> Any:
            return lambda value, *_: loop.call_soon_threadsafe(news.put_nowait, (kind, prompt, value))

        for index, prompt in enumerate(prompts):
            self.core.submit_sample(
                sampler_id, parsed.spec(prompt), parsed.extras(), post("done", index), post("error", index),
                on_progress=post("progress", index),
            )
        first = await news.get()
        if first[0] == "error":
            raise first[2]
        events = self._events(parsed, tokenizer, prompts, texts, first, news)
        return StreamingResponse(events, media_type="text/event-stream")

    @staticmethod
    async def _events(
        parsed: OpenAIRequest, tokenizer: Any, prompts: list[list[int]], texts: list[str],
        first: tuple[str, int, Any], news: asyncio.Queue[tuple[str, int, Any]],
    ) -> AsyncIterator[str]:
        chunks = ChunkFormat(parsed, new_id(parsed.chat), int(time.time()))
        streams = [StreamedText(tokenizer, parsed.stop) for _ in range(len(prompts) * parsed.n)]
        for index in range(len(streams)):
            if parsed.chat:
                yield chunks.role(index)
            elif parsed.echo:
                yield chunks.text(index, texts[index // parsed.n])
        unfinished, completion_tokens, item = len(prompts), 0, first
        while True:
            kind, prompt, value = item
            if kind == "error":
                yield chunks.error(f"{type(value).__name__}: {value}")
                return
            sequences = value if kind == "progress" else [seq.tokens for seq in value.sequences]
            for sample, tokens in enumerate(sequences):
                index = prompt * parsed.n + sample
                if kind == "progress":
                    delta = streams[index].update(tokens)
                else:
                    final = choice(value.sequences[sample], tokenizer, parsed.stop)
                    delta = streams[index].finish(final.text)
                    completion_tokens += len(final.tokens)
                if delta:
                    yield chunks.text(index, delta)
                if kind == "done":
                    yield chunks.finish(index, final.finish_reason)
            unfinished -= kind == "done"
            if not unfinished:
                break
            item = await news.get()
        if parsed.include_usage:
            prompt_tokens = sum(len(p) for p in prompts)
            yield chunks.usage({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens})
        yield chunks.done

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
