"""Makes the tokenizers of localtinker's packaged models loadable by their hub names, offline.

The tinker SDK's ``SamplingClient.get_tokenizer()`` and tinker-cookbook's ``get_tokenizer(model_name)``
call ``AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` by hub id, which fails on
a machine without hub access even though localtinker has the files. So when localtinker loads a base
model whose name is a hub id but whose files come from a local directory, it places the tokenizer files
in the Hugging Face cache as a snapshot of that id. It never touches an id the cache already knows
(a real download wins), and writes atomically so a concurrent reader sees all files or none.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)


def default_hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def register_tokenizer(hub_id: str, source_dir: Path, hub_cache: Path | None = None) -> Path | None:
    """Publishes ``source_dir``'s tokenizer files as the cached snapshot of ``hub_id``.

    Returns the snapshot directory, or None when ``hub_id`` is not a hub id or is already cached.
    """
    parts = hub_id.split("/")
    if len(parts) != 2 or not all(parts) or Path(hub_id).expanduser().exists():
        return None
    repo_dir = (hub_cache or default_hub_cache()) / f"models--{parts[0]}--{parts[1]}"
    if (repo_dir / "refs" / "main").exists():
        return None
    revision = hashlib.sha1(f"localtinker:{source_dir.resolve()}".encode()).hexdigest()
    snapshot = repo_dir / "snapshots" / revision
    try:
        (repo_dir / "snapshots").mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".localtinker-", dir=repo_dir / "snapshots"))
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_file():
                shutil.copy2(source_dir / name, staging / name)
        if snapshot.exists():  # another process published the same files first
            shutil.rmtree(staging)
        else:
            os.replace(staging, snapshot)
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(revision)
    except OSError as error:  # a read-only cache only costs the by-name convenience
        logger.warning("could not register %s's tokenizer in the HF cache: %s", hub_id, error)
        return None
    logger.info("registered %s's tokenizer in the HF cache (%s)", hub_id, snapshot)
    return snapshot
