"""The engine's LoRA state in PEFT's on-disk format, so downloaded weights load with no project code.

``peft.PeftModel.from_pretrained(base, directory)`` reads ``adapter_config.json`` (written by peft's own
``LoraConfig``: rank, alpha, target modules, base model) and ``adapter_model.safetensors`` keyed
``base_model.model.<module path>.lora_A.weight``. The engine keys its tensors ``<module path>.lora_A``
(lora.py), so the conversion is a rename; the tensors are the float32 master weights as trained.

Fused MoE experts (expert_lora.py) are peft ``target_parameters``: the config names them, and peft nests one
wrapper per parameter on the experts module, the first registered innermost, so ``gate_up_proj``'s factors
are keyed ``<experts>.base_layer.lora_A.weight`` and ``down_proj``'s ``<experts>.lora_A.weight``. The gate and
up LoRAs go as one of rank 2r (expert_lora.gate_up_factors). peft lays factors out as A [experts·r, in]
(expert-major) and B [out, r·experts] (expert-minor); the engine's A [experts, r, in] and B [experts, out, r]
are reshaped to that.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from localtinker.engine.api import CheckpointFiles, EngineUserError, LoraSpec
from localtinker.engine.checkpoints import CheckpointStore, parse_tinker_path
from localtinker.engine.expert_lora import EXPERT_PARAMETERS, PROJECTIONS, gate_up_factors
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


def _experts_path(engine_key: str, tensor: torch.Tensor) -> str | None:
    """The experts module's path of a fused experts' factor key (expert_lora.py's), else None."""
    module, _, _ = engine_key.rpartition(".")
    path, _, projection = module.rpartition(".")
    return path if tensor.dim() == 3 and projection in PROJECTIONS else None


def peft_state_dict(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state, experts = {}, {}
    for key, tensor in adapter.items():
        path = _experts_path(key, tensor)
        if path is None:
            state[peft_key(key)] = tensor.detach().contiguous()
        else:
            experts.setdefault(path, {})[key.removeprefix(f"{path}.")] = tensor.detach()
    for path, factors in experts.items():
        pairs = {"gate_up_proj": gate_up_factors(factors), "down_proj": (factors["down_proj.lora_A"], factors["down_proj.lora_B"])}
        for parameter, (a, b) in pairs.items():
            wrapper = path + ".base_layer" * (len(EXPERT_PARAMETERS) - 1 - EXPERT_PARAMETERS.index(parameter))
            state[peft_key(f"{wrapper}.lora_A")] = a.reshape(-1, a.shape[-1]).contiguous()  # [E, r, in] -> [E·r, in]
            state[peft_key(f"{wrapper}.lora_B")] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()  # -> [out, r·E]
    return state


def peft_config(base_model: str, lora: LoraSpec, adapter: dict[str, torch.Tensor] | None = None):
    """peft's own ``LoraConfig`` for an engine adapter (Tinker's alpha 32: scaling = alpha / rank). Fused
    experts are named as ``target_parameters`` at their own rank r (the adapter's divided by the experts per
    token: expert_lora.expert_rank), ``gate_up_proj`` at 2r with alpha 2·32 (the same scaling); the MLP names
    stay in ``target_modules`` only where the adapter has MLP linears too (peft on transformers 5 would otherwise
    convert them into expert targets of its own)."""
    from peft import LoraConfig

    adapter = adapter or {}
    experts = {path for key, tensor in adapter.items() if (path := _experts_path(key, tensor))}
    targets = target_module_names(lora)
    extra = {}
    if experts:
        linears = {key.rpartition(".")[0].rpartition(".")[2] for key, t in adapter.items() if not _experts_path(key, t)}
        targets = [name for name in targets if name not in PROJECTIONS or name in linears]
        holders = {path.split("layers.", 1)[-1].partition(".")[2] or path for path in experts}
        rank = next(tensor.shape[1] for key, tensor in adapter.items() if _experts_path(key, tensor) and key.endswith(".lora_A"))
        targets_of = {f"{holder}.{parameter}": 2 if parameter == "gate_up_proj" else 1
                      for holder in holders for parameter in EXPERT_PARAMETERS}  # gate_up: two LoRAs as one
        patterns = {rf".*\.{re.escape(target)}": times for target, times in targets_of.items()}
        extra = dict(target_parameters=sorted(targets_of),
                     rank_pattern={pattern: times * rank for pattern, times in patterns.items()},
                     alpha_pattern={pattern: times * LORA_ALPHA for pattern, times in patterns.items()})
    return LoraConfig(
        r=lora.rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
        **extra,
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
