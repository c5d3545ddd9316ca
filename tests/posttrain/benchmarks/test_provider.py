"""The inspect provider ``tinker/<model>`` against a real localtinker server on the tiny model."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import tinker
from inspect_ai.model import ChatMessageSystem, ChatMessageUser, GenerateConfig, get_model

from posttrain.benchmarks.provider import TinkerModelAPI, retry_decision, sampling_params, stop_condition
from posttrain.renderers.registry import get_renderer
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL


@pytest.fixture
def tiny_model(tinker_server):
    from localtinker.engine.models import tiny_random_dir

    import posttrain.benchmarks.provider  # noqa: F401  (registers tinker/)

    model = get_model(f"tinker/{TINY_MODEL}", base_url=tinker_server.base_url, api_key=LOCAL_API_KEY,
                      tokenizer=str(tiny_random_dir()), memoize=False)
    yield model
    model.api.close()


@pytest.fixture
def chatml():
    from localtinker.engine.models import tiny_random_dir
    from transformers import AutoTokenizer

    return get_renderer("chatml", AutoTokenizer.from_pretrained(tiny_random_dir()))


def test_concurrent_requests_honour_max_tokens_and_num_choices(tiny_model) -> None:
    config = GenerateConfig(max_tokens=5, temperature=0.0, num_choices=3)

    async def ask_all():
        prompts = [[ChatMessageSystem(content="Be brief."), ChatMessageUser(content=f"What is {i} + 1?")] for i in range(6)]
        return await asyncio.gather(*[tiny_model.generate(prompt, config=config) for prompt in prompts])

    outputs = asyncio.run(ask_all())
    assert len(outputs) == 6
    for output in outputs:
        assert len(output.choices) == 3
        assert output.usage.input_tokens > 0 and 3 <= output.usage.output_tokens <= 15
        assert all(choice.stop_reason in ("max_tokens", "stop", "unknown") for choice in output.choices)
        # temperature 0 is greedy: the three continuations of one prompt agree
        assert len({choice.message.text for choice in output.choices}) == 1


def test_sampling_params_follow_the_generate_config(chatml) -> None:
    greedy = sampling_params(GenerateConfig(temperature=0.0, max_tokens=7, seed=3), chatml, 512)
    assert (greedy.top_k, greedy.temperature, greedy.max_tokens, greedy.seed) == (1, 1.0, 7, 3)
    default = sampling_params(GenerateConfig(), chatml, 512)
    assert (default.top_k, default.temperature, default.max_tokens) == (-1, 1.0, 512)
    assert default.stop == chatml.get_stop_sequences()


def test_stop_strings_join_the_renderers_stop_tokens_as_text(chatml) -> None:
    assert all(isinstance(stop, int) for stop in chatml.get_stop_sequences())
    assert stop_condition(chatml, ["\nQ:"]) == ["<|im_end|>", "\nQ:"]
    assert stop_condition(chatml, None) == chatml.get_stop_sequences()


def test_errors_map_to_inspects_retry_semantics() -> None:
    request = httpx.Request("POST", "http://localhost/api/v1/asample")

    def status_error(kind, code: int, headers=None):
        return kind("boom", response=httpx.Response(code, request=request, headers=headers or {}), body=None)

    assert retry_decision(status_error(tinker.RateLimitError, 429, {"retry-after": "2"})) == retry_decision(
        status_error(tinker.RateLimitError, 429, {"retry-after": "2"}))
    limited = retry_decision(status_error(tinker.RateLimitError, 429, {"retry-after": "2"}))
    assert (limited.retry, limited.kind, limited.retry_after) == (True, "rate_limit", 2.0)
    assert retry_decision(status_error(tinker.InternalServerError, 503)).kind == "transient"
    assert retry_decision(tinker.APIConnectionError(request=request)).retry
    assert retry_decision(tinker.RequestFailedError("oom", "r1", tinker.types.RequestErrorCategory.Server)).retry
    assert not retry_decision(tinker.RequestFailedError("bad", "r1", tinker.types.RequestErrorCategory.User)).retry
    assert not retry_decision(status_error(tinker.BadRequestError, 400)).retry
    assert not retry_decision(ValueError("bad renderer")).retry


def test_a_missing_checkpoint_fails_at_once_without_retrying(tinker_server) -> None:
    from localtinker.engine.models import tiny_random_dir

    api = TinkerModelAPI("tinker://no-such-run/sampler_weights/final", base_url=tinker_server.base_url,
                         api_key=LOCAL_API_KEY, tokenizer=str(tiny_random_dir()))
    with pytest.raises(tinker.NotFoundError, match="does not exist") as caught:
        asyncio.run(api.generate([ChatMessageUser(content="hi")], [], "auto", GenerateConfig(max_tokens=2)))
    assert not api.should_retry(caught.value)
    api.close()


def test_unknown_model_args_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown model args \\['rendrer'\\]"):
        TinkerModelAPI(TINY_MODEL, rendrer="chatml")
