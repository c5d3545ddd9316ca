"""scripts/probe_architectures.py: each architecture's line says how far the engine is from the model's own forward
(with a random LoRA merged into its weights), or why it is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from localtinker.engine.api import EngineUserError

REPO = Path(__file__).resolve().parents[2]


def test_the_probe_measures_a_family_it_covers_and_names_why_it_refuses_one(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import probe_architectures

    line = probe_architectures.probe(probe_architectures.build("granite", tmp_path), portable=False)
    gaps = [float(value) for value in re.findall(r"(?:forward|trainer) ([0-9.e+-]+),", line)]
    assert len(gaps) == 2 and max(gaps) < 1e-5, line
    assert line.endswith("CPU path, 8 projection names adapted")
    reference = probe_architectures._merged_reference(tmp_path / "granite", {})  # no adapter: the model as saved
    assert reference.config.logits_scaling == 4.0  # the fold is the engine's, in memory, never the files'
    with pytest.raises(EngineUserError, match=r"untrained: attn\.c_attn"):
        probe_architectures.probe(probe_architectures.build("gpt_bigcode", tmp_path), portable=True)
