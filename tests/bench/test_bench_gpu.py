"""bench/bench_gpu.py --smoke: the whole flow on tiny shapes on the CPU, as scripts/gpu_check.sh runs it on a GPU.
A device session is rare and short (one call of a few minutes), so a crash in the script must show here first.
The figures of a smoke run measure nothing; what is checked is that every part ran and reported its figure, the
parts a GPU takes by default included (compiled training pieces: ~1 min of compiling here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the figures the goals and the next device session's decisions read, as the 1B shape reports them
FIGURES = ("1b.sft_ratio", "1b.chat_ratio", "1b.sample_ratio", "1b.grpo_ratio", "1b.ours.grpo_forward_backward_s",
           "1b.ours.grpo_forward_backward_whole_rows_s", "1b.ours.sft_after_sampling_s", "1b.sft_ratio_graphs",
           "1b.chat_ratio_graphs", "1b.sample_ratio_separate_a", "1b.sample_ratio_sdpa_attention",
           "1b.layers_logprob_max_gap")


def test_the_gpu_bench_runs_every_part_on_tiny_shapes(tmp_path):
    report = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", "--smoke", "--models", "1b", "--json", str(report)], cwd=REPO,
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "failed" not in result.stdout.lower(), result.stdout[-3000:]
    figures = json.loads(report.read_text())
    assert not [key for key in figures if key.endswith(".error")], figures
    missing = [key for key in FIGURES if not isinstance(figures.get(key), float)]
    assert not missing, (missing, result.stdout[-3000:])
    assert all(figures[key] > 0 for key in FIGURES if key != "1b.layers_logprob_max_gap")
    # as on a GPU: the training pieces compiled (inductor's C++ here) and still so after the graphs' comparison,
    # the decoder's weights joined (so the separate products were compared)
    assert figures["1b.ours.train_layers_compiled"] == 1 and figures["1b.ours_graphs.still_graphed"] == 1
    assert figures["1b.ours.decode_joined"] == 1


def test_each_card_takes_its_own_data_sheet_and_an_unknown_one_none(monkeypatch):
    """The first entry whose words are all in the card's name: an L40S is not read as an L4, an A100 not as an
    A10, an H100 PCIe not as an SXM H100."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import bench_gpu

    expected = {"NVIDIA L40S": 362e12, "NVIDIA L4": 121e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A10": 125e12,
                "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12,
                "NVIDIA B200": 2250e12}
    for name, flops in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert bench_gpu.card_peaks()[0] == flops, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert bench_gpu.card_peaks() == (None, None, "Tesla T4")
