"""``LocalEngine``: the concrete :class:`~localtinker.engine.api.Engine` on torch + transformers + peft.

Called from one worker thread by the protocol layer. Holds one frozen base model per base-model
name (loaded on first use), one LoRA adapter + AdamW state per training model, and samplers that
point at a base model plus optional adapter weights (a checkpoint, or a snapshot of a training
model's current weights: in memory while a budget allows, spilled to disk beyond it; snapshots.py).

Devices (device.py): on the CPU the tuned path below; on a CUDA GPU, and on the CPU for models whose
attention the tuned kernels do not cover (families.py), the *portable path*: bf16 (or float32) weights once on
the device, packed padding-free training rows (packed_rows.py), a chunked unembedding + loss
(chunked_logprobs.py) and a KV-cache sampler with continuous batching (portable_sampling.py). Both paths share
validation, losses, LoRA (lora.py), AdamW and checkpoints.

Precision: ``float32`` is exact (sampler and trainer logprobs agree to ~1e-6); ``bfloat16`` keeps
the frozen base weights in bf16 and the LoRA weights, gradients, Adam moments and the unembedding in
float32; its matmuls run in bf16 only where this CPU measurably multiplies bf16 faster (bf16_matmul.py),
in float32 elsewhere (see models.py and README.md in this directory).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from localtinker.engine import host_transfer, merged_lora
from localtinker.engine.api import (
    AdamSpec,
    CheckpointInfo,
    DatumArrays,
    EngineUserError,
    ForwardBackwardResult,
    LoraSpec,
    ModelInfo,
    SampleResult,
    SampleSpec,
    UnknownModelError,
)
from localtinker.engine.bf16_matmul import bf16_matmul_is_fast
from localtinker.engine.checkpoints import CheckpointStore, LoadedCheckpoint, parse_tinker_path
from localtinker.engine.chunked_logprobs import chunked_token_logprobs
from localtinker.engine.families import architecture, context_length, final_softcap
from localtinker.engine.datums import PreparedDatum, prepare_datums
from localtinker.engine.device import DeviceLock, device_scope, resolve_device
from localtinker.engine.heap import keep_freed_memory
from localtinker.engine.logprobs import token_logprobs_tracking
from localtinker.engine.lora import AdapterHost, validate_lora_spec
from localtinker.engine.memory_errors import SAMPLING_REMEDY, memory_errors_named
from localtinker.engine.losses import DATUM_OF_TOKEN, LOSSES, gradient_tokens, resolve_loss_config
from localtinker.engine.models import DTYPES, TINY_RANDOM_NAME, BaseModel, load_base_model, portable_base_model
from localtinker.engine.optimizer import AdamState, adamw_step, validate_adam
from localtinker.engine.packaged import SMOLLM2_NAME
from localtinker.engine.packed_layers import PackedLayers, layers_by_default
from localtinker.engine.packed_rows import device_microbatch_tokens, packed_token_rows
from localtinker.engine.packed_training import pack_for_training
from localtinker.engine.peft_export import CheckpointFiles, external_weights_files, save_external_weights
from localtinker.engine import scoring
from localtinker.engine.api import SampleExtras, SampleExtrasSpec
from localtinker.engine.portable_sampling import PortableSampleStream, cache_bytes_per_token
from localtinker.engine.prefix_sharing import token_rows
from localtinker.engine.retained_forward import LogprobBatch, RetainedForward, forward_tracking
from localtinker.engine.sample_stream import SampleStream, SamplingTarget
from localtinker.engine.sampler import validate_sample_spec
from localtinker.engine.snapshots import SnapshotStore

# Padded tokens per forward/backward micro-batch (losses and gradients are sums, so splitting is exact):
# length-sorted rows in small micro-batches pad less and keep elementwise passes in cache. Rows longer than
# this run alone. Set by bench/bench_engine_sft_varlen.py (figures: docs/engine-notes.md, micro-batches).
TRAIN_MICROBATCH_TOKENS = 512
# Datums that share a prompt (prefix_sharing.py) take micro-batches this many times larger: their prompt
# and own-token passes each pay a whole pass's per-op cost, and the LoRA products gain from more rows; 8
# was faster still but nearly doubled peak memory. Set by bench/bench_rl_step.py (docs/engine-notes.md).
SHARED_MICROBATCH_FACTOR = 4
# Datums sharing a prompt (an RL group, a DPO pair) run it once (prefix_sharing.py). False: every datum
# runs whole (benchmarks and tests compare the two).
SHARE_PREFIXES = True
# A forward keeps the graphs of its first micro-batches, up to this many tokens (checked before each
# micro-batch), for a following forward_backward on the same datums, which then runs only their backward
# (retained_forward.py: the SDK's forward_backward_custom). The kept graphs hold those micro-batches'
# activations at once, ~1.2 MB per token on SmolLM2-135M.
RETAIN_FORWARDS = True
RETAINED_FORWARD_TOKENS = 2048
# Snapshots of a training model's weights (save_weights_and_get_sampling_client) kept per model, and the host
# memory all models' snapshots may hold before the oldest spill to disk (snapshots.py): 2 GiB is 22 rank-32
# adapters of a 1B model, 6 of an 8B one.
SNAPSHOTS_PER_MODEL = 8
SNAPSHOT_MEMORY_BYTES = 2 << 30
# Sampler adapters kept resident per base model (others reload from disk on use). Two cover an RL loop's
# current and previous snapshot; more made each of a run's first snapshots pay peft's adapter injection
# until the set was full (bench/bench_rl_step.py; docs/engine-notes.md, save_weights_and_get_sampling_client).
RESIDENT_SAMPLER_ADAPTERS = 2
# Of those, how many sample through weights with the LoRA folded in (merged_lora.py; float32 only). Each
# costs a copy of the adapted base weights (540 MB on SmolLM2-135M): two cover an RL loop's current and
# previous snapshot; a third set of weights sampled at the same moment runs unmerged.
MERGED_SAMPLER_ADAPTERS = 2
# Most tokens per packed micro-batch on the portable path off the CPU: a GPU step's fixed costs (kernel
# launches, the LoRA products' small shapes) amortise over many tokens; fewer where the activations would not
# fit the free memory (packed_rows.device_microbatch_tokens). On the CPU the tuned path's budget holds.
PORTABLE_MICROBATCH_TOKENS = 16384


@dataclass
class _TrainingModel:
    model_id: str
    base_name: str
    lora: LoraSpec
    adapter: str
    params: dict[str, torch.nn.Parameter]
    adam: AdamState = field(default_factory=AdamState)
    version: int = 0  # bumped by every weight change; snapshots are reused while it is unchanged


@dataclass
class _Sampler:
    base_name: str
    weights_path: str | None  # None = bare base model (or a snapshot); else a tinker:// path
    version: str = ""  # checkpoint creation time: a checkpoint overwritten under the same path is new weights
    snapshot: int | None = None  # the number of a training model's snapshot (snapshots.py)

    @property
    def weights_key(self) -> str | None:
        if self.snapshot is not None:
            return f"snapshot:{self.snapshot}"
        return None if self.weights_path is None else f"{self.weights_path}@{self.version}"


@dataclass
class _Host:
    base: BaseModel
    adapters: AdapterHost
    resident: OrderedDict = field(default_factory=OrderedDict)  # sampler weights key -> adapter name
    merged: OrderedDict = field(default_factory=OrderedDict)  # adapters with merged weights (keys), least recent first
    held: Counter = field(default_factory=Counter)  # adapter name -> decode batches using it (never evicted)

    def evict(self, key: str) -> None:
        """Drops the resident sampler adapter of weights ``key``, its merged copy with it."""
        name = self.resident.pop(key)
        self.merged.pop(name, None)
        self.adapters.delete_adapter(name)


class LocalEngine:
    def __init__(self, storage_dir: Path, dtype: str = "float32", num_threads: int | None = None,
                 device: str | torch.device = "cpu", portable: bool | None = None,
                 static_decode: bool | None = None, train_layers: bool | None = None) -> None:
        """``num_threads`` sets torch's (process-wide) intra-op threads; None keeps torch's default. On a
        2-core machine shared with other busy processes, 1 thread is several times faster than 2.
        ``device``: ``cpu``, ``cuda[:N]`` or ``auto`` (device.py). ``portable``: None = the portable path off
        the CPU and for models the CPU kernels do not cover; True = always (the CUDA path's code on the CPU).
        ``static_decode``: the portable sampler decodes over a preallocated cache (static_decode.py; CUDA graphs
        on a GPU); None = on CUDA devices only. ``train_layers``: the portable trainer runs the Llama-shaped
        families' layers as written-out pieces (packed_layers.py; compiled on a GPU); None = on CUDA devices
        unless ``LOCALTINKER_TRAIN_LAYERS=0``."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.portable = True if self.device.type != "cpu" else portable
        self.static_decode = self.device.type == "cuda" if static_decode is None else static_decode
        self.train_layers = layers_by_default(self.device) if train_layers is None else train_layers
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()  # before the worker thread first allocates (heap.py)
        self.dtype = dtype
        self.storage_dir = Path(storage_dir)
        self.checkpoints = CheckpointStore(self.storage_dir / "checkpoints")
        self.snapshots = SnapshotStore(self.storage_dir / "ephemeral", SNAPSHOTS_PER_MODEL, SNAPSHOT_MEMORY_BYTES)
        self._hosts: dict[str, _Host] = {}
        self._models: dict[str, _TrainingModel] = {}
        self._samplers: dict[str, _Sampler] = {}
        # the protocol calls from one thread; this guards misuse, and makes the engine's card current (device.py)
        self._lock = DeviceLock(self.device)
        self._retained: RetainedForward | None = None  # the last forward's kept micro-batches (retained_forward.py)

    # ----- models -------------------------------------------------------------------------------

    def supported_models(self) -> list[ModelInfo]:
        return [self._base_info(name) for name in (SMOLLM2_NAME, TINY_RANDOM_NAME)]

    def add_base_model(self, name: str, model: torch.nn.Module, tokenizer: object | None = None,
                       tokenizer_id: str = "") -> None:
        """Serves an in-memory causal LM under ``name`` on the portable path (benchmarks of random-initialised
        shapes; tools that build their own model). Its parameters move to this engine's device."""
        with self._lock:
            base = portable_base_model(name, model, tokenizer, tokenizer_id, self.device)
            self._hosts[name] = _Host(base=base, adapters=AdapterHost(base.model))

    def create_model(self, model_id: str, base_model: str, lora: LoraSpec) -> ModelInfo:
        with self._lock:
            if model_id in self._models:
                raise EngineUserError(f"model_id {model_id!r} already exists; use a new id.")
            if "/" in model_id or not model_id:
                raise EngineUserError(f"model_id {model_id!r} must be non-empty and contain no '/'.")
            validate_lora_spec(lora)
            host = self._host(base_model)
            if not host.base.portable and (self.dtype == "float32" or bf16_matmul_is_fast()):  # own-dtype weights
                pack_for_training(host.base.model)  # once per base model (packed_training.py)
            adapter = host.adapters.add_adapter(lora, lora.seed)
            self._models[model_id] = _TrainingModel(
                model_id=model_id,
                base_name=base_model,
                lora=lora,
                adapter=adapter,
                params=host.adapters.parameters(adapter),
            )
            return self.get_info(model_id)

    def get_info(self, model_id: str) -> ModelInfo:
        model = self._model(model_id)
        base = self._hosts[model.base_name].base
        return ModelInfo(
            model_id=model_id,
            base_model=model.base_name,
            tokenizer_id=base.tokenizer_id,
            lora_rank=model.lora.rank,
            arch=base.arch,
            max_context_length=base.max_context_length,
        )

    def lora_spec(self, model_id: str) -> LoraSpec:
        """The LoRA config a training model was created (or restored) with."""
        return self._model(model_id).lora

    def lora_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        """A copy of a training model's LoRA tensors, keyed ``"<module path>.lora_A|B"`` (for tests and tools)."""
        return self._weights(self._model(model_id))

    def lora_grads(self, model_id: str) -> dict[str, torch.Tensor | None]:
        """A copy of the gradients accumulated since the last ``optim_step`` (None where nothing accumulated)."""
        params = self._model(model_id).params
        return {key: None if p.grad is None else p.grad.detach().clone() for key, p in params.items()}

    def unload_model(self, model_id: str) -> None:
        """Frees a training model's adapter and optimizer state (its checkpoints stay on disk)."""
        with self._lock:
            model = self._models.pop(model_id, None)
            self._drop_retained(model_id)
            if model is not None:
                self._hosts[model.base_name].adapters.delete_adapter(model.adapter)

    def release(self, model_ids: list[str], sampler_ids: list[str]) -> None:
        """Frees a finished session's training models (adapter, optimizer state, snapshots) and samplers;
        their checkpoints stay on disk."""
        with self._lock:
            for model_id in model_ids:
                self.unload_model(model_id)
                self.snapshots.drop_model(model_id)
            for sampler_id in sampler_ids:
                self._samplers.pop(sampler_id, None)
            self._evict_unreferenced_adapters()

    def _evict_unreferenced_adapters(self) -> None:
        """Sampler adapters (and their merged copies) that no remaining sampler points at leave memory now,
        rather than when the resident set next needs their slot."""
        live = {sampler.weights_key for sampler in self._samplers.values()}
        for host in self._hosts.values():
            for key, name in list(host.resident.items()):
                if key not in live and not host.held[name]:
                    host.evict(key)

    # ----- training -----------------------------------------------------------------------------

    def forward_backward(
        self,
        model_id: str,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardBackwardResult:
        with self._lock:
            model = self._model(model_id)
            host = self._hosts[model.base_name]
            config = resolve_loss_config(loss_fn, loss_fn_config)
            datums = prepare_datums(data, loss_fn, host.base.vocab_size, host.base.max_context_length)
            work = f"{'forward' if forward_only else 'forward_backward'} of {len(datums)} datums " \
                   f"({sum(len(d.tokens) for d in datums)} tokens)"
            remedy = ("Send fewer or shorter datums per call: gradients of several forward_backward calls add up "
                      "until optim_step.")
            with memory_errors_named(work, self.device, remedy):
                return self._forward_backward(model, host, datums, loss_fn, config, forward_only)

    def _forward_backward(self, model, host, datums, loss_fn, config, forward_only) -> ForwardBackwardResult:
        """forward_backward on validated datums (a failure leaves the gradients as they were)."""
        if host.base.portable:
            return self._portable_forward_backward(model, host, datums, loss_fn, config, forward_only)
        retained, self._retained = self._retained, None
        if forward_only or not (retained and retained.serves(model.model_id, model.version, datums, loss_fn, config)):
            retained = None  # freed before this call's own forward
        with host.adapters.activated(model.adapter):
            if forward_only:
                if RETAIN_FORWARDS:
                    return self._forward_retaining(model, host, datums, loss_fn, config)
                with torch.inference_mode():
                    return self._losses(self._logprob_batches(host, datums, loss_fn, config), datums, loss_fn,
                                        config, backward=False)
            if retained:  # the kept micro-batches need a backward only; the others run here again
                rest = retained.recompute
                batches = itertools.chain(
                    retained.batches,
                    self._logprob_batches(host, [datums[i] for i in rest], loss_fn, config, keys=rest) if rest else (),
                )
            else:
                batches = self._logprob_batches(host, datums, loss_fn, config)
            del retained
            return self._accumulate_grads(model, lambda: self._losses(batches, datums, loss_fn, config, backward=True))

    def _portable_forward_backward(self, model, host, datums, loss_fn, config, forward_only) -> ForwardBackwardResult:
        """The portable path's forward(_backward): packed rows, chunked logprobs, loss inputs on the device."""
        device = self.device
        causal_lm = host.base.model
        budget = (device_microbatch_tokens(causal_lm.config, device, PORTABLE_MICROBATCH_TOKENS)
                  if device.type != "cpu" else TRAIN_MICROBATCH_TOKENS)
        lm_head, softcap = causal_lm.get_output_embeddings(), final_softcap(causal_lm.config)
        tokens, targets = [d.tokens for d in datums], [d.targets for d in datums]
        layers = PackedLayers.for_model(causal_lm) if self.train_layers else None

        def batches() -> Iterator[LogprobBatch]:
            for rows in packed_token_rows(causal_lm.get_decoder(), tokens, targets, budget, device, layers):
                logprobs = chunked_token_logprobs(rows.hidden, lm_head, rows.targets, softcap)
                yield LogprobBatch(rows.datum_rows, logprobs, torch.ones_like(rows.targets, dtype=torch.bool))

        with host.adapters.activated(model.adapter):
            if forward_only:
                with torch.inference_mode():
                    return self._losses(batches(), datums, loss_fn, config, backward=False)
            return self._accumulate_grads(model, lambda: self._losses(batches(), datums, loss_fn, config, backward=True))

    def _forward_retaining(self, model, host, datums, loss_fn, config) -> ForwardBackwardResult:
        """A forward keeping the graphs of its first micro-batches, up to ``RETAINED_FORWARD_TOKENS`` tokens
        (checked before each), for a following ``forward_backward`` on the same datums (retained_forward.py)."""
        kept: list[LogprobBatch] = []
        others: list[LogprobBatch] = []
        kept_tokens = 0
        batches = self._logprob_batches(host, datums, loss_fn, config, tracking=forward_tracking)
        while True:
            keep = kept_tokens < RETAINED_FORWARD_TOKENS
            with torch.set_grad_enabled(keep):
                batch = next(batches, None)
            if batch is None:
                break
            if keep:
                kept.append(batch)
                kept_tokens += batch.logprobs.shape[0]
            else:
                others.append(batch)
        kept_datums = {index for batch in kept for index in batch.datum_rows}
        self._retained = RetainedForward(
            model.model_id, model.version, [d.tokens for d in datums], [d.targets for d in datums], kept,
            recompute=[index for index in range(len(datums)) if index not in kept_datums],
        )
        with torch.no_grad():
            return self._losses(iter(kept + others), datums, loss_fn, config, backward=False)

    def _accumulate_grads(self, model, run: Callable[[], ForwardBackwardResult]) -> ForwardBackwardResult:
        """Computes grads into fresh buffers and adds them on success, so a failure leaves earlier grads intact."""
        previous = {key: p.grad for key, p in model.params.items()}
        for param in model.params.values():
            param.grad = None
        try:
            result = run()
        except BaseException:
            for key, param in model.params.items():
                param.grad = previous[key]
            raise
        for key, param in model.params.items():
            if previous[key] is not None:
                param.grad = previous[key] if param.grad is None else param.grad.add_(previous[key])
        return result

    def _logprob_batches(self, host: _Host, datums: list[PreparedDatum], loss_fn: str, config,
                         tracking: Callable[[PreparedDatum], torch.Tensor] | None = None,
                         keys: list[int] | None = None) -> Iterator[LogprobBatch]:
        """Token logprobs per micro-batch, with a graph through the rows ``tracking`` marks (by default the
        tokens ``loss_fn`` can move), computed one micro-batch at a time as the caller asks for the next
        (under the caller's grad mode at that moment). ``keys``: the datums' indices in the call, when they
        are a subset of it."""
        causal_lm = host.base.model
        lm_head = causal_lm.get_output_embeddings()
        tokens, targets = [d.tokens for d in datums], [d.targets for d in datums]
        for rows in token_rows(causal_lm.get_decoder(), tokens, targets, TRAIN_MICROBATCH_TOKENS, share=SHARE_PREFIXES,
                               shared_budget=SHARED_MICROBATCH_FACTOR * TRAIN_MICROBATCH_TOKENS):
            tracked = torch.zeros(rows.targets.shape[0], dtype=torch.bool)
            for index, datum_rows in rows.datum_rows.items():
                marks = tracking(datums[index]) if tracking else gradient_tokens(loss_fn, datums[index].loss_inputs, config)
                tracked[datum_rows[marks]] = True
            logprobs = token_logprobs_tracking(rows.hidden, lm_head, rows.targets, tracked)
            datum_rows = rows.datum_rows if keys is None else {keys[i]: r for i, r in rows.datum_rows.items()}
            yield LogprobBatch(datum_rows, logprobs, tracked)

    @staticmethod
    def _losses(batches: Iterator[LogprobBatch], datums: list[PreparedDatum], loss_fn: str, config,
                backward: bool) -> ForwardBackwardResult:
        """``loss_fn`` on each micro-batch's logprobs (back-propagated micro-batch by micro-batch when
        ``backward``): per-datum logprobs and elementwise losses, and the summed loss. The loss runs once over
        the micro-batch's datums laid end to end, with one copy to the host: an RL batch of thousands of short
        datums would otherwise pay a dozen kernels and two device syncs per datum."""
        loss_function = LOSSES[loss_fn]
        outputs: list[dict[str, np.ndarray]] = [{} for _ in datums]
        total = 0.0
        for batch in batches:
            indices = list(batch.datum_rows)
            lengths = [len(batch.datum_rows[i]) for i in indices]
            lp, elementwise = _micro_batch_loss(batch, [datums[i] for i in indices], lengths, loss_function, config)
            batch_loss = elementwise.sum()
            if backward:
                batch_loss.backward()
            host_lp = lp.detach().float().cpu().numpy().copy()  # owned, not a view of a tensor's memory
            host_loss = elementwise.detach().float().cpu().numpy().copy()
            bounds = np.cumsum(lengths)[:-1]
            for index, datum_lp, datum_loss in zip(indices, np.split(host_lp, bounds), np.split(host_loss, bounds)):
                outputs[index] = {"logprobs": datum_lp, "elementwise_loss": datum_loss}
            total += float(batch_loss.detach())
        return ForwardBackwardResult(loss_fn_outputs=outputs, metrics={"loss:sum": total})

    def optim_step(self, model_id: str, adam: AdamSpec) -> dict[str, float]:
        with self._lock:
            model = self._model(model_id)
            validate_adam(adam)
            metrics = adamw_step(model.params, model.adam, adam, foreach=self.device.type != "cpu")
            model.version += 1
            self._drop_retained(model_id)
            return metrics

    # ----- checkpoints --------------------------------------------------------------------------

    def save_state(self, model_id: str, name: str, ttl_seconds: int | None = None) -> str:
        with self._lock:
            model = self._model(model_id)
            return self.checkpoints.save(
                model_id,
                "weights",
                name,
                adapter=self._weights(model),
                meta=self._meta(model),
                optimizer=self._host_tensors(model.adam.to_tensors()),
                ttl_seconds=ttl_seconds,
            )

    def save_sampler_weights(self, model_id: str, name: str, ttl_seconds: int | None = None) -> str:
        with self._lock:
            model = self._model(model_id)
            return self.checkpoints.save(
                model_id, "sampler_weights", name, self._weights(model), self._meta(model), ttl_seconds=ttl_seconds
            )

    def save_external_weights(self, model_id: str, name: str, ttl_seconds: int | None = None) -> str:
        with self._lock:
            model = self._model(model_id)
            return save_external_weights(
                self.checkpoints, model_id, name, self._weights(model), self._meta(model), ttl_seconds
            )

    def external_weights_files(self, tinker_path: str) -> CheckpointFiles:
        with self._lock:
            return external_weights_files(self.checkpoints, tinker_path)

    def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        with self._lock:
            self.checkpoints.set_public(tinker_path, public)

    def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        with self._lock:
            self.checkpoints.set_ttl(tinker_path, ttl_seconds)

    def load_state(self, model_id: str, path: str, with_optimizer: bool, base_model: str | None) -> ModelInfo:
        with self._lock:
            checkpoint = self.checkpoints.load(path)
            if with_optimizer and checkpoint.optimizer is None:
                raise EngineUserError(
                    f"{path} holds no optimizer state (sampler weights); restore from a tinker://.../weights/... path "
                    "or use create_training_client_from_state without optimizer."
                )
            lora = LoraSpec(**checkpoint.meta["lora"])
            info = self.create_model(model_id, base_model or checkpoint.meta["base_model"], lora)
            model = self._models[model_id]
            try:
                self._hosts[model.base_name].adapters.import_weights(model.adapter, checkpoint.adapter)
            except BaseException:
                self.unload_model(model_id)
                raise
            if with_optimizer:
                model.adam = self._restored_adam(checkpoint)
            return info

    def load_state_into(self, model_id: str, path: str, with_optimizer: bool) -> None:
        """Loads a checkpoint into an existing training model (the SDK's deprecated in-place load_state)."""
        with self._lock:
            model = self._model(model_id)
            checkpoint = self.checkpoints.load(path)
            if with_optimizer and checkpoint.optimizer is None:
                raise EngineUserError(f"{path} holds no optimizer state (sampler weights); use load_state without optimizer.")
            if checkpoint.meta["base_model"] != model.base_name:
                raise EngineUserError(
                    f"{path} was trained on {checkpoint.meta['base_model']!r}, this model is {model.base_name!r}; "
                    "load it with create_training_client_from_state instead."
                )
            self._hosts[model.base_name].adapters.import_weights(model.adapter, checkpoint.adapter)
            for param in model.params.values():
                param.grad = None
            model.adam = self._restored_adam(checkpoint) if with_optimizer else AdamState()
            model.version += 1
            self._drop_retained(model_id)

    def list_checkpoints(self, run_id: str | None = None) -> list[CheckpointInfo]:
        return self.checkpoints.list(run_id)

    def delete_checkpoint(self, tinker_path: str) -> None:
        with self._lock:
            self.checkpoints.delete(tinker_path)

    # ----- sampling -----------------------------------------------------------------------------

    def create_sampler(self, sampler_id: str, base_model: str | None, model_path: str | None) -> str:
        with self._lock:
            version = ""
            if model_path:
                parse_tinker_path(model_path)
                meta = self.checkpoints.meta(model_path)
                base_name = base_model or meta["base_model"]
                version = str(meta.get("created_at", ""))
            elif base_model:
                base_name = base_model
            else:
                raise EngineUserError("create_sampling_client needs a base_model or a model_path.")
            self._host(base_name)
            self._samplers[sampler_id] = _Sampler(base_name=base_name, weights_path=model_path or None, version=version)
            return base_name

    def create_ephemeral_sampler(self, sampler_id: str, model_id: str) -> str:
        with self._lock:
            model = self._model(model_id)
            number = self.snapshots.find(model_id, model.version)
            if number is None:
                number = self.snapshots.add(model_id, model.version, host_transfer.to_host(model.params),
                                            model.lora.__dict__)
            self._samplers[sampler_id] = _Sampler(base_name=model.base_name, weights_path=None, snapshot=number)
            return model.base_name

    def sample_batch(self, requests: list[tuple[str, SampleSpec]]) -> list[SampleResult | Exception]:
        """Runs the requests to completion through one :class:`SampleStream` (the protocol keeps its own, long-lived)."""
        with self._lock:
            stream = self.sample_stream()
            for index, (sampler_id, spec) in enumerate(requests):
                stream.submit(index, sampler_id, spec)
            results: list[SampleResult | Exception | None] = [None] * len(requests)
            while stream.busy:
                for index, result in stream.step():
                    results[index] = result
            return results  # type: ignore[return-value]

    def sample_stream(self) -> "RoutedSampleStream":
        """Continuous batching over this engine's samplers: requests join and leave between decode steps; each
        request goes to its base model's path (the tuned CPU stream, or the portable one)."""
        portable = PortableSampleStream(self, static_decode=self.static_decode)
        return RoutedSampleStream(SampleStream(self), portable, self._sampler_is_portable, self.device)

    def _sampler_is_portable(self, sampler_id: str) -> bool:
        sampler = self._samplers.get(sampler_id)
        return sampler is not None and self._hosts[sampler.base_name].base.portable

    def prepare_sample(self, sampler_id: str, spec: SampleSpec) -> tuple[str, SampleSpec]:
        """Validates a request for ``sampler_id``; returns (its weights key, the spec with max_tokens resolved)."""
        sampler = self._sampler(sampler_id)
        base = self._hosts[sampler.base_name].base
        if spec.max_tokens is None:  # no limit given: up to the end of the context
            spec = replace(spec, max_tokens=max(0, base.max_context_length - len(spec.prompt_tokens)))
        validate_sample_spec(spec, base.vocab_size, base.max_context_length)
        return f"{sampler.base_name}|{sampler.weights_key}", spec

    def cache_bytes_per_token(self, sampler_id: str) -> int:
        """Bytes of keys and values a token of ``sampler_id``'s samples holds in the portable sampler's cache."""
        return cache_bytes_per_token(self._hosts[self._sampler(sampler_id).base_name].base.model)

    def sample_extras(self, sampler_id: str, spec: SampleSpec, extras: SampleExtrasSpec, result: SampleResult) -> SampleExtras:
        with self._lock:
            target = self.sampling_target(sampler_id)
            try:
                return scoring.sample_extras(target, spec, extras, result)
            finally:
                target.release()

    def sampling_target(self, sampler_id: str) -> SamplingTarget:
        """The sampler's base model with its adapter resident and held (not evicted) until ``release``."""
        sampler = self._sampler(sampler_id)
        host = self._hosts[sampler.base_name]
        adapter = self._resident_adapter(host, sampler)
        if adapter is not None:
            if not host.base.portable:  # merged copies are float32 CPU weights (merged_lora.py)
                self._merge_for_sampling(host, adapter)
            host.held[adapter] += 1
        base = host.base
        pad = getattr(base.tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else (base.eos_token_ids[0] if base.eos_token_ids else 0)

        def release() -> None:
            if adapter is not None:
                host.held[adapter] -= 1

        return SamplingTarget(
            model=base.model,
            tokenizer=base.tokenizer,
            eos_token_ids=base.eos_token_ids,
            pad_token_id=pad,
            activate=lambda: host.adapters.activated(adapter),
            release=release,
            adapter=adapter,
        )

    def _resident_adapter(self, host: _Host, sampler: _Sampler) -> str | None:
        key = sampler.weights_key
        if key is None:
            return None
        if key in host.resident:
            host.resident.move_to_end(key)
            return host.resident[key]
        if sampler.snapshot is not None:
            weights, layout = self.snapshots.load(sampler.snapshot)
            lora = LoraSpec(**layout)
        else:
            assert sampler.weights_path is not None
            checkpoint = self.checkpoints.load(sampler.weights_path)
            weights, lora = checkpoint.adapter, LoraSpec(**checkpoint.meta["lora"])
        adapter = self._reused_adapter(host, lora) or host.adapters.add_adapter(lora, seed=0)
        try:
            host.adapters.import_weights(adapter, weights)
        except BaseException:
            host.adapters.delete_adapter(adapter)
            raise
        host.resident[key] = adapter
        # Least recently used first; adapters a decode batch still uses stay (so the limit is soft).
        evictable = [k for k, name in host.resident.items() if not host.held[name] and k != key]
        while len(host.resident) > RESIDENT_SAMPLER_ADAPTERS and evictable:
            host.evict(evictable.pop(0))
        return adapter

    @staticmethod
    def _reused_adapter(host: _Host, lora: LoraSpec) -> str | None:
        """When the resident set is full: the least recently used sampler adapter no decode batch holds and
        of ``lora``'s layout, taken out of the set (merged copy and rounded factors dropped) to receive the
        next snapshot's weights; None otherwise. An RL loop samples a new snapshot every step, and
        reusing an adapter skips peft's injection and deletion (lora.py, ``reusable_for``)."""
        if len(host.resident) < RESIDENT_SAMPLER_ADAPTERS:
            return None
        for key, name in host.resident.items():  # least recently used first
            if not host.held[name] and host.adapters.reusable_for(name, lora):
                del host.resident[key]
                host.merged.pop(name, None)
                host.adapters.forget_derived(name)
                return name
        return None

    def _merge_for_sampling(self, host: _Host, adapter: str) -> None:
        """Folds a sampler adapter into its base weights (merged_lora.py) when a slot is free or can be freed
        (least recently used first, never one a decode batch is using) and no batch is decoding it unmerged."""
        model = host.base.model
        if adapter in host.merged:
            host.merged.move_to_end(adapter)
            return
        if host.held[adapter] or not merged_lora.mergeable(model, adapter):
            return
        while len(host.merged) >= MERGED_SAMPLER_ADAPTERS:
            victim = next((name for name in host.merged if not host.held[name]), None)
            if victim is None:
                return
            del host.merged[victim]
            merged_lora.unmerge(model, victim)
        merged_lora.merge(model, adapter)
        host.merged[adapter] = None

    # ----- helpers ------------------------------------------------------------------------------

    def _drop_retained(self, model_id: str) -> None:
        if self._retained is not None and self._retained.model_id == model_id:
            self._retained = None

    def _host(self, base_model: str) -> _Host:
        if base_model not in self._hosts:
            base = load_base_model(base_model, self.dtype, self.device, self.portable)
            self._hosts[base_model] = _Host(base=base, adapters=AdapterHost(base.model))
        return self._hosts[base_model]

    def _base_info(self, name: str) -> ModelInfo:
        """What the model's config says: a loaded model's own, else the config file's."""
        from transformers import AutoConfig

        from localtinker.engine.models import resolve_model_dir

        if name in self._hosts:
            base = self._hosts[name].base
            arch, context, tokenizer_id = base.arch, base.max_context_length, base.tokenizer_id
        else:
            tokenizer_id = resolve_model_dir(name)
            config = AutoConfig.from_pretrained(tokenizer_id)
            arch, context = architecture(config), context_length(config)
        return ModelInfo(model_id=name, base_model=name, tokenizer_id=tokenizer_id, lora_rank=0, arch=arch,
                         max_context_length=context)

    def _model(self, model_id: str) -> _TrainingModel:
        model = self._models.get(model_id)
        if model is None:
            raise UnknownModelError(
                f"unknown model_id {model_id!r}; create a training client first (known: {len(self._models)} models)."
            )
        return model

    def _sampler(self, sampler_id: str) -> _Sampler:
        sampler = self._samplers.get(sampler_id)
        if sampler is None:
            raise UnknownModelError(f"unknown sampling session {sampler_id!r}; create a sampling client first.")
        return sampler

    def _weights(self, model: _TrainingModel) -> dict[str, torch.Tensor]:
        """Host copies of the adapter (from a device in one copy)."""
        return host_transfer.to_host(model.params)

    def _host_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` on the host for a checkpoint written at once: the CPU's own tensors, a device's in one copy."""
        if self.device.type == "cpu":
            return {key: value.cpu() for key, value in tensors.items()}
        return host_transfer.to_host(tensors)

    def _restored_adam(self, checkpoint: LoadedCheckpoint) -> AdamState:
        """A checkpoint's optimizer state with its moments on this engine's device."""
        adam = AdamState.from_tensors(int(checkpoint.meta["step"]), checkpoint.optimizer)
        adam.exp_avg = host_transfer.to_device(adam.exp_avg, self.device)
        adam.exp_avg_sq = host_transfer.to_device(adam.exp_avg_sq, self.device)
        return adam

    def _meta(self, model: _TrainingModel) -> dict:
        return {"base_model": model.base_name, "lora": model.lora.__dict__, "step": model.adam.step}


def _micro_batch_loss(batch: LogprobBatch, datums: list[PreparedDatum], lengths: list[int], loss_function, config
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss over ``datums`` (the batch's, in its order, of ``lengths`` tokens) laid end to end: (their
    logprobs, the elementwise loss), one gather and one kernel per operation of the loss."""
    device = batch.logprobs.device
    lp = batch.logprobs[torch.cat(list(batch.datum_rows.values())).to(device, non_blocking=True)]
    inputs = {key: torch.cat([d.loss_inputs[key] for d in datums]).to(device, non_blocking=True)
              for key in datums[0].loss_inputs}
    inputs[DATUM_OF_TOKEN] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(
        device, non_blocking=True)
    return lp, loss_function(lp, inputs, config)


class RoutedSampleStream:
    """The engine's one sample stream: each request to the stream of its base model's path."""

    def __init__(self, tuned: SampleStream, portable: PortableSampleStream, is_portable: Callable[[str], bool],
                 device: torch.device) -> None:
        self.tuned, self.portable, self._is_portable, self.device = tuned, portable, is_portable, device
        self._open = 0  # requests submitted and not yet completed

    @property
    def busy(self) -> bool:
        return self.tuned.busy or self.portable.busy

    def __getattr__(self, name: str):  # the tuned stream's statistics and state (tests, benches)
        return getattr(self.tuned, name)

    def submit(self, key, sampler_id: str, spec: SampleSpec) -> None:
        (self.portable if self._is_portable(sampler_id) else self.tuned).submit(key, sampler_id, spec)
        self._open += 1

    def progress(self, key) -> list[list[int]] | None:
        found = self.tuned.progress(key)
        return found if found is not None else self.portable.progress(key)

    def step(self) -> list:
        """One decode step of every running request (a failure fails them all: the caller starts a new stream)."""
        with memory_errors_named(f"sampling {self._open} requests at once", self.device, SAMPLING_REMEDY), \
                device_scope(self.device):  # (the protocol's worker steps the stream outside the engine's lock)
            completed = self.tuned.step() if self.tuned.busy else []
            completed += self.portable.step() if self.portable.busy else []
        self._open -= len(completed)
        return completed
