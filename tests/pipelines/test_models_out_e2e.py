"""Models out of a real SmolLM2-135M checkpoint, as a user gets them (the issue's "done when"): against
``python -m localtinker serve``, the SDK's own ``tinker checkpoint download`` and ``python -m pipelines export
--gguf`` give models that plain transformers / peft load and whose logprobs match the server's, and the
official ``openai`` client chats with the checkpoint's ``tinker://`` sampler path, streamed or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
import tinker
import torch
from tinker import types

from localtinker.engine.packaged import SMOLLM2_NAME, smollm2_hf_dir
from tests.fixtures.network import free_port
from tests.fixtures.server import serve_subprocess

REPO = Path(__file__).resolve().parents[2]
KEY = "tml-e2e"
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


def _logprobs(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double().numpy()


@pytest.mark.slow
def test_a_135m_checkpoint_downloads_exports_and_chats(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt) + tokenizer.encode("12 + 30 = 42.<|im_end|>")
    with serve_subprocess(tmp_path / "storage", free_port(), "--api-key", KEY) as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
        trainer = service.create_lora_training_client(base_model=SMOLLM2_NAME, rank=8, seed=0).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
        for _ in range(2):
            trainer.forward_backward([datum], "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        state = trainer.save_state("e2e").result().path
        sampler_path = trainer.save_weights_for_sampler("e2e").result().path
        server = np.array(service.create_sampling_client(model_path=state).result()
                          .compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:])
        service.close("success").result(timeout=60)

        env = {**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": KEY,
               "POSTTRAIN_STATE_DIR": str(tmp_path / "state"), "DAGSTER_HOME": str(tmp_path / "state" / "dagster")}
        download = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "--output", str(tmp_path / "dl")],
                                  env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert download.returncode == 0, download.stderr[-3000:]
        [adapter_dir] = (tmp_path / "dl").iterdir()
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32), adapter_dir).eval()
        assert np.abs(_logprobs(peft, ids) - server).max() <= 1e-4
        del peft

        out = tmp_path / "export"
        export = subprocess.run([sys.executable, "-m", "pipelines", "export", state, "--out", str(out), "--gguf"],
                                env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert export.returncode == 0, export.stderr[-3000:]
        report = json.loads(export.stdout)
        assert report["within_tolerance"] and report["verified_tokens"] > 50
        assert report["gguf_max_abs_logprob_diff"] <= 1e-3  # SmolLM2's rotary base 1e5 read back from the file
        merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()  # alone: no peft
        assert np.abs(_logprobs(merged, ids) - server).max() <= 1e-3
        assert (out / "gguf" / "model.gguf").stat().st_size > 4 * 134_000_000

        oai = openai.OpenAI(base_url=f"{base_url}/oai/api/v1", api_key=KEY, max_retries=0)
        kwargs = dict(model=sampler_path, messages=QUESTION, max_tokens=16, seed=3)
        reply = oai.chat.completions.create(**kwargs)
        assert reply.choices[0].message.content and reply.model == sampler_path
        streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices)
        assert streamed == reply.choices[0].message.content
