"""Completers against the real localtinker server (tiny random model) through the real SDK."""

import pytest

from posttrain.completers import MessageCompleter, SamplingSettings, TokenCompleter, normalize_stop
from posttrain.renderers import get_renderer
from tests.fixtures.server import TINY_MODEL
from tests.posttrain.supervised.tiny_data import tiny_tokenizer

import tinker

GREEDY = SamplingSettings(max_tokens=8, temperature=1.0, top_k=1)


def test_stop_conditions_are_normalised_or_refused_with_the_reason():
    assert normalize_stop("\n\nUser:") == ["\n\nUser:"]
    assert normalize_stop([2, 5]) == [2, 5]
    assert normalize_stop(None) is None and normalize_stop([]) is None
    with pytest.raises(ValueError, match="not a mix"):
        normalize_stop(["a", 3])
    with pytest.raises(ValueError, match="non-empty"):
        normalize_stop(["x", ""])
    with pytest.raises(ValueError, match=">= 0"):
        normalize_stop([-1])
    with pytest.raises(ValueError, match="not a mix"):
        normalize_stop([True])


def test_token_completer_stops_at_token_ids_and_strings_and_keeps_logprobs(service_client):
    tokenizer = tiny_tokenizer()
    sampler = service_client.create_sampling_client(base_model=TINY_MODEL).result()
    completer = TokenCompleter(sampler, GREEDY)
    prompt = tinker.ModelInput.from_ints(tokenizer.encode("The number is", add_special_tokens=False))

    free = completer.complete(prompt, None, seed=0)
    assert len(free.tokens) == 8 and free.stop_reason == "length" and len(free.logprobs) == 8
    assert all(value <= 0.0 for value in free.logprobs)

    by_id = completer.complete(prompt, [free.tokens[2]], seed=0)  # greedy: same path, cut at that token
    first_hit = free.tokens.index(free.tokens[2])
    assert by_id.tokens == free.tokens[: first_hit + 1] and by_id.stop_reason == "stop"
    assert by_id.logprobs == pytest.approx(free.logprobs[: first_hit + 1], abs=1e-4)

    stop_text = tokenizer.decode(free.tokens[3:5])
    by_string = completer.complete(prompt, stop_text, seed=0)
    assert by_string.stop_reason == "stop" and len(by_string.tokens) <= 5
    assert stop_text in tokenizer.decode(by_string.tokens)
    assert by_string.tokens == free.tokens[: len(by_string.tokens)]

    several = completer.submit(prompt, None, num_samples=3, seed=0).result()
    assert len(several) == 3 and all(s.tokens == free.tokens for s in several)  # greedy: identical

    with pytest.raises(ValueError, match="max_tokens"):
        TokenCompleter(sampler, SamplingSettings(max_tokens=0))


def test_message_completer_returns_the_renderers_reading_of_the_sampled_tokens(service_client):
    renderer = get_renderer("chatml", tiny_tokenizer())
    sampler = service_client.create_sampling_client(base_model=TINY_MODEL).result()
    completer = MessageCompleter(TokenCompleter(sampler, GREEDY), renderer)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]

    completion = completer.complete(messages, seed=0)
    raw = sampler.sample(renderer.build_generation_prompt(messages), 1, GREEDY.params(renderer.get_stop_sequences(), 0)).result()
    tokens = list(raw.sequences[0].tokens)
    message, termination = renderer.parse_response(tokens)
    assert completion.sampled.tokens == tokens
    assert completion.message == message and completion.text == message["content"]
    assert completion.well_formed == termination.is_clean
