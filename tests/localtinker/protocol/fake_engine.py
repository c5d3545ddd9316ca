"""A small, exact numpy engine for testing the protocol layer without torch.

The "model" is a bigram table: at position i the next-token logits are ``bias + CONTEXT * onehot(x_i)``;
only ``bias`` trains. That is enough to check that losses fall, that sampler and trainer logprobs
agree, that checkpoints restore (with or without Adam moments) and that calls arrive in order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

import numpy as np

from localtinker.engine.api import (
    AdamSpec,
    CheckpointInfo,
    DatumArrays,
    EngineUserError,
    ForwardBackwardResult,
    LoraSpec,
    ModelInfo,
    SampledSequence,
    SampleResult,
    SampleSpec,
    UnknownModelError,
)

VOCAB = 32
EOS = 0
CONTEXT = 0.5
FAKE_CONTEXT = 64  # the fake model's context length: max_tokens=None samples up to it
BASE_MODEL = "fake/bigram"


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _base_bias() -> np.ndarray:
    return np.linspace(-1.0, 1.0, VOCAB)


@dataclass
class _Model:
    base_model: str
    lora_rank: int
    bias: np.ndarray
    grad: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    m: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    v: np.ndarray = field(default_factory=lambda: np.zeros(VOCAB))
    step: int = 0


class FakeEngine:
    def __init__(self, storage_dir: Path, fwd_delay_s: float = 0.0) -> None:
        self.root = Path(storage_dir) / "fake_checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.fwd_delay_s = fwd_delay_s
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, np.ndarray] = {}
        self.calls: list[tuple] = []
        self.sample_batch_sizes: list[int] = []
        self.threads: set[str] = set()
        self.expires_at: dict[str, float] = {}  # tinker path -> unix time (TTLs are recorded, never enforced)

    def _log(self, *call: object) -> None:
        self.threads.add(threading.current_thread().name)
        self.calls.append(call)

    def _info(self, model_id: str) -> ModelInfo:
        model = self.models[model_id]
        return ModelInfo(model_id, model.base_model, "fake-tokenizer-dir", model.lora_rank, "bigram", 128)

    def _model(self, model_id: str) -> _Model:
        if model_id not in self.models:
            raise UnknownModelError(f"unknown model {model_id!r}")
        return self.models[model_id]

    def supported_models(self) -> list[ModelInfo]:
        return [ModelInfo(BASE_MODEL, BASE_MODEL, "fake-tokenizer-dir", 0, "bigram", 128)]

    def create_model(self, model_id: str, base_model: str, lora: LoraSpec) -> ModelInfo:
        self._log("create_model", model_id)
        if base_model != BASE_MODEL:
            raise UnknownModelError(f"unknown base model {base_model!r}; supported: {BASE_MODEL}")
        self.models[model_id] = _Model(base_model, lora.rank, _base_bias())
        return self._info(model_id)

    def get_info(self, model_id: str) -> ModelInfo:
        self._model(model_id)
        return self._info(model_id)

    def forward_backward(
        self,
        model_id: str,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardBackwardResult:
        self._log("forward" if forward_only else "forward_backward", model_id, [d.tokens.tolist() for d in data])
        model = self._model(model_id)
        if loss_fn not in ("cross_entropy", "importance_sampling"):
            raise EngineUserError(f"the fake engine only implements cross_entropy and importance_sampling, not {loss_fn}")
        time.sleep(self.fwd_delay_s)
        outputs, total, grad = [], 0.0, np.zeros(VOCAB)
        for index, datum in enumerate(data):
            targets = datum.loss_fn_inputs["target_tokens"].astype(np.int64)
            for name, ids in (("model_input", datum.tokens), ("target_tokens", targets)):
                if ids.size and (ids.max() >= VOCAB or ids.min() < 0):
                    raise EngineUserError(f"data[{index}].{name}: token id {int(ids.max())} is outside the vocab [0, {VOCAB})")
            logp = _log_softmax(model.bias[None, :] + CONTEXT * np.eye(VOCAB)[datum.tokens])
            lp = logp[np.arange(targets.size), targets]
            if loss_fn == "cross_entropy":
                dloss_dlp = -datum.loss_fn_inputs.get("weights", np.ones_like(lp)).astype(np.float64)
                total += float((dloss_dlp * lp).sum())
            else:
                ratio = np.exp(lp - datum.loss_fn_inputs["logprobs"])
                advantages = datum.loss_fn_inputs["advantages"]
                total += float(-(ratio * advantages).sum())
                dloss_dlp = -ratio * advantages
            probs = np.exp(logp)
            grad += (dloss_dlp[:, None] * (np.eye(VOCAB)[targets] - probs)).sum(axis=0)
            outputs.append({"logprobs": lp.astype(np.float32), "elementwise_loss": (dloss_dlp * lp).astype(np.float32)})
        if not forward_only:
            model.grad += grad
        return ForwardBackwardResult(outputs, {"loss:sum": total})

    def optim_step(self, model_id: str, adam: AdamSpec) -> dict[str, float]:
        self._log("optim_step", model_id, adam.learning_rate)
        model = self._model(model_id)
        model.step += 1
        g = model.grad
        model.m = adam.beta1 * model.m + (1 - adam.beta1) * g
        model.v = adam.beta2 * model.v + (1 - adam.beta2) * g * g
        m_hat = model.m / (1 - adam.beta1**model.step)
        v_hat = model.v / (1 - adam.beta2**model.step)
        model.bias = model.bias - adam.learning_rate * m_hat / (np.sqrt(v_hat) + adam.eps)
        norm = float(np.linalg.norm(g))
        model.grad = np.zeros(VOCAB)
        return {"grad_norm": norm, "step": float(model.step)}

    def _file(self, run_id: str, kind: str, name: str) -> Path:
        return self.root / quote(run_id, safe="") / kind / f"{name}.npz"

    def _save(self, model_id: str, kind: str, name: str) -> str:
        model = self._model(model_id)
        path = self._file(model_id, kind, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, bias=model.bias, m=model.m, v=model.v, step=model.step, rank=model.lora_rank)
        return f"tinker://{model_id}/{kind}/{name}"

    def _load(self, tinker_path: str) -> tuple[str, dict[str, np.ndarray]]:
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3:
            raise EngineUserError(f"bad checkpoint path {tinker_path!r}")
        path = self._file(*parts)
        if not path.is_file():
            raise UnknownModelError(f"no checkpoint at {tinker_path}")
        with np.load(path) as data:
            return parts[1], {k: data[k] for k in data.files}

    def save_state(self, model_id: str, name: str, ttl_seconds: int | None = None) -> str:
        self._log("save_state", model_id, name)
        return self._expire(self._save(model_id, "weights", name), ttl_seconds)

    def save_sampler_weights(self, model_id: str, name: str, ttl_seconds: int | None = None) -> str:
        self._log("save_sampler_weights", model_id, name)
        return self._expire(self._save(model_id, "sampler_weights", name), ttl_seconds)

    def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        self._log("set_checkpoint_ttl", tinker_path, ttl_seconds)
        self._expire(tinker_path, ttl_seconds)

    def _expire(self, tinker_path: str, ttl_seconds: int | None) -> str:
        self.expires_at.pop(tinker_path, None)
        if ttl_seconds is not None:
            self.expires_at[tinker_path] = time.time() + ttl_seconds
        return tinker_path

    def load_state(self, model_id: str, path: str, with_optimizer: bool, base_model: str | None) -> ModelInfo:
        self._log("load_state", model_id, path, with_optimizer)
        kind, data = self._load(path)
        if with_optimizer and kind != "weights":
            raise EngineUserError(f"{path} has no optimizer state")
        model = _Model(BASE_MODEL, int(data["rank"]), data["bias"].copy())
        if with_optimizer:
            model.m, model.v, model.step = data["m"].copy(), data["v"].copy(), int(data["step"])
        self.models[model_id] = model
        return self._info(model_id)

    def create_sampler(self, sampler_id: str, base_model: str | None, model_path: str | None) -> str:
        self._log("create_sampler", sampler_id, base_model, model_path)
        if model_path is not None:
            self.samplers[sampler_id] = self._load(model_path)[1]["bias"].copy()
        elif base_model == BASE_MODEL:
            self.samplers[sampler_id] = _base_bias()
        else:
            raise UnknownModelError(f"unknown base model {base_model!r}; supported: {BASE_MODEL}")
        return BASE_MODEL

    def create_ephemeral_sampler(self, sampler_id: str, model_id: str) -> str:
        self._log("create_ephemeral_sampler", sampler_id, model_id)
        self.samplers[sampler_id] = self._model(model_id).bias.copy()
        return BASE_MODEL

    def release(self, model_ids: list[str], sampler_ids: list[str]) -> None:
        self._log("release", tuple(model_ids), tuple(sampler_ids))
        for model_id in model_ids:
            self.models.pop(model_id, None)
        for sampler_id in sampler_ids:
            self.samplers.pop(sampler_id, None)

    def sample_batch(self, requests: list[tuple[str, SampleSpec]]) -> list[SampleResult | Exception]:
        self._log("sample_batch", len(requests))
        self.sample_batch_sizes.append(len(requests))
        results: list[SampleResult | Exception] = []
        for sampler_id, spec in requests:
            try:
                results.append(self._sample_one(sampler_id, spec))
            except EngineUserError as e:
                results.append(e)
        return results

    def _sample_one(self, sampler_id: str, spec: SampleSpec) -> SampleResult:
        if sampler_id not in self.samplers:
            raise UnknownModelError(f"unknown sampler {sampler_id!r}")
        if max(spec.prompt_tokens) >= VOCAB:
            raise EngineUserError(f"prompt token id {max(spec.prompt_tokens)} is outside the vocab [0, {VOCAB})")
        bias = self.samplers[sampler_id]
        rng = np.random.default_rng(spec.seed)
        stops = {EOS} if spec.stop_token_ids is None else set(spec.stop_token_ids)
        sequences = []
        for _ in range(spec.num_samples):
            last, tokens, logprobs, reason = spec.prompt_tokens[-1], [], [], "length"
            for _ in range(FAKE_CONTEXT - len(spec.prompt_tokens) if spec.max_tokens is None else spec.max_tokens):
                logp = _log_softmax((bias + CONTEXT * np.eye(VOCAB)[last]) / max(spec.temperature, 1e-6))
                token = int(rng.choice(VOCAB, p=np.exp(logp)))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                last = token
                if token in stops:
                    reason = "stop"
                    break
            sequences.append(SampledSequence(tokens, logprobs, reason))
        prompt_logprobs = None
        if spec.prompt_logprobs:
            prompt = np.array(spec.prompt_tokens)
            logp = _log_softmax(bias[None, :] + CONTEXT * np.eye(VOCAB)[prompt[:-1]])
            prompt_logprobs = [None] + [float(x) for x in logp[np.arange(prompt.size - 1), prompt[1:]]]
        return SampleResult(sequences, prompt_logprobs)

    def list_checkpoints(self, run_id: str | None = None) -> list[CheckpointInfo]:
        infos = []
        for path in sorted(self.root.glob("*/*/*.npz")):
            run, kind, name = unquote(path.parent.parent.name), path.parent.name, path.stem
            if run_id is None or run == run_id:
                stat = path.stat()
                path_of = f"tinker://{run}/{kind}/{name}"
                infos.append(
                    CheckpointInfo(path_of, run, kind, name, stat.st_mtime, stat.st_size, self.expires_at.get(path_of))
                )
        return infos

    def delete_checkpoint(self, tinker_path: str) -> None:
        parts = tinker_path.removeprefix("tinker://").split("/")
        path = self._file(*parts) if len(parts) == 3 else None
        if path is None or not path.is_file():
            raise UnknownModelError(f"no checkpoint at {tinker_path}")
        path.unlink()
