"""Independent references for the engine tests: a separate transformers+peft model with the same weights.

It shares no code path with the engine's forward (full-vocab ``log_softmax`` over ``model(...).logits``),
so agreement with it tests the engine's chunked logprobs, batching, padding and loss sums.
"""

from __future__ import annotations

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from localtinker.engine.api import DatumArrays, LoraSpec
from localtinker.engine.lora import LORA_ALPHA, AdapterHost, target_module_names
from localtinker.engine.models import tiny_random_dir

TINY = "localtinker/tiny-random"


class ReferenceModel:
    def __init__(self, lora: LoraSpec, weights: dict[str, torch.Tensor]) -> None:
        base = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=torch.float32)
        config = LoraConfig(r=lora.rank, lora_alpha=LORA_ALPHA, target_modules=target_module_names(lora))
        self.model = get_peft_model(base, config)
        self.params: dict[str, torch.nn.Parameter] = {}
        named = dict(self.model.named_parameters())
        for key, value in weights.items():
            module, _, kind = key.rpartition(".")
            param = named[f"base_model.model.{module}.{kind}.default.weight"]
            with torch.no_grad():
                param.copy_(value)
            self.params[key] = param

    def logprobs(self, tokens: np.ndarray, targets: np.ndarray, temperature: float = 1.0) -> torch.Tensor:
        logits = self.model(input_ids=torch.as_tensor(tokens)[None]).logits[0].float() / temperature
        return logits.log_softmax(-1).gather(-1, torch.as_tensor(targets)[:, None]).squeeze(-1)

    def grads(self) -> dict[str, torch.Tensor]:
        return {key: p.grad.detach().clone() for key, p in self.params.items()}


def sft_datum(rng: np.random.Generator, length: int, vocab: int = 49152) -> DatumArrays:
    tokens = rng.integers(0, vocab, size=length + 1)
    weights = (rng.random(length) < 0.7).astype(np.float32)
    return DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def host_with_random_b(*, seed: int = 0) -> tuple[AdapterHost, str]:
    """An adapter on every projection of a fresh tiny model, with B random rather than zero."""
    base = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=torch.float32)
    host = AdapterHost(base)
    name = host.add_adapter(LoraSpec(rank=4, train_attn=True, train_mlp=True, train_unembed=True), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for key, param in host.parameters(name).items():
            if "lora_B" in key:  # B starts at zero, which would hide any error in the B·A·x term
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return host, name
