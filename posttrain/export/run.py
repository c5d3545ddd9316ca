"""One export, start to finish: adapter, optional merged model, verification, model card; all or nothing.

Everything is written into a hidden sibling of the target directory and renamed into place at the end, so a
failure (a missing checkpoint, another base model, a full disk, a dropped download) leaves no export behind.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tinker
import torch

from .adapter import ExportError, adapter_base_model, checkpoint_kind, download_adapter
from .gguf_file import write_gguf
from .merge import merge_adapter
from .verify import max_gap, model_logprobs, prompt_tokens, server_logprobs

ADAPTER_TOLERANCE = 1e-4  # float32 server: max |Δ logprob| of the PEFT adapter in plain transformers
MERGED_TOLERANCE = 1e-3  # the merged weights round once more (the GGUF file holds the same float32 tensors)
GGUF_FILE = "model.gguf"


@dataclass
class ExportReport:
    path: str
    base_model: str
    out_dir: str
    adapter_max_abs_logprob_diff: float | None = None
    merged_max_abs_logprob_diff: float | None = None
    gguf_max_abs_logprob_diff: float | None = None
    verified_tokens: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    within_tolerance: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def export_checkpoint(
    service: tinker.ServiceClient,
    rest: tinker.RestClient,
    path: str,
    out_dir: Path,
    base_model: str,
    base_source: str,
    *,
    merged: bool = False,
    gguf: bool = False,
    card: dict[str, Any] | None = None,
) -> ExportReport:
    """Exports ``path`` (trained on ``base_model``, whose weights ``base_source`` loads) into ``out_dir``;
    ``gguf`` (which implies ``merged``) adds ``gguf/model.gguf``."""
    out_dir = Path(out_dir)
    checkpoint_kind(path)
    if out_dir.exists():
        raise ExportError(f"{out_dir} already exists; pick another --out or remove it first")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    report = ExportReport(path, base_model, str(out_dir))
    try:
        staging.mkdir()
        _export_into(service, rest, path, staging, base_model, base_source, merged or gguf, gguf, report)
        (staging / "export.json").write_text(json.dumps(report.to_json(), indent=1))
        (staging / "README.md").write_text(model_card(report, card or {}))
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _export_into(service, rest, path, staging, base_model, base_source, merged, gguf, report) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    adapter_dir = staging / "adapter"
    adapter_dir.mkdir()
    download_adapter(service, rest, path, adapter_dir)
    trained_on = adapter_base_model(adapter_dir)
    if trained_on and trained_on != base_model:
        raise ExportError(f"{path} was trained on {trained_on!r}, not {base_model!r}; export it with its own base model")
    report.seconds["download"] = time.perf_counter() - started

    tick = time.perf_counter()
    prompts = prompt_tokens(AutoTokenizer.from_pretrained(base_source))
    verifiable = checkpoint_kind(path) == "training"  # an external export has no sampler to compare with
    expected = server_logprobs(service.create_sampling_client(model_path=path).result(), prompts) if verifiable else None
    report.verified_tokens = sum(len(p) - 1 for p in prompts) if verifiable else 0
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32), str(adapter_dir))
    if expected is not None:
        report.adapter_max_abs_logprob_diff = max_gap(model_logprobs(model.eval(), prompts), expected)
    del model
    gc.collect()
    report.seconds["verify_adapter"] = time.perf_counter() - tick

    if merged:
        tick = time.perf_counter()
        merge_adapter(base_source, adapter_dir, staging / "merged")
        report.seconds["merge"] = time.perf_counter() - tick
        tick = time.perf_counter()
        if expected is not None:
            model = AutoModelForCausalLM.from_pretrained(staging / "merged", dtype=torch.float32).eval()
            report.merged_max_abs_logprob_diff = max_gap(model_logprobs(model, prompts), expected)
            del model
            gc.collect()
        report.seconds["verify_merged"] = time.perf_counter() - tick
    if gguf:
        tick = time.perf_counter()
        (staging / "gguf").mkdir()
        write_gguf(staging / "merged", staging / "gguf" / GGUF_FILE)
        report.seconds["gguf"] = time.perf_counter() - tick
        if expected is not None:  # loaded back by transformers: the check that the file is what we meant
            model = AutoModelForCausalLM.from_pretrained(staging / "gguf", gguf_file=GGUF_FILE, dtype=torch.float32).eval()
            report.gguf_max_abs_logprob_diff = max_gap(model_logprobs(model, prompts), expected)
            del model
            gc.collect()
    report.seconds["total"] = time.perf_counter() - started
    report.within_tolerance = (report.adapter_max_abs_logprob_diff or 0.0) <= ADAPTER_TOLERANCE and max(
        report.merged_max_abs_logprob_diff or 0.0, report.gguf_max_abs_logprob_diff or 0.0
    ) <= MERGED_TOLERANCE


def model_card(report: ExportReport, card: dict[str, Any]) -> str:
    """README.md of the export: what it is, where it came from, how it was checked, how to load it."""
    lines = [
        f"# {card.get('title') or report.path}",
        "",
        f"LoRA adapter (PEFT) of `{report.base_model}` from Tinker checkpoint `{report.path}`.",
    ]
    for key in ("recipe", "registered_model", "model_version", "partition"):
        if card.get(key):
            lines.append(f"- {key.replace('_', ' ')}: `{card[key]}`")
    for asset, version in sorted((card.get("data_versions") or {}).items()):
        lines.append(f"- data `{asset}`: version `{version}`")
    for metric, value in sorted((card.get("eval") or {}).items()):
        lines.append(f"- eval {metric}: {value}")
    lines += ["", "Verification against the server's `compute_logprobs` (max |Δ logprob| over "
              f"{report.verified_tokens} held-out prompt tokens, float32):"]
    lines.append(f"- adapter: {report.adapter_max_abs_logprob_diff}")
    if report.merged_max_abs_logprob_diff is not None:
        lines.append(f"- merged: {report.merged_max_abs_logprob_diff}")
    if report.gguf_max_abs_logprob_diff is not None:
        lines.append(f"- GGUF (float32, read back by transformers): {report.gguf_max_abs_logprob_diff}")
    lines += [
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({report.base_model!r}), 'adapter')",
        "# or, with --merged: AutoModelForCausalLM.from_pretrained('merged')",
        "# or, with --gguf: AutoModelForCausalLM.from_pretrained('gguf', gguf_file='model.gguf'); llama.cpp reads it too",
        "```",
        "",
    ]
    return "\n".join(lines)
