"""LoRA adapters through peft, many per frozen base model.

One :class:`AdapterHost` per base model injects every client's adapter into the *same* frozen model
with peft's multi-adapter support, so ten training clients on SmolLM2 cost one copy of the base
weights. Clients never interfere: each adapter has its own parameters (and, in the engine, its own
optimizer state), and the host activates exactly one adapter (or none) per call; the engine calls it
from one thread.

Adapter weights are exchanged as flat ``{"<module path>.lora_A": tensor, ...}`` dicts, independent of
peft's internal adapter names, so checkpoints load into any adapter slot.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from localtinker.engine import host_transfer
from localtinker.engine.api import EngineUserError, LoraSpec
from localtinker.engine.expert_lora import ExpertAdapters, adapters_of, expert_rank, fused_experts, unsupported
from localtinker.engine.families import text_config
from localtinker.engine.merged_lora import forget_layers, lora_layers, merged_output, unmerge

# The projections each of Tinker's groups adapts, by module name (peft matches a module whose name ends with one):
# the Llama family's (SmolLM2, Llama, Qwen2/3, Mistral, Gemma, Granite, Cohere, OLMo, ...), then the other
# families' own: Phi-3's fused qkv and gate/up, latent attention's down and up projections (DeepSeek-V2/V3,
# MiniCPM3), Falcon's and GPT-NeoX's fused qkv, attention output and MLP, Phi-2's and StarCoder2's MLP. An adapter
# that leaves a projection of a group it trains without LoRA, or gives one to a group it does not train (GPT-2's
# attention also has a c_proj), is refused (AdapterHost.add_adapter, misadapted_projections).
ATTENTION_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_a_proj", "q_b_proj",
                                      "kv_a_proj_with_mqa", "kv_b_proj", "query_key_value", "dense")
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "dense_h_to_4h", "dense_4h_to_h",
                                "fc1", "fc2", "c_fc", "c_proj")
UNEMBED_MODULES: tuple[str, ...] = ("lm_head",)
LORA_ALPHA = 32  # Tinker's convention: scaling = alpha / rank.


def target_module_names(spec: LoraSpec) -> list[str]:
    names: list[str] = []
    if spec.train_attn:
        names += ATTENTION_MODULES
    if spec.train_mlp:
        names += MLP_MODULES
    if spec.train_unembed:
        names += UNEMBED_MODULES
    return names


def validate_lora_spec(spec: LoraSpec) -> None:
    if not isinstance(spec.rank, int) or spec.rank < 1:
        raise EngineUserError(f"LoraConfig.rank must be a positive integer, got {spec.rank!r}.")
    if not target_module_names(spec):
        raise EngineUserError(
            "LoraConfig trains nothing: set at least one of train_attn, train_mlp, train_unembed to True."
        )


class AdapterHost:
    """Holds one frozen base model and the LoRA adapters injected into it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._peft = None  # peft.PeftModel, created with the first adapter
        self._counter = 0
        self._active: str | None = None
        self._enabled = True
        self._layouts: dict[str, tuple[int, bool, bool, bool]] = {}  # adapter -> (rank, unembed, mlp, attn)
        self._experts: dict[str, ExpertAdapters] = {}  # module path -> the fused experts' adapters (expert_lora.py)
        self._in_peft: set[str] = set()  # adapters with peft layers (one on fused experts alone has none)

    def add_adapter(self, spec: LoraSpec, seed: int | None) -> str:
        """Creates a freshly initialised adapter (A random from ``seed``, B zero); returns its name."""
        from peft import LoraConfig, get_peft_model

        validate_lora_spec(spec)
        fused = fused_experts(self.model)
        experts = _adaptable(fused) if spec.train_mlp else []
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=target_module_names(spec),
            bias="none",
        )
        name = f"adapter{self._counter}"
        self._counter += 1
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), peft_targets_as_named():
            # peft warns that lm_head is tied to the embeddings; the LoRA delta is deliberately lm_head-only.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            torch.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
            if _named_in(self.model, config.target_modules):
                if self._peft is None:
                    self._peft = get_peft_model(self.model, config, adapter_name=name)
                else:
                    self._peft.add_adapter(name, config)
                self._in_peft.add(name)
            rank = expert_rank(spec.rank, text_config(self.model.config))
            for path, module in experts:
                self._experts.setdefault(path, adapters_of(module)).add(name, rank, LORA_ALPHA / spec.rank)
        install_fused_forward(self.model)
        if not self.parameters(name):
            self.delete_adapter(name)
            raise EngineUserError(
                f"LoRA target modules {sorted(config.target_modules)} match no layer of this base model; "
                "localtinker adapts projections by these names only."
            )
        untrained, unasked = misadapted_projections(self.model, spec, name)
        if untrained or unasked:
            self.delete_adapter(name)
            what = "; ".join(part for part in (
                f"untrained: {', '.join(untrained)}" if untrained else "",
                f"adapted though their group was not asked for: {', '.join(unasked)}" if unasked else "") if part)
            raise EngineUserError(
                f"LoRA would train this {text_config(self.model.config).model_type!r} model's layers in part ({what}). "
                f"localtinker adapts projections by name (attention: {', '.join(ATTENTION_MODULES)}; MLP: "
                f"{', '.join(MLP_MODULES)}) and trains a group whole or not at all. Create the training client with "
                "train_attn=False or train_mlp=False for that group, or use a model whose projections have these "
                "names."
            )
        self._active = None  # peft may have changed the active adapter
        self._layouts[name] = _layout(spec)
        return name

    def reusable_for(self, name: str, spec: LoraSpec) -> bool:
        """Whether adapter ``name`` has the layers and rank ``spec`` asks for, so that another snapshot's
        weights can be imported into it (``import_weights``) instead of injecting a new adapter: peft's
        injection walks every module of the model, a few % of an RL step that samples a new snapshot each
        step. Call :meth:`forget_derived` before reusing it."""
        return self._layouts.get(name) == _layout(spec)

    def forget_derived(self, name: str) -> None:
        """Drops what was derived from adapter ``name``'s weights: merged sampling copies and rounded factors."""
        unmerge(self.model, name)
        for layer in lora_layers(self.model, name):
            layer.__dict__.get(_CAST, {}).pop(name, None)

    def delete_adapter(self, name: str) -> None:
        for experts in self._experts.values():
            experts.delete(name)
        self._layouts.pop(name, None)
        if name in self._in_peft:
            self.forget_derived(name)
            self._in_peft.discard(name)
            if len(self._peft.peft_config) == 1:
                # peft refuses to delete the last adapter; leave it (it is never activated again).
                return
            with warnings.catch_warnings():
                # peft warns when the adapter it deletes was active and it picks another: which one is active is
                # this host's to say (activated()), so the notice is noise on a server's log and the demo's output
                warnings.filterwarnings("ignore", message=r"Adapter .* was active which is now deleted")
                self._peft.delete_adapter(name)
            forget_layers(self.model, name)
            self._active = None

    def parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's trainable tensors keyed ``"<module path>.lora_A"`` / ``".lora_B"``, in a stable order."""
        params: dict[str, torch.nn.Parameter] = {}
        for path, module in self.model.named_modules():
            lora_a = getattr(module, "lora_A", None)
            if isinstance(lora_a, torch.nn.ModuleDict) and name in lora_a:
                clean = path.replace(".base_layer", "")
                params[f"{clean}.lora_A"] = lora_a[name].weight
                params[f"{clean}.lora_B"] = module.lora_B[name].weight
        for path, experts in self._experts.items():
            params.update({f"{path}.{key}": tensor for key, tensor in experts.factors.get(name, {}).items()})
        return params

    def import_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        """Copies saved weights into adapter ``name``; shapes and keys must match exactly."""
        params = self.parameters(name)
        if set(params) != set(weights):
            missing = sorted(set(params) - set(weights))[:3]
            extra = sorted(set(weights) - set(params))[:3]
            raise EngineUserError(
                f"checkpoint does not match the adapter layout (missing {missing}, unexpected {extra}); "
                "load it with the base model and LoRA config it was saved from."
            )
        for key, param in params.items():
            if param.shape != weights[key].shape:
                raise EngineUserError(
                    f"checkpoint tensor {key} has shape {tuple(weights[key].shape)}, adapter expects "
                    f"{tuple(param.shape)}; use the same base model and LoRA rank."
                )
        host_transfer.copy_into(params, weights)

    @contextmanager
    def activated(self, name: str | None) -> Iterator[None]:
        """Runs the block with adapter ``name`` active, or the bare base model when ``name`` is None."""
        for experts in self._experts.values():
            experts.activate(name)
        if name not in self._in_peft:  # None, or an adapter on fused experts alone: peft's layers off
            if self._peft is not None and self._enabled:
                self._peft.base_model.disable_adapter_layers()
                self._enabled = False
        else:
            if not self._enabled:
                self._peft.base_model.enable_adapter_layers()
                self._enabled = True
            if self._active != name:
                self._peft.base_model.set_adapter(name)
                self._active = name
        yield


