"""LoRA on a mixture-of-experts layer's fused experts (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss... in transformers 5).

transformers 5 keeps an MoE layer's experts as two 3-D parameters, ``gate_up_proj`` [experts, 2·inter, hidden]
(gate rows, then up rows) and ``down_proj`` [experts, hidden, inter], not as linears, so peft's linear LoRA
does not reach them. Some families lay them out otherwise (:class:`Layout`): gpt-oss keeps them transposed
([experts, hidden, 2·inter], [experts, inter, hidden]), gate and up interleaved (gate column i at 2i, up at
2i + 1), with a bias per expert and output, and gates its own way (a clamped SwiGLU, its ``_apply_gate``).

Here each adapter gives every expert its own LoRA on each of its three projections, gate,
up and down, with A [experts, r, in] and B [experts, out, r] — what Tinker trains on an MoE's experts, in the
3-D form its adapters carry them (peft_export.py). Each expert's rank is the adapter's divided by the number of
experts a token goes through (:func:`expert_rank`: the rule of Thinking Machines' "LoRA Without Regret"), with
the adapter's scaling alpha / rank: the LoRA a token meets in an MoE layer is then, summed over its experts,
one of the adapter's rank and scaling, and the experts' trainable share is the dense layers' (a rank-32 adapter
of Qwen3-30B-A3B, 8 of 128 experts per token: rank 4 per expert, ~0.2 B expert parameters instead of ~1.7 B).
tinker-cookbook's weight tools merge such adapters with that one scaling. The experts' forward adds each
expert's low-rank products on the tokens routed to it: gate and up as one product, A stacked [A_gate; A_up] and
B block-diagonal in the rows' order of ``gate_up_proj`` (:func:`gate_up_factors`; the form a peft adapter of
``gate_up_proj`` takes them in), the module's own gating (``_apply_gate``) after it.

Not peft's own wrapper for 3-D parameters: it folds s·B·A into a copy of every expert's weight at each forward
(a tensor the size of the parameter per call, for every expert whether tokens reach it or not), and it
requires all adapters of a model to target the same parameters (here one client may train the experts and
another not). lora.py keeps peft from converting the MLP target names into such wrappers.

The factors are float32 masters, as peft keeps the linears' (the products run in the weights' dtype). They are
not submodules of the model: an adapter's tensors reach the engine through :class:`ExpertAdapters` (lora.py's
``AdapterHost.parameters``), and walks over the model's modules (peft's, merged_lora's) do not see them.
Without an active adapter the experts run transformers' own forward.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from localtinker.engine.device import has_native_bf16

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # in the order the experts modules register them
PROJECTIONS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}  # adapted -> holder
_FORWARDS = (["hidden_states", "top_k_index", "top_k_weights"], ["hidden_states", "router_indices", "routing_weights"])
_FLAGS = {"has_gate": (True, "no gate"), "has_post_expert_norm": (False, "a norm after each expert")}
_KEPT = "_localtinker_expert_adapters"  # on an experts module: its ExpertAdapters


class Layout(NamedTuple):
    """How an experts module keeps its weights (transformers' flags on its experts classes)."""

    transposed: bool  # [E, in, out] rather than [E, out, in]
    interleaved: bool  # gate and up alternate along gate_up's output (gate i at 2i, up i at 2i + 1)
    biased: bool  # gate_up_proj_bias [E, 2·inter] and down_proj_bias [E, hidden]

    @classmethod
    def of(cls, module: torch.nn.Module) -> Layout:
        return cls(bool(getattr(module, "is_transposed", False)), not getattr(module, "is_concatenated", True),
                   bool(getattr(module, "has_bias", False)))

    def features(self, weight: torch.Tensor) -> tuple[int, int]:
        """(in, out) features of a 3-D expert weight."""
        return (weight.shape[1], weight.shape[2]) if self.transposed else (weight.shape[2], weight.shape[1])


def fused_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every module of ``model`` that holds 3-D (fused expert) parameters itself; a
    convolution's 3-D weight (Qwen3-Next's short convolutions) is not one."""
    return [(path, module) for path, module in model.named_modules()
            if not isinstance(module, torch.nn.modules.conv._ConvNd)
            and any(p.dim() == 3 for p in module.parameters(recurse=False))]


def unsupported(module: torch.nn.Module) -> str | None:
    """Why this experts module is not a layout :class:`ExpertAdapters` adapts, or None when it is."""
    layout = Layout.of(module)
    names = [name for name, _ in module.named_parameters(recurse=False)]
    wanted = list(EXPERT_PARAMETERS)
    if layout.biased:  # each weight's bias registered after it
        wanted = ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]
    if names != wanted:
        return f"its parameters are {names}, not {wanted}"
    for flag, (value, what) in _FLAGS.items():
        if getattr(module, flag, value) != value:
            return f"it has {what}"
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not 3-D per expert"
    (hidden, double), (inter, out) = layout.features(gate_up), layout.features(down)
    if double != 2 * inter or out != hidden:
        shapes = "[E, H, 2I] and [E, I, H]" if layout.transposed else "[E, 2I, H] and [E, H, I]"
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not {shapes}"
    if layout.biased and (tuple(module.gate_up_proj_bias.shape) != (gate_up.shape[0], double)
                          or tuple(module.down_proj_bias.shape) != (gate_up.shape[0], hidden)):
        return (f"its biases {tuple(module.gate_up_proj_bias.shape)}, {tuple(module.down_proj_bias.shape)} are not "
                "[E, 2I], [E, H]")
    forward = inspect.signature(type(module).forward)  # through functools.wraps to the class's own forward
    if list(forward.parameters)[1:] not in _FORWARDS:
        return f"its forward takes {list(forward.parameters)[1:]}, not (hidden states, expert ids, their weights)"
    if not callable(getattr(module, "_apply_gate", None)):
        return "it has no _apply_gate (transformers' gating of the gate/up product)"
    return None


def expert_rank(rank: int, config: object) -> int:
    """Each expert's LoRA rank for an adapter of ``rank``: divided by the experts per token (at least 1)."""
    per_token = int(getattr(config, "num_experts_per_tok", None) or 1)
    return max(1, rank // per_token)


def adapters_of(module: torch.nn.Module) -> ExpertAdapters:
    """The :class:`ExpertAdapters` of an experts module, installed on first use."""
    kept = module.__dict__.get(_KEPT)
    if kept is None:
        kept = module.__dict__[_KEPT] = ExpertAdapters(module)
    return kept


class ExpertAdapters:
    """Every adapter's factors on one experts module, and which adapter its forward applies."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.layout = Layout.of(module)
        self.factors: dict[str, dict[str, torch.nn.Parameter]] = {}  # adapter -> {"gate_proj.lora_A": [E, r, H], ...}
        self.scaling: dict[str, float] = {}
        self.active: str | None = None
        self._cast: dict[str, tuple] = {}  # adapter -> (key, {parameter: (A, (s·B)ᵀ)}) rounded, without autograd
        module.forward = self.forward  # the instance's: nn.Module.__call__ looks it up there first

    def add(self, name: str, rank: int, scaling: float) -> None:
        """A fresh adapter: A uniform in ±1/√in (peft's default for its linears' A), B zero (a no-op until
        trained). Draws from torch's global generator, which the caller seeds."""
        factors = {}
        for projection, holder in PROJECTIONS.items():
            weight = getattr(self.module, holder)
            experts = weight.shape[0]
            in_features, out_features = self.layout.features(weight)
            if holder == "gate_up_proj":
                out_features //= 2
            bound = 1 / math.sqrt(in_features)
            a = torch.empty((experts, rank, in_features), dtype=torch.float32).uniform_(-bound, bound)
            b = torch.zeros((experts, out_features, rank), dtype=torch.float32)
            factors[f"{projection}.lora_A"] = torch.nn.Parameter(a.to(weight.device))
            factors[f"{projection}.lora_B"] = torch.nn.Parameter(b.to(weight.device))
        self.factors[name] = factors
        self.scaling[name] = scaling

    def delete(self, name: str) -> None:
        self.factors.pop(name, None)
        self.scaling.pop(name, None)
        self._cast.pop(name, None)
        if self.active == name:
            self.active = None

    def activate(self, name: str | None) -> None:
        self.active = name if name in self.factors else None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts' output for each token: Σ over its top-k experts of weight × expert(x), each of the
        expert's two products with its bias (where the layout has them) and the active adapter's low-rank terms
        added, the module's own gating between them. The (token, choice) pairs are sorted by expert
        (:class:`_Groups`); a choice of an expert id past the last (expert parallelism's sentinel) contributes
        nothing."""
        name = self.active
        module = self.module
        if name is None:
            return type(module).forward(module, hidden_states, top_k_index, top_k_weights)
        tokens, top_k = top_k_index.shape
        layout = self.layout
        groups = _Groups(top_k_index.reshape(-1), module.gate_up_proj.shape[0], layout.transposed)
        factors = self._factors(name, hidden_states)
        biases = (module.gate_up_proj_bias, module.down_proj_bias) if layout.biased else (None, None)
        x = hidden_states[groups.order // top_k]
        gate_up = groups.product(x, module.gate_up_proj, *factors["gate_up_proj"], biases[0])
        out = groups.product(module._apply_gate(gate_up), module.down_proj, *factors["down_proj"], biases[1])
        out = out * top_k_weights.reshape(-1)[groups.order, None].to(out.dtype)
        by_choice = out.new_zeros(out.shape).index_copy(0, groups.order, out)
        return by_choice.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _factors(self, name: str, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per parameter (A, (s·B)ᵀ) as the products take them. Under autocast, from the float32 masters
        (autocast rounds each product's operands); otherwise rounded to the weights' dtype, per call with
        autograd (the gradients reach the float32 masters through the casts), kept until the factors change
        without it."""
        factors, scaling = self.factors[name], self.scaling[name]
        compute = None if torch.is_autocast_enabled(x.device.type) else self.module.gate_up_proj.dtype
        interleaved = self.layout.interleaved
        if compute is None or torch.is_grad_enabled():
            return _product_factors(factors, scaling, compute, interleaved)
        key = (compute, scaling, *((t.data_ptr(), t._version) for t in factors.values()))
        cached = self._cast.get(name)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self._cast[name] = (key, _product_factors(factors, scaling, compute, interleaved))
        return cached[1]


def gate_up_factors(factors: dict[str, torch.Tensor], interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up LoRAs (ranks r and r') as one LoRA of rank r + r' on ``gate_up_proj``: A [E, r + r', H]
    stacked gate then up, B [E, 2I, r + r'] block-diagonal (gate rows take the gate's rank, up rows the up's),
    its rows in ``gate_up_proj``'s output order: gate then up, or alternating where ``interleaved``."""
    b_gate, b_up = factors["gate_proj.lora_B"], factors["up_proj.lora_B"]
    a = torch.cat((factors["gate_proj.lora_A"], factors["up_proj.lora_A"]), dim=1)
    experts, inter = b_gate.shape[:2]
    gate_rows = torch.cat((b_gate, b_gate.new_zeros((experts, inter, b_up.shape[2]))), dim=2)
    up_rows = torch.cat((b_up.new_zeros((experts, inter, b_gate.shape[2])), b_up), dim=2)
    if interleaved:
        return a, torch.stack((gate_rows, up_rows), dim=2).reshape(experts, 2 * inter, -1)
    return a, torch.cat((gate_rows, up_rows), dim=1)


def parameter_factors(factors: dict[str, torch.Tensor],
                      interleaved: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{fused parameter: (A, B)} of an adapter's per-projection expert factors: ``gate_up_proj`` takes the gate
    and up LoRAs as one (:func:`gate_up_factors`), ``down_proj`` the down LoRA."""
    return {"gate_up_proj": gate_up_factors(factors, interleaved),
            "down_proj": (factors["down_proj.lora_A"], factors["down_proj.lora_B"])}


def _product_factors(factors: dict[str, torch.Tensor], scaling: float, compute: torch.dtype | None,
                     interleaved: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{parameter: (A, (s·B)ᵀ)}, in ``compute`` (None: as they are), the rank padded with zeros to 16 bytes of
    the product's rows (what grouped GEMMs take: a rank-4 LoRA in bf16 has 8)."""
    out = {}
    for parameter, (a, b) in parameter_factors(factors, interleaved).items():
        a, b_t = a.to(compute or a.dtype), (b * scaling).transpose(1, 2).to(compute or b.dtype)
        pad = -a.shape[1] % max(1, 16 // a.element_size())
        if pad:
            a = torch.cat((a, a.new_zeros((a.shape[0], pad, a.shape[2]))), dim=1)
            b_t = torch.cat((b_t, b_t.new_zeros((b_t.shape[0], pad, b_t.shape[2]))), dim=1)
        out[parameter] = (a, b_t.contiguous())
    return out


GROUPED = True  # False: every product expert by expert (the path taken where grouped GEMMs are not)
_grouped_failed: set[str] = set()  # device types where a grouped GEMM raised: the loop from then on


class _Groups:
    """The (token, choice) pairs of one forward sorted by expert, and the products over them.

    A product is one grouped GEMM per term (``F.grouped_mm``: the base product, x Aᵀ and (x Aᵀ)(s·B)ᵀ, three
    kernels for all experts, no host sync) where :func:`grouped_possible` and every operand's rows are 16-byte
    aligned, as its kernels require (the factors' rank is padded for that); otherwise expert by expert, with one
    host sync for the group sizes. The kernel leaves the rows past the last group (sentinels) unwritten, in its
    output and in its input's gradient: both are masked."""

    def __init__(self, expert_ids: torch.Tensor, experts: int, transposed: bool = False) -> None:
        sorted_ids, self.order = torch.sort(expert_ids, stable=True)
        # histc ignores ids past its range (the sentinels) and, unlike bincount, does not sync to size its output
        self.sizes = torch.histc(sorted_ids.float(), bins=experts, min=0, max=experts - 1)
        self.offsets = self.sizes.cumsum(0).to(torch.int32)
        self.valid = (sorted_ids < experts).unsqueeze(-1)
        self.row_experts = sorted_ids.clamp(max=experts - 1)  # (a sentinel's bias row is masked with it)
        self.transposed = transposed
        self._counts: list[int] | None = None

    def product(self, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, scaled_b_t: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x Wₑᵀ + bₑ + (x Aₑᵀ)(s·Bₑ)ᵀ`` for each row's expert e (``x Wₑ`` where the weights are transposed);
        sentinel rows zero."""
        weight_t = weight if self.transposed else weight.transpose(1, 2)  # [E, in, out], as grouped_mm takes it
        operands = (x, weight_t, a.transpose(1, 2), scaled_b_t)
        if _groupable(x.device, operands, a.shape[1] * a.element_size()):
            try:
                x = x.masked_fill(~self.valid, 0)
                out = F.grouped_mm(x, operands[1], offs=self.offsets)
                low = F.grouped_mm(x, operands[2], offs=self.offsets)
                out = out + F.grouped_mm(low, scaled_b_t, offs=self.offsets)
                if bias is not None:
                    out = out + bias.index_select(0, self.row_experts)
                return out.masked_fill(~self.valid, 0)
            except RuntimeError as error:  # a kernel this torch or device lacks: expert by expert from now on
                _grouped_failed.add(x.device.type)
                warnings.warn(f"MoE expert LoRA: grouped GEMMs failed on {x.device.type} ({error}); "
                              "computing the experts one by one", stacklevel=2)
        return self._looped(x, operands[1], a, scaled_b_t, bias)

    def _looped(self, x: torch.Tensor, weight_t: torch.Tensor, a: torch.Tensor, scaled_b_t: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        if self._counts is None:
            self._counts = [int(n) for n in self.sizes.tolist()]
        pieces, start = [], 0
        for expert, count in enumerate(self._counts):
            if count:
                rows = x[start : start + count]
                base = rows @ weight_t[expert] if bias is None else torch.addmm(bias[expert], rows, weight_t[expert])
                pieces.append(torch.addmm(base, F.linear(rows, a[expert]), scaled_b_t[expert]))
                start += count
        if start < x.shape[0] or not pieces:
            pieces.append(x.new_zeros((x.shape[0] - start, weight_t.shape[2])))
        return torch.cat(pieces)


def grouped_possible(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether expert products in ``dtype`` may run as grouped GEMMs on ``device``: torch has them, the CPU or a
    CUDA card with bf16 tensor cores (sm80 on, device.py) in a half dtype (the dtypes its grouped kernels are known
    for), none failed here."""
    if not GROUPED or device.type in _grouped_failed or not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype in (torch.bfloat16, torch.float16) and has_native_bf16(device)
    return device.type == "cpu"


def _groupable(device: torch.device, operands: tuple[torch.Tensor, ...], rank_bytes: int) -> bool:
    """Whether :class:`_Groups` may run a product as grouped GEMMs on ``device`` (see there)."""
    if not grouped_possible(device, operands[0].dtype) or torch.is_autocast_enabled(device.type) or rank_bytes % 16:
        return False  # (grouped GEMMs take no autocast: the operands' own dtypes)
    return all(t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0
                                              for stride, size in zip(t.stride(), t.shape) if stride != 1 and size > 1)
               for t in operands)
