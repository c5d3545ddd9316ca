"""The OpenAI-compatible endpoint through the official ``openai`` client against a real localtinker."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import tinker
from tinker import types

from localtinker.server import RunningServer, start_server
from tests.fixtures.server import TINY_MODEL

KEY = "tml-openai-test"
TOKENS = [1, 33, 4096, 17, 900, 2, 77, 31000]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("openai-storage"), dtype="float32", api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def sampler_path(server: RunningServer) -> Iterator[str]:
    with tinker.ServiceClient(base_url=server.base_url, api_key=KEY) as client:
        trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
        )
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
        yield trainer.save_weights_for_sampler("oai").result().path


def test_chat_with_a_base_model_uses_its_chat_template(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, seed=3, temperature=0.7
    )
    assert reply.object == "chat.completion" and reply.model == TINY_MODEL
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("stop", "length")
    # <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n in SmolLM2's template
    assert reply.usage.prompt_tokens >= 6 and 1 <= reply.usage.completion_tokens <= 5


def test_completion_of_a_checkpoint_with_logprobs_matches_the_sdk(oai: openai.OpenAI, server: RunningServer, sampler_path: str) -> None:
    reply = oai.completions.create(model=sampler_path, prompt=TOKENS, max_tokens=4, logprobs=1, seed=5)
    choice = reply.choices[0]
    assert len(choice.logprobs.token_logprobs) == reply.usage.completion_tokens == len(choice.logprobs.tokens)
    with tinker.ServiceClient(base_url=server.base_url, api_key=KEY) as client:
        sdk = client.create_sampling_client(model_path=sampler_path).result()
        sampled = sdk.sample(types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=4, seed=5)).result()
    np.testing.assert_allclose(choice.logprobs.token_logprobs, sampled.sequences[0].logprobs[: len(choice.logprobs.tokens)], atol=1e-5)


def test_chat_top_logprobs(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, seed=2, logprobs=True, top_logprobs=3
    )
    for entry in reply.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] >= entry.logprob - 1e-4


def test_stream_sends_the_same_completion_as_chunks(oai: openai.OpenAI) -> None:
    kwargs = dict(model=TINY_MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=6, seed=11)
    whole = oai.chat.completions.create(**kwargs).choices[0]
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_stream_delivers_tokens_while_the_engine_decodes(oai: openai.OpenAI) -> None:
    """The first text arrives long before the last: chunks are sent as tokens are decoded, not at the end."""
    kwargs = dict(model=TINY_MODEL, messages=[{"role": "user", "content": "Tell a long story"}], max_tokens=48, seed=4)
    started = time.monotonic()
    arrivals = [(time.monotonic() - started, chunk) for chunk in oai.chat.completions.create(stream=True, **kwargs)]
    texts = [at for at, c in arrivals if c.choices and c.choices[0].delta.content]
    assert len(texts) > 10 and texts[0] < 0.5 * arrivals[-1][0], (texts[0], arrivals[-1][0])


def test_streamed_completions_equal_whole_ones_with_stop_n_and_echo(oai: openai.OpenAI) -> None:
    free = oai.completions.create(model=TINY_MODEL, prompt="Once upon", max_tokens=12, seed=9)
    stop = free.choices[0].text[4:7]
    kwargs = dict(model=TINY_MODEL, prompt=["Once upon", "A time"], max_tokens=12, n=2, seed=9, stop=[stop], echo=True)
    whole = oai.completions.create(**kwargs)
    streamed: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in oai.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert streamed == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices} and finish[0] == "stop"


def test_stop_n_and_seed(oai: openai.OpenAI) -> None:
    free = oai.completions.create(model=TINY_MODEL, prompt="Once upon", max_tokens=8, seed=7, temperature=1.0)
    text = free.choices[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    stopped = oai.completions.create(model=TINY_MODEL, prompt="Once upon", max_tokens=8, seed=7, stop=[stop])
    assert stopped.choices[0].text == text[: text.find(stop)] and stopped.choices[0].finish_reason == "stop"
    many = oai.completions.create(model=TINY_MODEL, prompt=["a", "b"], max_tokens=3, n=3, seed=1)
    assert [c.index for c in many.choices] == list(range(6))


def test_unknown_model_and_bad_key_are_refused_clearly(oai: openai.OpenAI, server: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError, match="no-such/model"):
        oai.chat.completions.create(model="no-such/model", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="tinker://nowhere/sampler_weights/none", prompt="x", max_tokens=2)
    wrong = openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key="tml-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key is wrong"):
        wrong.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        oai.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2, top_p=0)