_ATTENTION_BLOCKS = ("self_attn", "self_attention", "attention", "attn")
_MLP_BLOCKS = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
_LORA_PARTS = frozenset({"base_layer", "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"})


def misadapted_projections(model: torch.nn.Module, spec: LoraSpec, name: str) -> tuple[list[str], list[str]]:
    """(the linears of the groups ``spec`` trains that adapter ``name`` leaves without LoRA, the linears of the
    groups it does not train that it adapts), by their path in the layer (``mlp.c_fc``), over each decoder layer's
    attention and MLP blocks: a family whose projection names :data:`ATTENTION_MODULES` / :data:`MLP_MODULES`
    lack, or share between its groups, would otherwise train in part, silently. An MoE's router and a shared
    expert's scalar gate (names ending in ``gate`` or ``router``) take none, as on hosted Tinker; fused experts are
    expert_lora.py's, not linears."""
    decoder = model.get_decoder()
    layers = next((child for child in decoder.children() if isinstance(child, torch.nn.ModuleList)), ())
    groups = ((_ATTENTION_BLOCKS, spec.train_attn), (_MLP_BLOCKS, spec.train_mlp))
    untrained: dict[str, None] = {}
    unasked: dict[str, None] = {}
    for layer in layers:
        for blocks, asked in groups:
            for block_name in blocks:
                block = getattr(layer, block_name, None)
                if not isinstance(block, torch.nn.Module):
                    continue
                for path, module in block.named_modules():
                    parts = path.split(".")
                    if _LORA_PARTS & set(parts) or parts[-1].endswith(("gate", "router")):
                        continue
                    lora_a = getattr(module, "lora_A", None)
                    if isinstance(lora_a, torch.nn.ModuleDict):
                        adapted = name in lora_a
                    elif type(module) is torch.nn.Linear or type(module).__name__ == "Conv1D":  # GPT-2's linears
                        adapted = False
                    else:
                        continue
                    if adapted != asked:
                        (untrained if asked else unasked)[f"{block_name}.{path}"] = None
    return list(untrained), list(unasked)


