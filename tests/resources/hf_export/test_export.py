"""Exports of a real checkpoint on a real localtinker: adapter and merged model verified against the server;
bad input fails clearly and leaves no export directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tinker
from tinker import types

from localtinker.engine.models import tiny_random_dir
from localtinker.server import RunningServer
from posttrain.export.adapter import ExportError
from resources.hf_export.export import ADAPTER_TOLERANCE, MERGED_TOLERANCE, export_checkpoint
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL

REPO = Path(__file__).resolve().parents[3]
TOKENS = [1, 33, 4096, 17, 900, 2, 77, 31000]


@pytest.fixture(scope="module")
def clients(tinker_server: RunningServer):
    service = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY)
    yield service, tinker.RestClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY)
    service.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def trained(clients) -> tinker.TrainingClient:
    trainer = clients[0].create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=9).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=0.01)).result()
    return trainer


def test_export_with_merged_model_and_gguf_matches_the_server(clients, trained, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = trained.save_state("export").result().path
    out = tmp_path / "export"
    report = export_checkpoint(*clients, state, out, TINY_MODEL, str(tiny_random_dir()), gguf=True, card={"recipe": "sft"})
    assert report.adapter_max_abs_logprob_diff <= ADAPTER_TOLERANCE
    assert report.merged_max_abs_logprob_diff <= MERGED_TOLERANCE and report.within_tolerance
    assert report.gguf_max_abs_logprob_diff <= MERGED_TOLERANCE  # the file, read back by transformers
    assert {p.name for p in out.iterdir()} == {"adapter", "merged", "gguf", "export.json", "README.md"}
    assert AutoTokenizer.from_pretrained(out / "gguf", gguf_file="model.gguf").encode("a cat") == AutoTokenizer.from_pretrained(
        out / "merged"
    ).encode("a cat")
    assert json.loads((out / "export.json").read_text())["verified_tokens"] > 10
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")  # alone: no base model, no peft
    assert not merged.config.tie_word_embeddings and AutoTokenizer.from_pretrained(out / "merged").chat_template
    assert "recipe: `sft`" in (out / "README.md").read_text()
    rest = clients[1]
    assert not [c for c in rest.list_user_checkpoints().result().checkpoints if c.checkpoint_type == "external"]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gpt_oss-mxfp4", "deepseek_v3_moe"])
def test_moe_experts_export_as_a_peft_adapter_and_a_merged_model(clients, tmp_path: Path, family: str) -> None:
    """A Qwen3-MoE, and a gpt-oss (experts transposed, gate and up interleaved, biases, attention sinks; also
    from an MXFP4 checkpoint, as the hub has it), and a DeepSeek-V3 (latent attention; a dense layer, then
    routed and shared experts), trained with LoRA on their fused experts (localtinker's expert_lora.py): the
    adapter loads with peft (its target_parameters; DeepSeek's dense MLP linears as parameters too, which peft's
    conversion of their names would otherwise strip) and the merged model with transformers alone, both matching
    the server; a merged MXFP4 model is saved dense."""
    from safetensors import safe_open

    from tests.localtinker.engine.families import family_dir, mxfp4_family_dir

    base = str(mxfp4_family_dir() if family.endswith("mxfp4") else family_dir(family))
    trainer = clients[0].create_lora_training_client(base_model=base, rank=4, seed=3).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
    out = tmp_path / "export"
    report = export_checkpoint(*clients, trainer.save_state(f"{family}-export").result().path, out, base, base, merged=True)
    assert report.adapter_max_abs_logprob_diff <= ADAPTER_TOLERANCE
    assert report.merged_max_abs_logprob_diff <= MERGED_TOLERANCE and report.within_tolerance
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    dense = ["down_proj.weight", "gate_proj.weight", "up_proj.weight"] if family == "deepseek_v3_moe" else []
    assert sorted(config["target_parameters"]) == sorted(["mlp.experts.down_proj", "mlp.experts.gate_up_proj", *dense])
    layer = 1 if family == "deepseek_v3_moe" else 0  # DeepSeek's first layer is dense
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), framework="pt") as saved:
        expert_b = saved.get_tensor(f"base_model.model.model.layers.{layer}.mlp.experts.lora_B.weight")
    assert expert_b.abs().max() > 0  # the experts trained: their merged weights differ from the base's
    from transformers import AutoModelForCausalLM

    assert "quantization_config" not in json.loads((out / "merged" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").model.layers[layer].mlp.experts.down_proj
    original = AutoModelForCausalLM.from_pretrained(base).model.layers[layer].mlp.experts.down_proj
    assert (merged - original).abs().max() > 0


@pytest.mark.parametrize(
    ("path", "base", "message"),
    [
        ("tinker://nowhere:train:0/weights/none", TINY_MODEL, "cannot load tinker://nowhere"),
        ("not-a-path", TINY_MODEL, "is not a checkpoint path"),
        ("sampler", TINY_MODEL, "is a sampler checkpoint"),
        ("state", "HuggingFaceTB/SmolLM2-135M-Instruct", "was trained on 'localtinker/tiny-random'"),
    ],
)
def test_bad_input_fails_clearly_and_leaves_nothing(clients, trained, tmp_path: Path, path: str, base: str, message: str) -> None:
    if path == "sampler":
        path = trained.save_weights_for_sampler("bad-export").result().path
    elif path == "state":
        path = trained.save_state("bad-export").result().path
    out = tmp_path / "export"
    with pytest.raises(ExportError, match=message):
        export_checkpoint(*clients, path, out, base, str(tiny_random_dir()))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_pipelines_export_cli(tinker_server: RunningServer, trained, tmp_path: Path) -> None:
    """`python -m pipelines export` on a running server: the adapter and merged model, timed and verified."""
    import os
    import subprocess
    import sys

    state = trained.save_state("cli-export").result().path
    env = {**os.environ, "TINKER_BASE_URL": tinker_server.base_url, "TINKER_API_KEY": LOCAL_API_KEY,
           "POSTTRAIN_STATE_DIR": str(tmp_path / "state"), "DAGSTER_HOME": str(tmp_path / "state" / "dagster")}
    out = tmp_path / "exported"
    run = subprocess.run([sys.executable, "-m", "pipelines", "export", state, "--out", str(out), "--merged"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["within_tolerance"] and (out / "merged" / "config.json").is_file()
    missing = subprocess.run([sys.executable, "-m", "pipelines", "export", "tinker://nowhere:train:0/weights/x", "--out", str(tmp_path / "no")],
                             env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert missing.returncode == 2 and "cannot load tinker://nowhere" in missing.stderr and not (tmp_path / "no").exists()
