"""What a model's ``ForCausalLM.forward`` does between its decoder's last hidden state and the logits, made the
engine's too, and checked once per base model at load.

The engine never calls ``ForCausalLM.forward``: it unembeds only the positions it needs, in chunks, through
heads of its own (CPU, portable, static decode). Whatever that forward does beyond ``lm_head(hidden)`` is
therefore the engine's to apply, and a transform it does not know would make every logprob, every sample and
every gradient those of another distribution than the model's, silently. Two kinds are known:

- Gemma's final soft cap, ``cap·tanh(logits / cap)``, which every engine head applies (families.final_softcap);
- a constant multiplier (:data:`MULTIPLIERS`): Granite and MiniCPM3 divide by ``logits_scaling``, HyperCLOVA X
  multiplies by it, Cohere by ``logit_scale``, Falcon-H1 by ``lm_head_multiplier``. It is folded into the
  decoder's final norm (its weight, and bias where it has one) at load, and the model's own attribute set to 1,
  so every head the engine runs, and ``ForCausalLM.forward`` itself, compute the model's logits with nothing
  else to apply. The norm is linear in its weight, so a LoRA on the unembedding trains and exports exactly as
  against the model on disk (the fold is in memory only; exports load the base from disk).

:func:`check_output_head` then compares the engine's head with ``ForCausalLM.forward`` on a probe of a few
tokens: any other transform, in a family no one has looked at yet, refuses the model with the reason instead of
training it wrong. In bf16, the fold rounds the norm's weight times the multiplier to bf16 (exact for the powers
of two most of these models use): a change of the logits of the size of bf16's own rounding of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localtinker.engine.api import EngineUserError
from localtinker.engine.families import architecture, final_softcap, text_config

PROBE_TOKENS = 8
RELATIVE_TOLERANCE = 2.0**-6  # of the largest logit: several bf16 roundings, far below any multiplier's effect
_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")


@dataclass(frozen=True)
class Multiplier:
    """Where a family's ``ForCausalLM.forward`` reads its logit factor (an attribute of the config, the causal LM
    or its decoder, all of which are set to 1 once folded), and whether it divides the logits by it. A factor
    the config computes (MiniCPM3's ``hidden_size / dim_model_base``) is set to 1 through ``through``: (the
    config attribute to set, the one whose value it takes)."""

    attribute: str
    divides: bool = False
    through: tuple[str, str] | None = None


MULTIPLIERS: dict[str, Multiplier] = {
    **{family: Multiplier("logits_scaling", divides=True) for family in (
        "granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa", "granitemoe_swa")},
    "minicpm3": Multiplier("logits_scaling", divides=True, through=("dim_model_base", "hidden_size")),
    "hyperclovax": Multiplier("logits_scaling"),
    **{family: Multiplier("logit_scale") for family in ("cohere", "cohere2", "cohere2_moe")},
    "falcon_h1": Multiplier("lm_head_multiplier"),
}


def logit_multiplier(model: torch.nn.Module) -> float:
    """The factor ``ForCausalLM.forward`` applies to ``lm_head(hidden)`` (1.0 for most families)."""
    multiplier = MULTIPLIERS.get(architecture(model.config))
    if multiplier is None:
        return 1.0
    value = None
    for owner in _owners(model):
        value = getattr(owner, multiplier.attribute, None)
        if value is not None:
            break
    if value is None:
        return 1.0
    value = float(value)
    return 1.0 / value if multiplier.divides else value


def fold_logit_multiplier(model: torch.nn.Module) -> float:
    """Folds :func:`logit_multiplier` into the decoder's final norm and sets the model's own factor to 1;
    returns the factor folded (1.0: nothing to do). Raises :class:`EngineUserError` where the final norm has no
    weight to carry it."""
    factor = logit_multiplier(model)
    if factor == 1.0:
        return factor
    norm = final_norm(model)
    if norm is None or getattr(norm, "weight", None) is None:
        raise EngineUserError(
            f"this {architecture(model.config)!r} model scales its logits by {factor:g}, which localtinker folds "
            "into the decoder's final norm, but its decoder has no final norm with a weight; it cannot be served.")
    with torch.no_grad():
        norm.weight.mul_(factor)
        if getattr(norm, "bias", None) is not None:
            norm.bias.mul_(factor)
    multiplier = MULTIPLIERS[architecture(model.config)]
    if multiplier.through is not None:
        target, source = multiplier.through
        setattr(text_config(model.config), target, getattr(text_config(model.config), source))
    else:
        for owner in _owners(model):
            if getattr(owner, multiplier.attribute, None) is not None:
                setattr(owner, multiplier.attribute, 1.0)
    if logit_multiplier(model) != 1.0:
        raise RuntimeError(f"{multiplier} was folded but the model still reads {logit_multiplier(model)}")
    return factor


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder's last norm, the one before the unembedding (None when it has none of the usual names)."""
    decoder = model.get_decoder()
    for name in _NORM_NAMES:
        module = getattr(decoder, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def check_output_head(name: str, model: torch.nn.Module) -> None:
    """Refuses (:class:`EngineUserError`) a model whose ``ForCausalLM.forward`` gives other logits than the
    engine's head, ``lm_head`` of the decoder's last hidden state and the final soft cap, on a probe of
    :data:`PROBE_TOKENS` tokens spread over the vocabulary. Two forwards of a few tokens: milliseconds on the
    CPU for the default model, a fraction of a second for an 8B model."""
    if model.get_decoder() is model:
        raise EngineUserError(
            f"base model {name!r} ({architecture(model.config)}): {type(model).__name__}.get_decoder() returns the "
            "causal LM itself, so localtinker cannot run its decoder apart from its head; nothing was loaded.")
    vocab = int(getattr(text_config(model.config), "vocab_size", None) or model.config.vocab_size)
    device = model.get_output_embeddings().weight.device
    probe = (torch.arange(1, PROBE_TOKENS + 1, device=device) * (vocab // (PROBE_TOKENS + 1)))[None]
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=probe, use_cache=False).last_hidden_state
        ours = model.get_output_embeddings()(hidden).float()
        cap = final_softcap(model.config)
        if cap:
            ours = torch.tanh(ours / cap) * cap
        theirs = model(input_ids=probe, use_cache=False).logits.float()
    if ours.shape == theirs.shape:
        difference = float((ours - theirs).abs().max())
        if difference <= 1e-4 + RELATIVE_TOLERANCE * float(theirs.abs().max()):
            return
        what = f"differ by up to {difference:.3g} (largest logit {float(theirs.abs().max()):.3g})"
    else:
        what = f"have shape {tuple(theirs.shape)}, not {tuple(ours.shape)}"
    raise EngineUserError(
        f"base model {name!r} ({architecture(model.config)}, {type(model).__name__}) turns its last hidden state "
        f"into logits in a way localtinker does not reproduce: on a probe of {PROBE_TOKENS} tokens its own forward's "
        f"logits and lm_head's (after any final soft cap) {what}. Training or sampling it here would use another "
        "distribution than the model's, so nothing was loaded. Families checked against their own forward are "
        "listed in docs/localtinker-gpu.md (\"Models brought from the hub\").")


def _owners(model: torch.nn.Module) -> list[object]:
    """Where a family keeps its logit factor: its config (and text config), the causal LM, its decoder."""
    owners: list[object] = [model.config, text_config(model.config), model, model.get_decoder()]
    return list({id(owner): owner for owner in owners}.values())
