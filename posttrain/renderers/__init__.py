"""Chat renderers: conversations <-> tokens, with tinker-cookbook's semantics.

    from posttrain.renderers import get_renderer, TrainOnWhat
    renderer = get_renderer("chatml", tokenizer)
    prompt = renderer.build_generation_prompt(messages)                 # tinker.ModelInput
    model_input, weights = renderer.build_supervised_example(messages)   # weights: float32 per token
    message, termination = renderer.parse_response(sampled_tokens)       # ParseTermination

Names: ``auto`` (the default: the renderer recommended for the base model, ``get_renderer("auto", tokenizer,
base_model=...)``, see model_info.py), role_colon, llama3, chatml (SmolLM2's format), smollm2 (chatml + SmolLM2's default
system prompt), qwen3, qwen3_disable_thinking, qwen3_instruct, deepseekv3, deepseekv3_thinking, and
``tml:<family>`` for tml-renderers' native renderers (``renderer_names()`` lists them all).
Datasets: ``posttrain.renderers.batch.render_supervised_batch``; datums: ``posttrain.renderers.datum``.
"""

from posttrain.renderers.base import RenderContext, RenderedMessage, Renderer
from posttrain.renderers.datum import SupervisedDatum, make_supervised_datum, reduce_weights
from posttrain.renderers.registry import DEFAULT_RENDERER, get_renderer, renderer_names, resolve_renderer_name
from posttrain.renderers.types import (
    Message,
    ParseTermination,
    RendererError,
    ToolCall,
    TrainOnWhat,
)

__all__ = [
    "DEFAULT_RENDERER",
    "Message",
    "ParseTermination",
    "RenderContext",
    "RenderedMessage",
    "Renderer",
    "RendererError",
    "SupervisedDatum",
    "ToolCall",
    "TrainOnWhat",
    "get_renderer",
    "make_supervised_datum",
    "reduce_weights",
    "renderer_names",
    "resolve_renderer_name",
]
