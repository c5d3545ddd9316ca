"""The engine's LoRA state in PEFT's on-disk format, so downloaded weights load with no project code.

``peft.PeftModel.from_pretrained(base, directory)`` reads ``adapter_config.json`` (written by peft's own
``LoraConfig``: rank, alpha, target modules, base model) and ``adapter_model.safetensors`` keyed
``base_model.model.<module path>.lora_A.weight``. The engine keys its tensors ``<module path>.lora_A``
(lora.py), so the conversion is a rename; the tensors are the float32 master weights as trained.

LoRA on an MoE's fused experts (expert_lora.py) is written as Tinker writes it: one 3-D tensor per projection
and factor, ``<experts>.gate_proj.lora_A.weight`` [experts, r, in] and ``.lora_B.weight`` [experts, out, r]
(likewise ``up_proj``, ``down_proj``), with the config's rank and alpha giving its scaling — what
tinker-cookbook's weight tools read. peft on transformers 5 cannot load that as it is;
``resources/hf_export/tinker_format.py`` turns it into peft's ``target_parameters`` form.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from localtinker.engine.api import CheckpointFiles, EngineUserError, LoraSpec
from localtinker.engine.checkpoints import CheckpointStore, parse_tinker_path
from localtinker.engine.lora import LORA_ALPHA, target_module_names

PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_CONFIG_FILE = "adapter_config.json"
EXTERNAL_KIND = "external_weights"

__all__ = ["CheckpointFiles", "external_weights_files", "save_external_weights", "write_peft_adapter"]
_PEFT_PREFIX = "base_model.model."
_FACTORS = (".lora_A", ".lora_B")


def peft_key(engine_key: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    if not engine_key.endswith(_FACTORS):
        raise ValueError(f"{engine_key!r} is not a LoRA factor key (<module path>.lora_A or .lora_B)")
    return f"{_PEFT_PREFIX}{engine_key}.weight"


def engine_key(peft_name: str) -> str:
    """The inverse of :func:`peft_key`."""
    stripped = peft_name.removeprefix(_PEFT_PREFIX).removesuffix(".weight")
    if stripped == peft_name or not stripped.endswith(_FACTORS):
        raise ValueError(f"{peft_name!r} is not a PEFT LoRA key (base_model.model.<module>.lora_A.weight)")
    return stripped


def peft_state_dict(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {peft_key(key): tensor.detach().contiguous() for key, tensor in adapter.items()}


def peft_config(base_model: str, lora: LoraSpec, adapter: dict[str, torch.Tensor] | None = None):
    """peft's own ``LoraConfig`` for an engine adapter (Tinker's alpha 32: scaling = alpha / rank). Its target
    modules are the names of the modules ``adapter`` adapts (an expert projection's too: experts' tensors are
    converted for peft on export, resources/hf_export/tinker_format.py), not every name localtinker would adapt
    in some family (lora.py): a loader that checks the names against the model finds each of them."""
    from peft import LoraConfig

    targets = sorted({key.rsplit(".", 2)[-2] for key in adapter}) if adapter else target_module_names(lora)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def write_peft_adapter(directory: Path, adapter: dict[str, torch.Tensor], base_model: str, lora: LoraSpec) -> None:
    """Writes ``adapter_model.safetensors`` and ``adapter_config.json`` into ``directory``."""
    save_file(peft_state_dict(adapter), str(directory / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    peft_config(base_model, lora, adapter).save_pretrained(str(directory))


def save_external_weights(
    store: CheckpointStore,
    run_id: str,
    name: str,
    adapter: dict[str, torch.Tensor],
    meta: dict,
    ttl_seconds: int | None,
) -> str:
    """Saves ``tinker://<run_id>/external_weights/<name>``: the adapter in PEFT's format, atomically."""
    lora = LoraSpec(**meta["lora"])
    return store.save_files(
        run_id,
        EXTERNAL_KIND,
        name,
        lambda staging: write_peft_adapter(staging, adapter, meta["base_model"], lora),
        meta,
        ttl_seconds,
    )


def external_weights_files(store: CheckpointStore, tinker_path: str) -> CheckpointFiles:
    """The files of an external-weights checkpoint, for the protocol to sign and serve."""
    _, kind, _ = parse_tinker_path(tinker_path)
    if kind != EXTERNAL_KIND:
        raise EngineUserError(
            f"{tinker_path} is not an external weights checkpoint; only tinker://<run_id>/external_weights/<name> "
            "paths (from TrainingClient.save_weights_external) have download URLs."
        )
    files, meta = store.files(tinker_path)
    return CheckpointFiles(files=files, expires_at=meta.get("expires_at"))
