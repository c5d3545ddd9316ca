"""One export, start to finish: adapter, optional merged model and GGUF, verification, model card; all or nothing.

Everything is written into a hidden sibling of the target directory and renamed into place at the end, so a
failure (a missing checkpoint, another base model, a full disk, a dropped download) leaves no export behind.
The base model is loaded once: it carries the PEFT adapter for the adapter's check, then (the adapter's layers
removed) takes the merge in place and is saved as the merged model. The server's logprobs are requested
first, so the server computes them while the exporter downloads and loads.
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

from localtinker.engine.families import load_options
from posttrain.export.adapter import ExportError, adapter_base_model, checkpoint_kind, download_adapter
from posttrain.export.verify import ServerLogprobs, max_gap, model_logprobs, prompt_tokens

from .tinker_format import base_layout, convert_tinker_adapter
from .gguf_file import write_gguf
from .merge import merge_into

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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = tick = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base_source)
    prompts = prompt_tokens(tokenizer)
    expected = None
    if checkpoint_kind(path) == "training":  # an external export has no sampler to compare with
        try:
            expected = ServerLogprobs(service.create_sampling_client(model_path=path).result(), prompts)
        except tinker.APIStatusError as error:
            raise ExportError(f"cannot load {path}: {error.message}. `tinker checkpoint list` shows the known checkpoints") from error
        report.verified_tokens = sum(len(p) - 1 for p in prompts)
    adapter_dir = staging / "adapter"
    adapter_dir.mkdir()
    download_adapter(service, rest, path, adapter_dir)
    convert_tinker_adapter(adapter_dir, base_layout(base_source))  # Tinker's names and MoE experts as peft loads them
    trained_on = adapter_base_model(adapter_dir)
    if trained_on and trained_on != base_model:
        raise ExportError(f"{path} was trained on {trained_on!r}, not {base_model!r}; export it with its own base model")
    tick = _timed(report, "download", tick)

    options = load_options(AutoConfig.from_pretrained(base_source))  # MXFP4 experts dequantized, as trained
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32, **options),
                                      str(adapter_dir)).eval()
    tick = _timed(report, "load", tick)
    server = expected.result() if expected is not None else None
    if server is not None:
        report.adapter_max_abs_logprob_diff = max_gap(model_logprobs(model, prompts), server)
    tick = _timed(report, "verify_adapter", tick)
    if merged:
        base = model.unload()  # the base model again: the adapter's layers removed, its weights untouched
        del model
        merge_into(base, adapter_dir, base_source)
        _forget_dequantization(base)
        base.save_pretrained(staging / "merged", safe_serialization=True)
        tokenizer.save_pretrained(staging / "merged")  # tokenizer files and its chat template
        del base
        gc.collect()
        tick = _timed(report, "merge", tick)
        _verify_merged_files(prompts, server, staging, gguf, report, tick)
    report.seconds["total"] = time.perf_counter() - started
    report.within_tolerance = (report.adapter_max_abs_logprob_diff or 0.0) <= ADAPTER_TOLERANCE and max(
        report.merged_max_abs_logprob_diff or 0.0, report.gguf_max_abs_logprob_diff or 0.0
    ) <= MERGED_TOLERANCE


def _forget_dequantization(model: torch.nn.Module) -> None:
    """Makes a base model loaded with its MXFP4 experts dequantized (families.load_options) save them as the dense
    tensors they now are: transformers reverses its load-time conversions on saving, and the reverse of the
    dequantization only renames, so the merged model's dense experts would be written under the quantized names
    (``*_blocks``), which nothing loads."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [conversion for conversion in conversions if not any(
            "Dequantize" in type(operation).__name__ for operation in getattr(conversion, "operations", ()))]


def _verify_merged_files(prompts, server, staging: Path, gguf: bool, report: ExportReport, tick: float) -> None:
    """The merged model (and the GGUF file written from it) loaded back from disk and checked."""
    if server is not None:
        report.merged_max_abs_logprob_diff = _loaded_gap(prompts, server, staging / "merged")
    tick = _timed(report, "verify_merged", tick)
    if gguf:
        (staging / "gguf").mkdir()
        write_gguf(staging / "merged", staging / "gguf" / GGUF_FILE)
        tick = _timed(report, "gguf", tick)
        if server is not None:  # read back by transformers: the check that the file holds what we meant
            report.gguf_max_abs_logprob_diff = _loaded_gap(prompts, server, staging / "gguf", gguf_file=GGUF_FILE)
        _timed(report, "verify_gguf", tick)


def _timed(report: ExportReport, phase: str, since: float) -> float:
    now = time.perf_counter()
    report.seconds[phase] = now - since
    return now


def _loaded_gap(prompts: list[list[int]], server: list, directory: Path, **kwargs: Any) -> float:
    """The largest logprob gap of the model in ``directory``, loaded as a user would (transformers alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    try:
        return max_gap(model_logprobs(model, prompts), server)
    finally:
        del model
        gc.collect()


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
