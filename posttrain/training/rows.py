"""Per-step rows (e.g. one per RL sample) committed by the training core, exactly once across resumes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from posttrain.checkpoints import read_jsonl, rewrite_jsonl


class JsonlRowSink:
    """Appends ``{"step": step, **row}`` lines, one fsync per step; ``truncate_from`` drops redone steps."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write_rows(self, step: int, rows: list[dict[str, Any]]) -> None:
        payload = "".join(json.dumps({"step": int(step), **row}) + "\n" for row in rows).encode()
        with open(self.path, "ab") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())

    def truncate_from(self, step: int) -> None:
        if self.path.exists():
            rewrite_jsonl(self.path, [row for row in self.read() if int(row["step"]) < step])

    def read(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)
