"""topk_prompt_logprobs, topk_sample_logprobs, target_prompt_logprobs and prompt_alt_tokens_k through the real SDK."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.fixtures.server import TINY_MODEL

PROMPT = [1, 33, 4096, 17, 900, 2, 77]
VOCAB = 49152


@pytest.fixture(scope="module")
def response(tinker_server) -> types.SampleResponse:
    with tinker.ServiceClient(base_url=tinker_server.base_url, api_key="tml-local") as client:
        sampler = client.create_sampling_client(base_model=TINY_MODEL).result()
        targets = np.stack([np.array(PROMPT[1:]), np.full(len(PROMPT) - 1, -1)], axis=1)
        return sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            2,
            types.SamplingParams(max_tokens=4, seed=3, temperature=0.8),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=5,
            topk_sample_logprobs=4,
            target_prompt_logprobs=types.TensorData.from_numpy(targets),
            prompt_alt_tokens_k=3,
        ).result()


def _agrees(top: list[tuple[int, float]], token: int, logprob: float) -> None:
    """Sorted best first, and consistent with the token's own logprob."""
    values = [lp for _, lp in top]
    assert values == sorted(values, reverse=True) and values[0] >= logprob - 1e-4
    if token in dict(top):
        assert abs(dict(top)[token] - logprob) <= 1e-4


def test_topk_prompt_logprobs_agree_with_prompt_logprobs(response: types.SampleResponse) -> None:
    topk = response.topk_prompt_logprobs
    assert len(topk) == len(PROMPT) and topk[0] is None
    for i in range(1, len(PROMPT)):
        assert len(topk[i]) == 5
        _agrees(topk[i], PROMPT[i], response.prompt_logprobs[i])


def test_topk_sample_logprobs_agree_with_sampled_logprobs(response: types.SampleResponse) -> None:
    assert len(response.sequences) == 2
    for sequence in response.sequences:
        assert len(sequence.topk_logprobs) == len(sequence.tokens) >= 1
        for top, token, logprob in zip(sequence.topk_logprobs, sequence.tokens, sequence.logprobs):
            assert len(top) == 4
            _agrees(top, token, logprob)


def test_target_prompt_logprobs_score_the_asked_ids(response: types.SampleResponse) -> None:
    scored = response.target_prompt_logprobs.to_numpy()
    assert scored.shape == (len(PROMPT) - 1, 2)
    np.testing.assert_allclose(scored[:, 0], response.prompt_logprobs[1:], atol=1e-4)
    assert (scored[:, 1] == 0.0).all()  # -1 asked nothing


def test_prompt_alt_tokens_are_draws_with_their_logprobs(response: types.SampleResponse) -> None:
    tokens, logprobs = response.prompt_alt_tokens.tokens.to_numpy(), response.prompt_alt_tokens.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (len(PROMPT) - 1, 3)
    assert ((0 <= tokens) & (tokens < VOCAB)).all() and (logprobs <= 0).all()
    for i in range(len(PROMPT) - 1):
        for token, logprob in zip(tokens[i], logprobs[i]):
            top = dict(response.topk_prompt_logprobs[i + 1])
            if token in top:
                assert abs(top[token] - logprob) <= 1e-4
