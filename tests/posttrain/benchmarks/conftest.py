"""Benchmark fixtures: the benchmark datasets' local mirror, and an inspect model on the tiny localtinker model."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARK_HUB = Path(__file__).resolve().parents[2] / "fixtures" / "benchmarks_hub"


@pytest.fixture
def benchmark_mirror(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Benchmark hub ids resolve to tests/fixtures/benchmarks_hub (hub layout, real column schema)."""
    monkeypatch.setenv("POSTTRAIN_HUB_MIRROR", str(BENCHMARK_HUB))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return BENCHMARK_HUB


@pytest.fixture
def tiny_target(tinker_server):
    """The tiny random model on the session's localtinker, through the provider's endpoint args."""
    from localtinker.engine.models import tiny_random_dir
    from posttrain.benchmarks.runner import ModelTarget
    from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL

    return ModelTarget(TINY_MODEL, "chatml", tinker_server.base_url, LOCAL_API_KEY, str(tiny_random_dir()))


def scripted_model(answer: str):
    """An inspect model that answers every prompt with ``answer`` (for scorer tests: grading, not sampling).

    Not inspect's ``mockllm``: that one counts tokens with tiktoken's o200k file, which it downloads."""
    from inspect_ai.model import GenerateConfig, ModelAPI, ModelOutput, get_model, modelapi

    @modelapi(name="scripted")
    def _scripted():
        class Scripted(ModelAPI):
            def __init__(self, model_name: str, base_url=None, api_key=None, config: GenerateConfig = GenerateConfig(), **args):
                super().__init__(model_name, base_url, api_key, [], config)

            async def generate(self, input, tools, tool_choice, config) -> ModelOutput:
                return ModelOutput.from_content(model=self.model_name, content=self.model_name.replace("\\n", "\n"))

            async def count_text_tokens(self, text: str) -> int:
                return len(text.split())

        return Scripted

    return get_model(f"scripted/{answer}", memoize=False)
