"""The GGUF writer's model metadata on configs in transformers 5's shape (rotary base in ``rope_parameters``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from localtinker.engine.models import tiny_random_dir
from posttrain.export.adapter import ExportError
from resources.hf_export.gguf_file import write_gguf


def _model_with_rope(tmp_path: Path, rope: dict) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_random_dir(), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    return model


def test_the_rotary_base_is_read_from_rope_parameters(tmp_path: Path) -> None:
    """SmolLM2's 100000 sat in rope_parameters, and the file said 10000: its logprobs were off by 2 nats."""
    import gguf

    model = _model_with_rope(tmp_path, {"rope_type": "default", "rope_theta": 100000.0})
    write_gguf(model, tmp_path / "model.gguf")
    field = gguf.GGUFReader(tmp_path / "model.gguf").fields["llama.rope.freq_base"]
    assert float(field.parts[field.data[0]][0]) == 100000.0


def test_scaled_rotary_embeddings_are_refused(tmp_path: Path) -> None:
    model = _model_with_rope(tmp_path, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0})
    with pytest.raises(ExportError, match="unscaled rotary embeddings.*'llama3'"):
        write_gguf(model, tmp_path / "model.gguf")
