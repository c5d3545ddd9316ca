"""Bits per byte scores the same tokens in its numerator and denominator: the trained content tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest

from posttrain.eval.nll import example_nll
from posttrain.renderers import get_renderer


def test_bits_per_byte_terms_leave_out_special_tokens_from_both_sides(data_tokenizer):
    renderer = get_renderer("chatml", data_tokenizer)
    conversation = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "héllo there"}]
    model_input, weights = renderer.build_supervised_example(conversation)
    tokens = model_input.to_ints()
    targets, target_weights = np.asarray(tokens[1:]), weights[1:]
    logprobs = -np.arange(1, len(targets) + 1, dtype=np.float64) / 10  # a distinct logprob per position
    example = example_nll(data_tokenizer, targets, logprobs, target_weights)

    trained = np.flatnonzero(target_weights > 0)
    end = data_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert targets[trained[-1]] == end  # the stop token is trained ...
    assert example.num_tokens == len(trained) and example.nll_sum == pytest.approx(-logprobs[trained].sum())
    content = trained[:-1]  # ... but is not content: no bytes, so no bits either
    assert example.content_nll_sum == pytest.approx(-logprobs[content].sum())
    assert example.num_bytes == len("héllo there".encode("utf-8")) == 12
    assert example.content_nll_sum / math.log(2) / example.num_bytes < example.nll_sum / math.log(2) / example.num_bytes
