"""Named presets: the datasets the cookbook's recipes use, each with its hub id and schema mapping.

A preset can be named by its short name ("no_robots") or its hub id ("HuggingFaceH4/no_robots").
`chat_mapper` lets a non-chat preset also serve as SFT data (gsm8k: question -> worked solution).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.datasets import mapping
from posttrain.datasets.mapping import Mapper
from posttrain.datasets.rows import BadRowError, require_string


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str
    hub_id: str
    mapper: Mapper
    config_name: str | None = None
    default_split: str = "train"
    chat_mapper: Mapper | None = None
    description: str = ""

    def mapper_for(self, kind: str) -> Mapper:
        if kind == self.kind:
            return self.mapper
        if kind == "chat" and self.chat_mapper is not None:
            return self.chat_mapper
        raise ValueError(
            f"preset {self.name!r} ({self.hub_id}) holds {self.kind} data and cannot be loaded as {kind}; "
            f"presets for {kind}: {', '.join(p.name for p in PRESETS.values() if kind in (p.kind, 'chat' if p.chat_mapper else None))}"
        )


def _gsm8k_chat(record: dict, where: str) -> dict:
    question = require_string(record, "question", where)
    solution = require_string(record, "answer", where)
    if "####" not in solution:
        raise BadRowError(where, "answer has no '#### <number>' final answer")
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": solution}]}


_PRESET_LIST = [
    Preset("no_robots", "chat", "HuggingFaceH4/no_robots", mapping.chat_from_columns({"messages": "messages"}),
           description="10k human-written instructions and answers (train/test)"),
    Preset("tulu3_sft", "chat", "allenai/tulu-3-sft-mixture", mapping.chat_from_columns({"messages": "messages"}),
           description="Tulu 3 SFT mixture (train only)"),
    Preset("hh_rlhf", "comparison", "Anthropic/hh-rlhf", mapping.hh_rlhf,
           description="Anthropic helpful/harmless transcripts; the cookbook's HHH comparisons"),
    Preset("hhh_alignment", "comparison", "HuggingFaceH4/hhh_alignment", mapping.hhh_alignment,
           config_name="harmless", default_split="test", description="BIG-bench HHH alignment (harmless/helpful/honest/other)"),
    Preset("ultrafeedback", "comparison", "HuggingFaceH4/ultrafeedback_binarized", mapping.ultrafeedback,
           default_split="train_prefs", description="UltraFeedback binarized (train_prefs/test_prefs)"),
    Preset("helpsteer3", "comparison", "nvidia/HelpSteer3", mapping.helpsteer3, config_name="preference",
           description="HelpSteer3 preference config; ties (overall_preference 0) are filtered"),
    Preset("gsm8k", "rl", "openai/gsm8k", mapping.gsm8k, config_name="main", chat_mapper=_gsm8k_chat,
           description="grade-school math; gold answer after '####'"),
    Preset("deepcoder", "code", "agentica-org/DeepCoder-Preview-Dataset", mapping.deepcoder, config_name="lcbv5",
           description="DeepCoder preview (configs lcbv5, primeintellect, taco, codeforces)"),
    Preset("livecodebench", "code", "livecodebench/code_generation_lite", mapping.livecodebench,
           default_split="test", description="LiveCodeBench code generation, public tests"),
]

PRESETS: dict[str, Preset] = {p.name: p for p in _PRESET_LIST}
_BY_HUB_ID = {p.hub_id: p for p in _PRESET_LIST}

ALIASES = {"hhh": "hh_rlhf", "tulu3": "tulu3_sft", "ultrafeedback_binarized": "ultrafeedback"}


def find_preset(source: str) -> Preset | None:
    """The preset named by a short name, alias or hub id; None for anything else (a path, another id)."""
    name = ALIASES.get(source, source)
    return PRESETS.get(name) or _BY_HUB_ID.get(source)
