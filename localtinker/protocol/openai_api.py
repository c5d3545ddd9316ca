"""OpenAI's chat/completions wire format <-> the engine's SampleSpec and SampleResult (no HTTP, no engine).

Hosted Tinker serves an OpenAI-compatible API at ``<base_url>/oai/api/v1`` whose ``model`` is a base model or
a ``tinker://`` checkpoint; localtinker answers the same requests. Parsing raises :class:`OpenAIError`, which
carries OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) so the official client
raises the matching exception (BadRequestError, NotFoundError, ...).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import JSONResponse

from localtinker.engine.api import TOPK_MASK, SampledSequence, SampleExtrasSpec, SampleSpec, TopK

MAX_N = 128
MAX_TOP_LOGPROBS = 20


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")
        if self.status >= 500:
            kind = "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer this module uses."""

    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...


@dataclass(frozen=True)
class OpenAIRequest:
    """One chat or completions request, decoded; ``prompts`` holds token ids (one entry per prompt)."""

    chat: bool
    model: str
    messages: list[dict[str, Any]] | None
    prompts: list[list[int]] | None  # completions: the prompt(s) already as ids, or None until tokenized
    texts: list[str] | None  # completions: the prompt(s) as text
    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    echo: bool

    def spec(self, prompt: list[int]) -> SampleSpec:
        return SampleSpec(
            prompt_tokens=tuple(prompt),
            num_samples=self.n,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_strings=self.stop,
        )

    def extras(self) -> SampleExtrasSpec:
        return SampleExtrasSpec(topk_sample_logprobs=self.top_logprobs if self.logprobs else 0)


def _get(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise OpenAIError(400, f"'{name}' must be {_kind_name(kinds)}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise OpenAIError(400, f"'{name}' must be {_kind_name(kinds)}, got {value!r}", name)
    return value


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = [k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,))]
    return " or ".join({"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
                        "list": "a list", "dict": "an object"}.get(n, n) for n in names)


