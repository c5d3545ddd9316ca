"""Which renderer a base model was trained to read: the default of every recipe's ``renderer: auto``.

The rules follow tinker-cookbook's ``model_info.get_recommended_renderer_name`` by model family, as
patterns rather than a closed table so a new size or release of a known family needs no code change:
base (non-chat) checkpoints get ``role_colon``, Llama 3 chat models ``llama3``, Qwen3 ``qwen3`` (its
``-Instruct-2507`` releases ``qwen3_instruct``), DeepSeek V3 ``deepseekv3``, and families only
tml-renderers knows (Qwen3.5, gpt-oss, Kimi) its native renderer. SmolLM2 (the embedded model, and
localtinker's packaged models built on its tokenizer) keeps ``chatml``.

A base model named by a local path says nothing about its family; its tokenizer's control tokens do, so
:func:`renderer_for_tokenizer` reads them instead.
"""

from __future__ import annotations

import re
from typing import Any

AUTO = "auto"

# (pattern on the model id, renderer); first match wins, so base-model rules come before chat rules.
_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|/)smollm", "chatml"),
    (r"^localtinker/", "chatml"),
    (r"(^|/)qwen3\.5", "tml:qwen3_5"),
    (r"(^|/)qwen3-.*-base$", "role_colon"),
    (r"(^|/)qwen3-.*-instruct-\d{4}$", "qwen3_instruct"),
    (r"(^|/)qwen3-", "qwen3"),
    (r"(^|/)deepseek-v3[^/]*-base$", "role_colon"),
    (r"(^|/)deepseek-v3", "deepseekv3"),
    (r"(^|/)(meta-)?llama-3[^/]*-instruct$", "llama3"),
    (r"(^|/)(meta-)?llama-3", "role_colon"),
    (r"(^|/)gpt-oss-", "tml:gpt_oss_medium"),
    (r"(^|/)kimi-k2\.5", "tml:kimi_k25"),
    (r"(^|/)kimi-k2", "tml:kimi_k2"),
)

# Control tokens that only one chat format uses, most specific first.
_TOKEN_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<｜begin▁of▁sentence｜>", "<｜Assistant｜>"), "deepseekv3"),
    (("<|start_header_id|>", "<|eot_id|>"), "llama3"),
    (("<|im_start|>", "<think>"), "qwen3"),
    (("<|im_start|>", "<|im_end|>"), "chatml"),
)


def recommended_renderer(base_model: str) -> str | None:
    """The renderer recommended for `base_model` (a hub id such as ``Qwen/Qwen3-8B``), None when its family
    is not recognised by name."""
    name = base_model.strip().lower().split(":")[0]
    for pattern, renderer in _RULES:
        if re.search(pattern, name):
            return renderer
    return None


def renderer_for_tokenizer(tokenizer: Any) -> str | None:
    """The chat format whose control tokens `tokenizer` encodes as single tokens; None when none matches."""
    from posttrain.renderers.codec import as_codec

    codec = as_codec(tokenizer)
    for markers, renderer in _TOKEN_MARKERS:
        if all(len(codec.encode_template(marker)) == 1 for marker in markers):
            return renderer
    return None
