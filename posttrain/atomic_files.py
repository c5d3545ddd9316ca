"""Files that appear whole or not at all, even with several writers of one path.

Caches shared between runs (eval scores of a base model, DPO reference logprobs, a converted tokenizer) are
written by whichever concurrent run computes them first. Each writer stages into a temporary file of its
own beside the target and renames it into place: a reader sees the old file or a new one, never a torn one,
and two writers never truncate or move each other's staging file (a fixed ``<name>.tmp`` did both).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary path beside ``path``: renamed onto ``path`` if the block succeeds, deleted if not."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A unique name, created by the writer: the file gets the umask's permissions, as the target had before
    # (mkstemp would make every manifest and cache 0600, unreadable to a webserver running as another user).
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield staging
        os.replace(staging, target)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    with staged(path) as staging:
        staging.write_text(text)
