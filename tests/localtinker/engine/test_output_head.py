"""A base model is computed as its own ``ForCausalLM.forward`` computes it, or refused with the reason
(output_head.py, models.refuse_recurrent_layers): logit multipliers folded into the final norm, any other
transform of the logits caught by the probe at load, recurrent layers refused before any weight is read.
(That each family brought from the hub then trains and samples as its own forward: test_families.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, Qwen3NextConfig

from localtinker.engine.api import DatumArrays, EngineUserError, LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.expert_lora import fused_experts
from localtinker.engine.families import recurrent_layer_types
from localtinker.engine.models import refuse_recurrent_layers
from localtinker.engine.output_head import check_output_head, final_norm, fold_logit_multiplier, logit_multiplier
from tests.localtinker.engine.families import family_dir

PROBE = torch.tensor([[5, 900, 17, 4000, 31000, 12]])


@pytest.mark.parametrize(("family", "factor"), [("granite", 0.25), ("cohere2", 0.25), ("minicpm3", 0.5)])
def test_a_logit_multiplier_is_folded_into_the_final_norm_and_the_models_forward_is_unchanged(family, factor):
    """Granite divides by logits_scaling (4), Cohere 2 multiplies by logit_scale (1/4), MiniCPM3 divides by a
    factor its config computes (hidden 64 / dim_model_base 32): the norm carries it, the model's own factor is 1,
    and the logits, through ``ForCausalLM.forward`` or lm_head of the decoder's output, are the model's."""
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    with torch.no_grad():
        expected = model(input_ids=PROBE).logits
    norm_before = final_norm(model).weight.detach().clone()
    assert logit_multiplier(model) == factor
    assert fold_logit_multiplier(model) == factor
    assert logit_multiplier(model) == 1.0
    torch.testing.assert_close(final_norm(model).weight, norm_before * factor)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=PROBE).logits, expected, atol=1e-5, rtol=1e-5)
        head = model.get_output_embeddings()(model.get_decoder()(input_ids=PROBE).last_hidden_state)
    torch.testing.assert_close(head, expected, atol=1e-5, rtol=1e-5)
    check_output_head(family, model)  # passes once folded


def test_without_the_fold_the_probe_refuses_the_model():
    """The probe itself, on Granite as loaded (its logits divided by 4): lm_head's output is not the model's."""
    model = AutoModelForCausalLM.from_pretrained(family_dir("granite"), dtype=torch.float32)
    with pytest.raises(EngineUserError, match=r"granite.*does not reproduce.*differ by up to"):
        check_output_head("granite-as-loaded", model)


def test_an_unknown_logit_transform_refuses_the_model_and_loads_nothing(tmp_path, monkeypatch):
    """A family whose forward transforms its logits in a way no one has taught the engine (here: a Llama whose
    forward triples them) is refused by create_model with the reason, before any adapter exists; the engine
    then loads the same model once it computes its logits plainly."""
    forward = LlamaForCausalLM.forward

    def tripled(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        output.logits = output.logits * 3
        return output

    engine = LocalEngine(tmp_path / "engine", dtype="float32")
    monkeypatch.setattr(LlamaForCausalLM, "forward", tripled)
    with pytest.raises(EngineUserError, match=r"\(llama, LlamaForCausalLM\) turns its last hidden state into logits"
                                              r".*nothing was loaded"):
        engine.create_model("m", str(family_dir("llama")), LoraSpec(rank=4, seed=0))
    assert not engine._hosts and not engine._models
    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    engine.create_model("m", str(family_dir("llama")), LoraSpec(rank=4, seed=0))
    tokens = np.arange(1, 9)
    datum = DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})
    assert np.isfinite(engine.forward_backward("m", [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]).all()


def test_models_with_recurrent_layers_are_refused_before_any_weight_is_read(tmp_path):
    """Qwen3-Next's linear-attention layers (and Mamba's, the hybrids') keep a recurrent state that packed
    training and the key/value cache do not keep apart per sequence: refused from the config alone, naming the
    layer type; a transformer's config passes."""
    config = Qwen3NextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2)
    assert recurrent_layer_types(config) == ["linear_attention"]
    with pytest.raises(EngineUserError, match=r"'qwen3-next-tiny' \(qwen3_next\) has layers of type linear_attention"
                                              r".*nothing was loaded"):
        refuse_recurrent_layers("qwen3-next-tiny", config)
    config.save_pretrained(tmp_path / "qwen3-next")  # a directory without weights: refused before reading them
    engine = LocalEngine(tmp_path / "engine", dtype="float32")
    with pytest.raises(EngineUserError, match="linear_attention"):
        engine.create_model("m", str(tmp_path / "qwen3-next"), LoraSpec(rank=4, seed=0))
    for family in ("llama", "gemma3_text", "gpt_oss", "granite"):
        assert recurrent_layer_types(AutoConfig.from_pretrained(family_dir(family))) == []


def test_a_convolutions_weight_is_not_taken_for_fused_experts():
    """Qwen3-Next's short convolutions hold 3-D weights: the MoE check named them "MLP experts"."""
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3, groups=4), torch.nn.Linear(4, 4))
    assert fused_experts(model) == []


def test_a_family_whose_projections_have_other_names_is_refused_rather_than_trained_in_part(tmp_path):
    """GPT-BigCode's attention is ``c_attn`` (no name localtinker adapts) and ``c_proj``, a name its MLP also has
    (and StarCoder2's MLP, which trains whole): an adapter with the attention group would leave ``c_attn`` out,
    one with the MLP group alone would adapt the attention's ``c_proj`` too. Both are refused naming them, and
    nothing of them stays; the unembedding alone trains."""
    from transformers import AutoTokenizer, GPTBigCodeConfig, GPTBigCodeForCausalLM

    from localtinker.engine.packaged import smollm2_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    config = GPTBigCodeConfig(vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=4096,
                              pad_token_id=tokenizer.pad_token_id)
    GPTBigCodeForCausalLM(config).save_pretrained(tmp_path / "bigcode")
    tokenizer.save_pretrained(tmp_path / "bigcode")
    engine = LocalEngine(tmp_path / "engine", dtype="float32")
    with pytest.raises(EngineUserError, match=r"'gpt_bigcode' model's layers in part \(untrained: attn\.c_attn\)"):
        engine.create_model("m", str(tmp_path / "bigcode"), LoraSpec(rank=4, seed=0))
    with pytest.raises(EngineUserError, match=r"adapted though their group was not asked for: attn\.c_proj\).*"
                                              r"train_attn=False or train_mlp=False"):
        engine.create_model("m", str(tmp_path / "bigcode"), LoraSpec(rank=4, seed=0, train_attn=False))
    assert "m" not in engine._models
    engine.create_model("m", str(tmp_path / "bigcode"), LoraSpec(rank=4, seed=0, train_attn=False, train_mlp=False))
    assert {key.rsplit(".", 2)[-2] for key in engine.lora_weights("m")} == {"lm_head"}


def test_a_model_whose_decoder_is_the_causal_lm_itself_is_refused(monkeypatch):
    """Llama 4's text model answers get_decoder() with itself: its decoder cannot be run apart from its head."""
    model = AutoModelForCausalLM.from_pretrained(family_dir("llama"), dtype=torch.float32)
    monkeypatch.setattr(model, "get_decoder", lambda: model)
    with pytest.raises(EngineUserError, match=r"get_decoder\(\) returns the causal LM itself"):
        check_output_head("llama-4-like", model)
