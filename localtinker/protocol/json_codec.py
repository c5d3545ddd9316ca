"""JSON request bodies -> the engine's dataclasses, with errors that name the bad field."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from localtinker.engine.api import (
    SUPPORTED_LOSSES,
    AdamSpec,
    LoraSpec,
    SampleExtrasSpec,
    SampleSpec,
    adam_spec_problems,
)

from .errors import bad_request

UNSUPPORTED_LOSS_HINTS = {
    "stable_reinforce": "it has no published formula, so localtinker cannot reproduce it",
    "custom": "server-side custom losses are not supported; forward_backward_custom runs them client-side",
}


def parse_json_object(body: bytes, endpoint: str) -> dict[str, Any]:
    try:
        value = json.loads(body) if body else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"{endpoint}: the body is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise bad_request(f"{endpoint}: the body must be a JSON object, got {type(value).__name__}")
    return value


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], endpoint: str, default: Any = ...) -> Any:
    """``body[name]`` checked against ``kind``; a missing field is an error unless ``default`` is given."""
    if name not in body or body[name] is None:
        if default is ...:
            raise bad_request(f"{endpoint}: required field {name!r} is missing")
        return default
    value = body[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and kind is not bool and (kind is int or kind is float):
        raise bad_request(f"{endpoint}: field {name!r} must be {kind.__name__}, got a boolean")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise bad_request(f"{endpoint}: field {name!r} must be {names}, got {type(value).__name__}")
    return value


def check_loss_fn(loss_fn: str) -> None:
    if loss_fn in SUPPORTED_LOSSES:
        return
    why = UNSUPPORTED_LOSS_HINTS.get(loss_fn, "it is not a loss localtinker knows")
    raise bad_request(
        f"loss_fn {loss_fn!r} is not supported: {why}. Supported losses: {', '.join(SUPPORTED_LOSSES)}"
    )


def parse_lora(body: dict[str, Any], endpoint: str) -> LoraSpec:
    lora = field(body, "lora_config", dict, endpoint, default={})
    rank = field(lora, "rank", int, endpoint + ".lora_config", default=32)
    if not 1 <= rank <= 1024:
        raise bad_request(f"{endpoint}: lora_config.rank={rank} must be between 1 and 1024")
    spec = LoraSpec(
        rank=rank,
        seed=field(lora, "seed", int, endpoint + ".lora_config", default=None),
        train_unembed=field(lora, "train_unembed", bool, endpoint + ".lora_config", default=True),
        train_mlp=field(lora, "train_mlp", bool, endpoint + ".lora_config", default=True),
        train_attn=field(lora, "train_attn", bool, endpoint + ".lora_config", default=True),
    )
    if not (spec.train_unembed or spec.train_mlp or spec.train_attn):
        raise bad_request(f"{endpoint}: at least one of train_mlp, train_attn, train_unembed must be true")
    return spec


def check_optimizer_config(body: dict[str, Any], endpoint: str) -> None:
    config = body.get("optimizer_config")
    if config is None:
        return
    kind = config.get("type") if isinstance(config, dict) else None
    if kind != "adamw":
        raise bad_request(f"{endpoint}: optimizer_config type {kind!r} is not supported; localtinker trains with AdamW")


def parse_adam(body: dict[str, Any]) -> AdamSpec:
    endpoint = "optim_step"
    params = body.get("adam_params")
    if params is None:
        other = body.get("optimizer_params") or body.get("optim_params")
        kind = other.get("type") if isinstance(other, dict) else None
        raise bad_request(f"optim_step: optimizer {kind!r} is not supported; send adam_params (AdamW)")
    if not isinstance(params, dict):
        raise bad_request("optim_step: adam_params must be a JSON object")
    where = endpoint + ".adam_params"
    nulls = [name for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm") if name in params and params[name] is None]
    if nulls:  # the SDK serialises NaN as null: taking the default would silently train at another rate
        raise bad_request(f"optim_step: bad AdamParams: {', '.join(nulls)} is null (a NaN on the client is sent as null); pass finite numbers")
    defaults = AdamSpec()
    spec = AdamSpec(
        **{
            name: field(params, name, float, where, default=getattr(defaults, name))
            for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        }
    )
    problems = adam_spec_problems(spec)
    if problems:
        raise bad_request(f"optim_step: bad AdamParams: {'; '.join(problems)}")
    return spec


def parse_prompt_tokens(prompt: Any, endpoint: str) -> tuple[int, ...]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise bad_request(f"{endpoint}: prompt must be a ModelInput object with a 'chunks' list")
    tokens: list[int] = []
    for j, chunk in enumerate(prompt["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise bad_request(
                f"{endpoint}: prompt.chunks[{j}] is a {kind!r} chunk; localtinker serves text models only"
            )
        chunk_tokens = chunk.get("tokens")
        if not isinstance(chunk_tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in chunk_tokens
        ):
            raise bad_request(f"{endpoint}: prompt.chunks[{j}].tokens must be a list of non-negative ints")
        tokens.extend(chunk_tokens)
    if not tokens:
        raise bad_request(f"{endpoint}: the prompt is empty; send at least one token")
    return tuple(tokens)


def parse_sample_spec(body: dict[str, Any]) -> tuple[SampleSpec, int | None]:
    """The engine's SampleSpec and the ``prompt_logprobs_last_n`` the protocol applies itself."""
    endpoint = "asample"
    prompt = parse_prompt_tokens(body.get("prompt"), endpoint)
    num_samples = field(body, "num_samples", int, endpoint, default=1)
    if not 1 <= num_samples <= 256:
        raise bad_request(f"{endpoint}: num_samples={num_samples} must be between 1 and 256")
    params = field(body, "sampling_params", dict, endpoint)
    where = endpoint + ".sampling_params"
    max_tokens = field(params, "max_tokens", int, where, default=None)  # None: up to the end of the context
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{where}: max_tokens={max_tokens} must be >= 1 (or null for no limit but the context)")
    temperature = field(params, "temperature", float, where, default=1.0)
    top_p = field(params, "top_p", float, where, default=1.0)
    top_k = field(params, "top_k", int, where, default=-1)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise bad_request(f"{where}: temperature={temperature} must be >= 0")
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"{where}: top_p={top_p} must be in (0, 1]")
    if top_k == 0 or top_k < -1:
        raise bad_request(f"{where}: top_k={top_k} must be -1 (no limit) or >= 1")
    stop_strings, stop_token_ids = _parse_stop(params.get("stop"), where)
    last_n = field(body, "prompt_logprobs_last_n", int, endpoint, default=None)
    want_prompt_logprobs = bool(field(body, "prompt_logprobs", bool, endpoint, default=False))
    if last_n is not None and not (want_prompt_logprobs and 1 <= last_n <= len(prompt) - 1):
        raise bad_request(
            f"{endpoint}: prompt_logprobs_last_n={last_n} needs prompt_logprobs and must be "
            f"between 1 and len(prompt) - 1 = {len(prompt) - 1}"
        )
    spec = SampleSpec(
        prompt_tokens=prompt,
        num_samples=num_samples,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=field(params, "seed", int, where, default=None),
        stop_strings=stop_strings,
        stop_token_ids=stop_token_ids,
        prompt_logprobs=want_prompt_logprobs,
    )
    return spec, last_n


