"""tinker-cookbook's own merge (``tinker_cookbook.weights.build_hf_model``) on localtinker downloads of a tiny
Qwen3-MoE and a tiny gpt-oss, against the engine's logprobs: the check that an MoE adapter's 3-D expert factors
and its one scaling are read as Tinker's are (for gpt-oss: merged into its transposed, interleaved experts).

tinker-cookbook 0.6.1 does not install with this project's pins (it needs tml-renderers >= 0.4.1), so it is not
a test dependency; its weight tools import without the rest:

    .venv/bin/pip install --no-deps --target /tmp/cb tinker-cookbook==0.6.1 pyrage
    PYTHONPATH=.:/tmp/cb HF_HUB_OFFLINE=1 .venv/bin/python scripts/cookbook_merge_check.py

Prints, per adapter layout, the largest logprob gap between the cookbook's merged model and the engine (float32:
~1e-6 expected) and the engine's gap to the base model (the adapter's effect, which the first must be far below).
The cookbook's default merge strategy is used (into the checkpoint's per-expert tensors); with
``merge_strategy="full"`` (into transformers 5's fused experts in memory) 0.6.1 gave gaps of ~1 on 2026-11-28.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from tinker_cookbook.weights import build_hf_model
from transformers import AutoModelForCausalLM

from localtinker.engine.api import AdamSpec, LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.peft_export import write_peft_adapter
from tests.localtinker.engine.families import family_dir
from tests.localtinker.engine.test_families import _datum


def _logprobs(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    logits = model(input_ids=torch.as_tensor(tokens[:-1])[None]).logits[0]
    return logits.log_softmax(-1).gather(-1, torch.as_tensor(tokens[1:])[:, None]).squeeze(-1).detach().numpy()


def main() -> None:
    for family in ("qwen3_moe", "gpt_oss"):
        check(family)


def check(family: str) -> None:
    base = str(family_dir(family))
    tokens = np.random.default_rng(0).integers(0, 49152, size=24)
    base_logprobs = _logprobs(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tokens)
    # the tiny Qwen3-MoE's unembedding is left out: it is tied to the embeddings, which the cookbook's merge would
    # change too (docs/export.md); gpt-oss's is not tied
    untied = family == "gpt_oss"
    for spec in (LoraSpec(rank=4, seed=1, train_attn=False, train_unembed=False),
                 LoraSpec(rank=4, seed=0, train_unembed=untied)):
        with tempfile.TemporaryDirectory() as scratch:
            engine = LocalEngine(Path(scratch) / "engine", dtype="float32")
            engine.create_model("moe", base, spec)
            for _ in range(4):
                engine.forward_backward("moe", [_datum(tokens)], "cross_entropy", None, False)
                engine.optim_step("moe", AdamSpec(learning_rate=0.01 if untied else 0.05))
            adapter = Path(scratch) / "adapter"
            adapter.mkdir()
            write_peft_adapter(adapter, engine.lora_weights("moe"), base, spec)  # what a download holds
            # the default strategy merges into the checkpoint's tensors as stored (per expert, as on the hub)
            build_hf_model(base_model=base, adapter_path=str(adapter), output_path=str(Path(scratch) / "merged"))
            merged = _logprobs(AutoModelForCausalLM.from_pretrained(Path(scratch) / "merged", dtype=torch.float32), tokens)
            ours = engine.forward_backward("moe", [_datum(tokens)], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]
            print(f"{family} attn={spec.train_attn} unembed={spec.train_unembed}: cookbook merged vs engine {np.abs(ours - merged).max():.2e}, "
                  f"engine vs base {np.abs(ours - base_logprobs).max():.3f}")


if __name__ == "__main__":
    main()
