"""Packaged models' tokenizers load by hub id offline, as the SDK's SamplingClient.get_tokenizer does."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from localtinker.engine.hub_cache import register_tokenizer


def test_registered_tokenizer_loads_by_hub_id_offline(tmp_path: Path, smollm2_dir: Path) -> None:
    snapshot = register_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct", smollm2_dir, hub_cache=tmp_path)

    assert snapshot is not None and (snapshot / "tokenizer.json").is_file()
    by_name = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=tmp_path)
    by_dir = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>"
    assert by_name.encode(text) == by_dir.encode(text)


def test_an_id_already_in_the_cache_is_left_alone(tmp_path: Path, smollm2_dir: Path) -> None:
    first = register_tokenizer("org/model", smollm2_dir, hub_cache=tmp_path)
    refs_main = tmp_path / "models--org--model" / "refs" / "main"
    refs_main.write_text("a-real-download")

    assert first is not None
    assert register_tokenizer("org/model", smollm2_dir, hub_cache=tmp_path) is None
    assert refs_main.read_text() == "a-real-download"


def test_local_paths_and_plain_names_are_not_registered(tmp_path: Path, smollm2_dir: Path) -> None:
    assert register_tokenizer(str(smollm2_dir), smollm2_dir, hub_cache=tmp_path) is None
    assert register_tokenizer("no-slash-name", smollm2_dir, hub_cache=tmp_path) is None
    assert not any(tmp_path.iterdir())