def _named_in(model: torch.nn.Module, targets: Any) -> bool:
    """Whether any module of ``model`` has one of the ``targets`` names (peft's match of a list of names)."""
    names = set(targets)
    return any(path.rpartition(".")[2] in names for path, _ in model.named_modules())


def _adaptable(experts: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    """The fused experts modules MLP LoRA adapts (expert_lora.py), or a clear error naming one it cannot."""
    for path, module in experts:
        reason = unsupported(module)
        if reason:
            raise EngineUserError(
                f"this base model's MLP experts ({path}, {type(module).__name__}) take no LoRA here: {reason}. "
                "Create the training client with LoraConfig(train_mlp=False) to train attention (and the "
                "unembedding) only."
            )
    return experts


@contextmanager
def peft_targets_as_named() -> Iterator[None]:
    """Keeps peft on transformers 5 from turning the MLP target names into LoRA on the fused experts' 3-D
    parameters (its conversion for adapters of transformers 4 MoE models, by model type): those are
    expert_lora.py's here, and the names then reach only the linears they name (a dense layer's or a shared
    expert's MLP). Also where a model of an MoE type has no fused experts at all: converted, the names would
    reach none of its dense MLPs (a DeepSeek-V3 whose layers are all dense)."""
    from peft.utils import transformers_weight_conversion as conversion

    convert = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = convert


# Set to False to run peft's own LoRA forward (bench/profiling comparisons).
FUSED_FORWARD = True


def _layout(spec: LoraSpec) -> tuple[int, bool, bool, bool]:
    """What decides an adapter's tensors: its rank and target layers (not the seed of its initial weights)."""
    return (spec.rank, spec.train_unembed, spec.train_mlp, spec.train_attn)


def install_fused_forward(model: torch.nn.Module) -> None:
    """Routes every peft LoRA linear of ``model`` through :func:`fused_lora_forward` (idempotent)."""
    from peft.tuners.lora import Linear as LoraLinear

    for module in model.modules():
        if isinstance(module, LoraLinear) and not getattr(module, "_localtinker_fused", False):
            peft_forward = module.forward
            module.forward = lambda x, *args, _m=module, _peft=peft_forward, **kwargs: fused_lora_forward(
                _m, _peft, x, *args, **kwargs
            )
            module._localtinker_fused = True


def fused_lora_forward(
    layer: Any, peft_forward: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """base(x) + (x Aᵀ)(s·B)ᵀ with the add inside one in-place ``addmm_``: the same function as peft's
    ``base(x) + B(A(x)) * s``, without its two elementwise passes over the (tokens × out) output in the
    forward and the scaling pass in the backward (on lm_head that output is tokens × 49152). Under
    autocast it uses peft's formula on the one base output; anything but the plain case (one active
    vanilla adapter, no dropout, not merged) takes peft's own path."""
    active = layer.active_adapters
    if not FUSED_FORWARD or args or kwargs or layer.disable_adapters or layer.merged or len(active) != 1:
        return peft_forward(x, *args, **kwargs)
    name = active[0]
    plain = name in layer.lora_A and name not in layer.lora_variant
    if not plain or not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return peft_forward(x, *args, **kwargs)
    rows = x.reshape(-1, x.shape[-1])
    merged = merged_output(layer, name, rows)  # a sampler adapter folded into its base weights
    if merged is not None:
        return merged.view(*x.shape[:-1], merged.shape[-1])
    lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    base = layer.base_layer(rows)
    if torch.is_autocast_enabled(rows.device.type):
        # Autocast decides each op's dtype: peft's formula, reusing the one base output.
        delta = torch.nn.functional.linear(torch.nn.functional.linear(rows.to(lora_a.dtype), lora_a), lora_b)
        return (base + (delta * layer.scaling[name]).to(base.dtype)).view(*x.shape[:-1], base.shape[-1])
    # The LoRA product runs in the base output's dtype: bf16 base weights that compute in bf16 take the
    # (float32 master) factors rounded to bf16, as autocast would; a float32 unembedding of a bf16
    # model (models.Float32Head) takes its bf16 input in float32. With autograd the factors are cast
    # per call, and autograd carries the gradients back to the float32 parameters through the casts;
    # without it the rounded factors are kept (:func:`_cast_factors`).
    compute = base.dtype
    if compute != lora_a.dtype and not torch.is_grad_enabled():
        factor_a, scaled_b_t = _cast_factors(layer, name, compute)
    else:
        factor_a, scaled_b_t = lora_a.to(compute), (lora_b * layer.scaling[name]).to(compute).t()
    # In place on the 2-D base output: a fresh tensor nothing else holds (its backward needs x and the
    # weight, not it), so no new [tokens × out] buffer and copy. Not through a view of a 3-D output:
    # autograd would then copy the whole gradient back (CopySlices) in the backward.
    base.addmm_(torch.nn.functional.linear(rows.to(compute), factor_a), scaled_b_t)
    return base.view(*x.shape[:-1], base.shape[-1])


_CAST = "_localtinker_cast_factors"  # on a peft LoRA linear: {adapter: (key, A, (s·B)ᵀ) in the compute dtype}


def _cast_factors(layer: Any, name: str, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A and (s·B)ᵀ of adapter ``name`` rounded to ``compute``, kept until the factors change.

    Without autograd (sampling, forward-only passes) the same rounded factors serve every call: per-call
    scaling and casts made an unmerged bf16 LoRA sampler much slower than the bare model. The key holds each factor's
    storage and version counter, which every in-place update (the optimizer, a checkpoint load) bumps.
    """
    lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    scaling = layer.scaling[name]
    key = (lora_a.data_ptr(), lora_a._version, lora_b.data_ptr(), lora_b._version, scaling, compute)
    cached = layer.__dict__.setdefault(_CAST, {}).get(name)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, lora_a.to(compute), (lora_b * scaling).to(compute).t())
        layer.__dict__[_CAST][name] = cached
    return cached[1], cached[2]