MAX_TOPK = 1024  # per position; a full-vocabulary answer belongs in forward(), not in a sample


def parse_sample_extras(body: dict[str, Any]) -> SampleExtrasSpec:
    """Top-k, target and alternative-token requests of an ``asample`` body (each 0 / null when not asked)."""
    endpoint = "asample"
    counts = {}
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        counts[name] = field(body, name, int, endpoint, default=0)
        if not 0 <= counts[name] <= MAX_TOPK:
            raise bad_request(f"{endpoint}: {name}={counts[name]} must be between 0 and {MAX_TOPK}")
    if counts["topk_prompt_logprobs"] and not body.get("prompt_logprobs"):
        raise bad_request(f"{endpoint}: topk_prompt_logprobs needs prompt_logprobs (include_prompt_logprobs=True)")
    targets = body.get("target_prompt_logprobs")
    return SampleExtrasSpec(
        topk_prompt_logprobs=counts["topk_prompt_logprobs"],
        topk_sample_logprobs=counts["topk_sample_logprobs"],
        target_prompt_logprobs=None if targets is None else _target_ids(targets, endpoint + ".target_prompt_logprobs"),
        prompt_alt_tokens_k=counts["prompt_alt_tokens_k"],
    )


def _target_ids(tensor: Any, where: str) -> np.ndarray:
    """A TensorData of int64 ids, dense or sparse CSR (absent cells = -1), as a dense [rows, K] array."""
    if not isinstance(tensor, dict) or not isinstance(tensor.get("data"), list):
        raise bad_request(f"{where}: send a TensorData {{data, dtype: int64, shape: [len(prompt) - 1, K]}}")
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise bad_request(f"{where}: shape must be [len(prompt) - 1, K], got {shape!r}")
    try:
        data = np.asarray(tensor["data"], dtype=np.int64)
        crow, col = tensor.get("sparse_crow_indices"), tensor.get("sparse_col_indices")
        if crow is None:
            return data.reshape(shape)
        dense = np.full(shape, -1, dtype=np.int64)
        rows = np.repeat(np.arange(shape[0]), np.diff(np.asarray(crow, dtype=np.int64)))
        dense[rows, np.asarray(col, dtype=np.int64)] = data
        return dense
    except (ValueError, IndexError, TypeError) as e:
        raise bad_request(f"{where}: not a valid {shape} int64 tensor: {e}") from e


def _parse_stop(stop: Any, where: str) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """``None`` keeps EOS stopping; ``[]`` disables every stop, EOS included."""
    if stop is None:
        return (), None
    if isinstance(stop, str):
        return (stop,), None
    if isinstance(stop, list):
        if not stop:
            return (), ()
        if all(isinstance(s, str) for s in stop):
            return tuple(stop), None
        if all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stop):
            return (), tuple(stop)
    raise bad_request(f"{where}: stop must be a string, a list of strings or a list of token ids")
