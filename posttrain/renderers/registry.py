"""``get_renderer(name, tokenizer, base_model=...)``: the one way to obtain a renderer by name.

``name="auto"`` (every recipe's default) picks the renderer recommended for the base model's family
(``posttrain.renderers.model_info``); any registered name overrides it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from posttrain.renderers.base import Renderer
from posttrain.renderers.chat_template import ChatTemplateRenderer
from posttrain.renderers.chatml import SMOLLM2_DEFAULT_SYSTEM_PROMPT, ChatMLRenderer
from posttrain.renderers.deepseek_v3 import DeepSeekV3Renderer, DeepSeekV3ThinkingRenderer
from posttrain.renderers.llama3 import Llama3Renderer
from posttrain.renderers.model_info import AUTO, recommended_renderer, renderer_for_tokenizer
from posttrain.renderers.qwen3 import Qwen3DisableThinkingRenderer, Qwen3InstructRenderer, Qwen3Renderer
from posttrain.renderers.role_colon import RoleColonRenderer
from posttrain.renderers.types import RendererError

TML_PREFIX = "tml:"
DEFAULT_RENDERER = AUTO  # the base model's recommended renderer (chatml for SmolLM2, the embedded model)

RENDERERS: dict[str, Callable[[Any], Renderer]] = {
    "role_colon": RoleColonRenderer,
    "llama3": Llama3Renderer,
    "chatml": ChatMLRenderer,
    "smollm2": partial(ChatMLRenderer, default_system_prompt=SMOLLM2_DEFAULT_SYSTEM_PROMPT),
    "qwen3": Qwen3Renderer,
    "qwen3_disable_thinking": Qwen3DisableThinkingRenderer,
    "qwen3_instruct": Qwen3InstructRenderer,
    "deepseekv3": DeepSeekV3Renderer,
    "deepseekv3_thinking": DeepSeekV3ThinkingRenderer,
    "chat_template": ChatTemplateRenderer,
}


def renderer_names(include_tml: bool = True) -> list[str]:
    names = sorted(RENDERERS)
    if include_tml:
        from posttrain.renderers.tml import tml_families

        names += [TML_PREFIX + family for family in tml_families()]
    return names


def resolve_renderer_name(name: str, base_model: str | None = None, tokenizer: Any = None) -> str:
    """``name`` itself, or for ``auto`` the renderer recommended for ``base_model`` (by family name, else by
    the control tokens of ``tokenizer``, else the tokenizer's own chat template: ``chat_template``); a clear
    error when none tells."""
    if name != AUTO:
        return name
    found = (recommended_renderer(base_model) if base_model else None) or (
        renderer_for_tokenizer(tokenizer) if tokenizer is not None else None
    ) or ("chat_template" if getattr(tokenizer, "chat_template", None) else None)
    if found is None:
        raise RendererError(
            f"renderer 'auto' cannot tell the chat format of base model {base_model or '(unnamed)'!r}; set renderer "
            f"to one of: {', '.join(renderer_names())}"
        )
    return found


def get_renderer(name: str, tokenizer: Any = None, *, base_model: str | None = None) -> Renderer:
    """The renderer ``name`` over ``tokenizer`` (an HF fast tokenizer or a tml-renderers tokenizer); its
    ``.name`` is the resolved name (never ``auto``), which is what a run should record.

    ``tml:<family>`` names (e.g. ``tml:kimi_k2``) bring their own tokenizer; ``tokenizer`` may be None.
    """
    name = resolve_renderer_name(name, base_model, tokenizer)
    if isinstance(name, str) and name.startswith(TML_PREFIX):
        from posttrain.renderers.tml import TmlRenderer, tml_families

        family = name[len(TML_PREFIX) :]
        if family not in tml_families():
            raise RendererError(f"unknown renderer {name!r}; known renderers: {', '.join(renderer_names())}")
        renderer = TmlRenderer(family)
    elif name in RENDERERS:
        if tokenizer is None:
            raise RendererError(f"renderer {name!r} needs a tokenizer (only tml:* renderers bring their own)")
        renderer = RENDERERS[name](tokenizer)
        renderer.name = name
    else:
        raise RendererError(f"unknown renderer {name!r}; known renderers: {', '.join(renderer_names())}")
    return renderer