def parse_request(body: Any, chat: bool) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    model = _get(body, "model", str)
    if not model:
        raise OpenAIError(400, "'model' is required: a base model name or a tinker:// checkpoint path", "model")
    messages, prompts, texts = None, None, None
    if chat:
        messages = _get(body, "messages", list)
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise OpenAIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        messages = [{**m, "content": _message_text(m.get("content"))} for m in messages]
    else:
        prompts, texts = _parse_prompt(body.get("prompt"))
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise OpenAIError(400, f"'n' must be between 1 and {MAX_N}, got {n}", "n")
    max_tokens = _get(body, "max_completion_tokens", int, None) if chat else None
    max_tokens = _get(body, "max_tokens", int, max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(400, f"'max_tokens' must be >= 1, got {max_tokens}", "max_tokens")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    if not (math.isfinite(temperature) and 0 <= temperature <= 2):
        raise OpenAIError(400, f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise OpenAIError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise OpenAIError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if chat:
        logprobs = bool(_get(body, "logprobs", bool, False))
        top_logprobs = _get(body, "top_logprobs", int, 0)
    else:  # completions: logprobs is the number of top alternatives (0 = the chosen token's only)
        requested = _get(body, "logprobs", int, None)
        logprobs, top_logprobs = requested is not None, requested or 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise OpenAIError(400, f"top logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}", "top_logprobs")
    stream_options = _get(body, "stream_options", dict, {})
    return OpenAIRequest(
        chat=chat,
        model=model,
        messages=messages,
        prompts=prompts,
        texts=texts,
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=_get(body, "seed", int, None),
        stop=tuple(stop or ()),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        echo=bool(_get(body, "echo", bool, False)),
    )


def _message_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list (images are not supported)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" for p in content):
            raise OpenAIError(400, "only text message content is supported by localtinker", "messages")
        return "".join(str(p.get("text", "")) for p in content)
    raise OpenAIError(400, "message 'content' must be a string or a list of text parts", "messages")


def _parse_prompt(prompt: Any) -> tuple[list[list[int]] | None, list[str] | None]:
    if isinstance(prompt, str):
        return None, [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return None, list(prompt)
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return [list(prompt)], None
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt], None
    raise OpenAIError(400, "'prompt' must be a string, a list of strings, or token ids (a list, or a list of lists)", "prompt")


def _is_id(token: Any) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and token >= 0


# ---- results ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One sampled sequence as OpenAI reports it: the text cut at a stop string, and its tokens."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    top: list[list[tuple[int, float]]] | None = None  # per kept token: its top alternatives, best first


def _top_lists(top: TopK | None, length: int) -> list[list[tuple[int, float]]]:
    if top is None:
        return [[] for _ in range(length)]
    return [
        [(int(t), float(lp)) for t, lp in zip(ids, lps) if lp != TOPK_MASK]
        for ids, lps in zip(top.token_ids, top.logprobs)
    ]


def choice(sequence: SampledSequence, tokenizer: Tokenizer, stop: tuple[str, ...], top: TopK | None = None) -> Choice:
    """The visible completion: special tokens (EOS) dropped, text cut before the first stop string."""
    special = set(tokenizer.all_special_ids)
    tops = _top_lists(top, len(sequence.tokens))
    kept_top = [alt for t, alt in zip(sequence.tokens, tops) if t not in special]
    pairs = [(t, lp) for t, lp in zip(sequence.tokens, sequence.logprobs) if t not in special]
    text = tokenizer.decode([t for t, _ in pairs], skip_special_tokens=True)
    finish = "stop" if sequence.stop_reason == "stop" else "length"
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    if cut >= 0:
        text, finish = text[:cut], "stop"
        kept = 0
        while kept < len(pairs) and len(tokenizer.decode([t for t, _ in pairs[:kept]], skip_special_tokens=True)) < cut:
            kept += 1
        pairs = pairs[:kept]
    return Choice(text, [t for t, _ in pairs], [lp for _, lp in pairs], finish, kept_top[: len(pairs)])


def _entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    piece = tokenizer.decode([token])
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


def _chat_logprobs(request: OpenAIRequest, tokenizer: Tokenizer, c: Choice) -> dict[str, Any] | None:
    if not request.logprobs:
        return None
    tops = c.top or [[] for _ in c.tokens]
    entries = [
        {**_entry(tokenizer, t, lp), "top_logprobs": [_entry(tokenizer, a, alp) for a, alp in alts[: request.top_logprobs]]}
        for t, lp, alts in zip(c.tokens, c.logprobs, tops)
    ]
    return {"content": entries, "refusal": None}


def _completion_logprobs(request: OpenAIRequest, tokenizer: Tokenizer, c: Choice) -> dict[str, Any] | None:
    if not request.logprobs:
        return None
    pieces = [tokenizer.decode([t]) for t in c.tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    tops = c.top or [[] for _ in c.tokens]
    top = [
        {tokenizer.decode([a]): alp for a, alp in alts[: request.top_logprobs]} if request.top_logprobs else None
        for alts in tops
    ]
    return {"tokens": pieces, "token_logprobs": c.logprobs, "top_logprobs": top, "text_offset": offsets}


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def chat_response(
    request: OpenAIRequest, tokenizer: Tokenizer, prompt_tokens: int, choices: list[Choice]
) -> dict[str, Any]:
    return {
        "id": new_id(True),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(request, tokenizer, c),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, choices),
    }


def completion_response(
    request: OpenAIRequest, tokenizer: Tokenizer, prompt_tokens: int, choices: list[Choice], echoed: list[str]
) -> dict[str, Any]:
    """``choices`` are prompt-major (prompt i's samples at i*n ... i*n + n - 1); ``echoed`` the prompt texts."""
    return {
        "id": new_id(False),
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [
            {
                "index": i,
                "text": (echoed[i // request.n] if request.echo else "") + c.text,
                "logprobs": _completion_logprobs(request, tokenizer, c),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, choices),
    }


class ChunkFormat:
    """OpenAI's server-sent events for one streamed response: role, text, finish, usage, error, done."""

    done = "data: [DONE]\n\n"

    def __init__(self, request: OpenAIRequest, response_id: str, created: int) -> None:
        self.chat = request.chat
        self.base = {"id": response_id, "created": created, "model": request.model,
                     "object": "chat.completion.chunk" if request.chat else "text_completion"}

    def _event(self, choice_body: dict[str, Any]) -> str:
        return f"data: {json.dumps({**self.base, 'choices': [choice_body]})}\n\n"

    def role(self, index: int) -> str:
        return self._event({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})

    def text(self, index: int, piece: str, logprobs: dict[str, Any] | None = None) -> str:
        if self.chat:
            return self._event({"index": index, "delta": {"content": piece}, "logprobs": logprobs, "finish_reason": None})
        return self._event({"index": index, "text": piece, "logprobs": logprobs, "finish_reason": None})

    def finish(self, index: int, reason: str) -> str:
        end = {"index": index, "logprobs": None, "finish_reason": reason}
        return self._event({**end, "delta": {}} if self.chat else {**end, "text": ""})

    def usage(self, usage: dict[str, int]) -> str:
        return f"data: {json.dumps({**self.base, 'choices': [], 'usage': usage})}\n\n"

    @staticmethod
    def error(message: str) -> str:
        """A failure after the stream began (the status line is sent): the official client raises APIError."""
        return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'param': None, 'code': None}})}\n\n"


class StreamedText:
    """The visible text of one sample while it is decoded, released only as far as it is final: a trailing
    partial UTF-8 character, or a tail that may yet become a stop string, waits for the next tokens."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.special = set(tokenizer.all_special_ids)
        self.sent = ""
        self.stopped = False

    def update(self, tokens: list[int]) -> str:
        """The text to send now, given every token of the sample so far."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode([t for t in tokens if t not in self.special], skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        else:
            text = text.rstrip("\ufffd")
            held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - held]
        return self._release(text)

    def finish(self, final_text: str) -> str:
        """What is left to send of the finished sample's text (``choice``'s, cut at the stop string)."""
        return self._release(final_text)

    def _release(self, text: str) -> str:
        if not text.startswith(self.sent):  # decoding changed a character already sent: nothing safe to add
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def stream_events(response: dict[str, Any], request: OpenAIRequest) -> Iterator[str]:
    """A finished response as OpenAI's server-sent events: per choice a role chunk (chat), one chunk per
    token of text with its logprobs, a chunk with the finish reason, the usage chunk when asked, then
    ``[DONE]``. Used when logprobs are asked (they are computed on the finished sequence); otherwise the
    route streams tokens as they are decoded."""
    chat = request.chat
    chunks = ChunkFormat(request, response["id"], response["created"])
    for c in response["choices"]:
        index = c["index"]
        text = c["message"]["content"] if chat else c["text"]
        if chat:
            yield chunks.role(index)
        content_logprobs = (c["logprobs"] or {}).get("content") if chat else None
        pieces = [e["token"] for e in content_logprobs] if content_logprobs else ([text] if text else [])
        if "".join(pieces) != text:
            pieces = [text]
        for j, piece in enumerate(pieces):
            whole = chat and content_logprobs and len(pieces) == len(content_logprobs)
            yield chunks.text(index, piece, {"content": [content_logprobs[j]], "refusal": None} if whole else None)
        yield chunks.finish(index, c["finish_reason"])
    if request.include_usage:
        yield chunks.usage(response["usage"])
    yield chunks.done
