import json

import pytest

from posttrain.hyperparams import hidden_size_of, lora_learning_rate, model_family


def test_lora_learning_rate_follows_the_published_formula():
    assert lora_learning_rate(2000, "llama") == pytest.approx(5e-4)
    assert lora_learning_rate(576, "llama") == pytest.approx(5e-4 * (2000 / 576) ** 0.781)
    assert lora_learning_rate(4096, "qwen") == pytest.approx(5e-4 * (2000 / 4096) ** 0.0775)
    assert lora_learning_rate(576) > lora_learning_rate(4096)  # smaller models take larger rates


def test_family_and_hidden_size_lookup(tmp_path):
    assert model_family("Qwen/Qwen3-8B") == "qwen"
    assert model_family("HuggingFaceTB/SmolLM2-135M-Instruct") == "llama"
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576}))
    assert hidden_size_of(tmp_path) == 576
    with pytest.raises(FileNotFoundError, match="config.json"):
        hidden_size_of(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown model family"):
        lora_learning_rate(576, "mistral")
