"""Every causal-LM architecture named here, as a tiny random model through localtinker's engine: does it train and
sample as its own ``ForCausalLM.forward``, or is it refused with a reason?

For each architecture (hidden 64, 2 layers, SmolLM2's tokenizer and vocabulary) and each CPU path (the default
engine, ``--portable``: the portable path, and ``--gpu-path``: that path as a GPU runs it, with the written-out
training layers and the static decoder, uncompiled), one line: the largest difference between
the trainer's logprobs and the model's own forward on 20 tokens, between the sampler's logprobs and the trainer's
on 8 sampled tokens, with a random LoRA on every adapted projection (the model's own forward runs on the weights
the adapter merges into, merged as ``pipelines export --merged`` merges them); or the error's first line. Run it after a
transformers upgrade, or to see whether a model family you bring is covered before downloading its weights:

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/probe_architectures.py               # all of ARCHITECTURES
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/probe_architectures.py granite phi3  # some

Within ~1e-5 (float32) both columns say the engine computes the model's own distribution. The tests keep one
architecture of each kind of difference (tests/localtinker/engine/test_families.py, BROUGHT_FAMILIES); this
script is the wider net (docs/localtinker-gpu.md, "Models brought from the hub").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localtinker.engine.api import DatumArrays, LoraSpec, SampleSpec  # noqa: E402
from localtinker.engine.engine import LocalEngine  # noqa: E402
from localtinker.engine.packaged import smollm2_hf_dir  # noqa: E402

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096)
_LATENT = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=16)
_EXPERTS = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
# model_type -> what its tiny config needs beyond COMMON (logit scales set away from 1 so that dropping one shows)
ARCHITECTURES: dict[str, dict] = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {}, "gemma2": {"head_dim": 16}, "gemma3_text": {"head_dim": 16},
    "gpt_oss": {"head_dim": 16}, "phi3": {}, "olmo2": {}, "olmo3": {}, "smollm3": {},
    "gemma": {"head_dim": 16}, "gemma4_text": {}, "starcoder2": {}, "stablelm": {}, "gpt_neox": {}, "phi": {},
    "falcon": {}, "exaone4": {}, "glm4": {}, "apertus": {}, "arcee": {}, "ernie4_5": {}, "seed_oss": {},
    "granite": {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 3.0},
    "granitemoe": {"logits_scaling": 4.0, "num_local_experts": 4, "num_experts_per_tok": 2},
    "cohere": {"logit_scale": 0.25}, "cohere2": {"logit_scale": 0.25}, "cohere2_moe": {"logit_scale": 0.25},
    "hyperclovax": {"logits_scaling": 0.5}, "minicpm3": {"num_key_value_heads": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "deepseek_v2": {**_LATENT, **_EXPERTS}, "deepseek_v3": {**_LATENT, **_EXPERTS, "n_group": 1, "topk_group": 1},
    "gpt_bigcode": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 4096}, "gpt2": {"n_embd": 64, "n_layer": 2,
                                                                                             "n_head": 4},
    "falcon_h1": {"lm_head_multiplier": 0.25}, "qwen3_next": {}, "granitemoehybrid": {}, "llama4_text": {},
}


def build(kind: str, directory: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    config = AutoConfig.for_model(kind, **{**COMMON, **ARCHITECTURES.get(kind, {})})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, getattr(tokenizer, key))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases start at 1 or 0: jitter them so that a dropped one shows
        for name, parameter in model.named_parameters():
            if "norm" in name or "bias" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    path = directory / kind
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def probe(path: Path, portable: bool, gpu_path: bool = False) -> str:
    engine = LocalEngine(Path(tempfile.mkdtemp()), dtype="float32", portable=True if portable or gpu_path else None,
                         static_decode=gpu_path, train_layers=gpu_path)
    engine.create_model("m", str(path), LoraSpec(rank=4, seed=0))
    generator = torch.Generator().manual_seed(3)
    weights = {key: torch.randn(value.shape, generator=generator) * 0.05 for key, value in engine.lora_weights("m").items()}
    engine._hosts[str(path)].adapters.import_weights(engine._models["m"].adapter, weights)
    merged = _merged_reference(path, weights)
    sequence = np.random.default_rng(0).integers(0, 49152, size=20)
    trained = _logprobs(engine, sequence)
    with torch.no_grad():
        logits = merged(input_ids=torch.as_tensor(sequence[:-1])[None]).logits[0].float()
    own = logits.log_softmax(-1).gather(-1, torch.as_tensor(sequence[1:])[:, None]).squeeze(-1).numpy()
    engine.create_sampler("s", None, engine.save_sampler_weights("m", "s"))
    prompt = tuple(int(t) for t in sequence[:7])
    result = engine.sample_batch([("s", SampleSpec(prompt_tokens=prompt, num_samples=1, max_tokens=8, seed=1,
                                                   stop_token_ids=()))])[0]
    if isinstance(result, Exception):
        raise result
    sampled = result.sequences[0]
    full = np.array(prompt + tuple(sampled.tokens))
    trainer = _logprobs(engine, full)[len(prompt) - 1:]
    return (f"trainer vs own forward {np.abs(trained - own).max():.1e}, "
            f"sampler vs trainer {np.abs(np.array(sampled.logprobs) - trainer).max():.1e}, "
            f"{'portable' if engine._hosts[str(path)].base.portable else 'CPU'} path, "
            f"{len({key.rsplit('.', 2)[-2] for key in weights})} projection names adapted")


def _logprobs(engine: LocalEngine, tokens: np.ndarray) -> np.ndarray:
    datum = DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})
    return engine.forward_backward("m", [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]


def _merged_reference(path: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model as saved with the adapter merged into its weights, the way ``pipelines export --merged`` merges
    it: written in peft's form, converted as exports convert it, merged by the export's own code."""
    from transformers import AutoModelForCausalLM

    from localtinker.engine.peft_export import write_peft_adapter
    from resources.hf_export.merge import merge_into
    from resources.hf_export.tinker_format import base_layout, convert_tinker_adapter

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if weights:
        adapter = Path(tempfile.mkdtemp(prefix="probe-adapter-"))
        write_peft_adapter(adapter, weights, str(path), LoraSpec(rank=4, seed=0))
        convert_tinker_adapter(adapter, base_layout(str(path)))
        merge_into(model, adapter, str(path))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("architectures", nargs="*", help="model types (default: all of ARCHITECTURES)")
    parser.add_argument("--portable", action="store_true", help="the portable path (a GPU's code, on the CPU)")
    parser.add_argument("--gpu-path", action="store_true",
                        help="the portable path as a GPU runs it: written-out training layers, static decode")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    directory = Path(tempfile.mkdtemp(prefix="probe-architectures-"))
    for kind in args.architectures or ARCHITECTURES:
        try:
            line = probe(build(kind, directory), args.portable, args.gpu_path)
        except Exception as error:  # noqa: BLE001 (each architecture's outcome is a line of the report)
            line = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        print(f"{kind:18s} {line}", flush=True)


if __name__ == "__main__":
    main()
