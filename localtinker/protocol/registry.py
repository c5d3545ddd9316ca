"""What the protocol layer remembers about sessions, training runs and samplers.

Training-run metadata (base model, LoRA rank, user metadata) is written to
``<storage>/protocol/training_runs/`` so that run listings and ``weights_info`` still answer for
``tinker://`` paths after a restart; the weights themselves are the engine's business.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from localtinker.engine.api import ModelInfo

logger = logging.getLogger("localtinker.protocol")


TRACE_EVENTS_PER_SESSION = 20_000  # the newest requests a session trace shows


@dataclass(frozen=True)
class TraceEvent:
    """One request of a session: what, on which model or sampler, from submission to completion."""

    name: str
    track: str  # model id or sampler id
    start: float
    end: float
    ok: bool


@dataclass
class SessionRecord:
    session_id: str
    created_at: float
    last_heartbeat: float
    finished: str | None = None  # the client's finish reason: success | errored | interrupted, or expired
    # when the session was last heard from (monotonic: a suspended machine's sleep does not count as silence)
    last_seen: float = field(default_factory=time.monotonic)
    user_metadata: dict[str, str] = field(default_factory=dict)
    display_name: str | None = None
    events: deque[TraceEvent] = field(default_factory=lambda: deque(maxlen=TRACE_EVENTS_PER_SESSION))
    trace_dropped: bool = False  # its events were dropped to bound memory (ServiceCore.finish_session)


@dataclass
class RunRecord:
    """A training run (= training model id) and what the SDK asks about it."""

    training_run_id: str
    base_model: str
    lora_rank: int
    created_at: float
    last_request_time: float
    user_metadata: dict[str, str] = field(default_factory=dict)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


@dataclass
class ModelRecord:
    model_id: str
    create_request_id: str
    run: RunRecord
    info: ModelInfo | None = None  # set once the engine created the model


@dataclass
class SamplerRecord:
    sampler_id: str
    base_model: str
    model_path: str | None


class Registry:
    def __init__(self, storage_dir: Path | None) -> None:
        self._lock = threading.Lock()
        self.sessions: dict[str, SessionRecord] = {}
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, SamplerRecord] = {}
        self.runs: dict[str, RunRecord] = {}
        self._runs_dir = Path(storage_dir) / "protocol" / "training_runs" if storage_dir else None
        self._load_runs()

    # sessions ----------------------------------------------------------------------------------
    def new_session(self, user_metadata: dict[str, str] | None = None, display_name: str | None = None) -> SessionRecord:
        now = time.time()
        record = SessionRecord(str(uuid.uuid4()), now, now, user_metadata=user_metadata or {}, display_name=display_name)
        with self._lock:
            self.sessions[record.session_id] = record
        return record

    def session(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            return self.sessions.get(session_id)

    def all_sessions(self) -> list[SessionRecord]:
        """Newest first."""
        with self._lock:
            return sorted(self.sessions.values(), key=lambda s: (s.created_at, s.session_id), reverse=True)

    def record_event(self, session_id: str, event: TraceEvent) -> None:
        with self._lock:
            session = self.sessions.get(session_id)
            if session is not None:
                session.events.append(event)

    def session_runs(self, session_id: str) -> list[str]:
        prefix = f"{session_id}:train:"
        with self._lock:
            return sorted(k for k in {*self.runs, *self.models} if k.startswith(prefix))

    def session_models(self, session_id: str) -> list[str]:
        """The session's training models still registered (not its past runs)."""
        prefix = f"{session_id}:train:"
        with self._lock:
            return sorted(k for k in self.models if k.startswith(prefix))

    def silent_sessions(self, timeout_s: float) -> list[SessionRecord]:
        """Sessions not finished and not heard from for longer than ``timeout_s``."""
        now = time.monotonic()
        with self._lock:
            return [s for s in self.sessions.values() if s.finished is None and now - s.last_seen > timeout_s]

    def session_samplers(self, session_id: str) -> list[str]:
        prefix = f"{session_id}:sample:"
        with self._lock:
            return sorted(k for k in self.samplers if k.startswith(prefix))

    # training models and runs ---------------------------------------------------------------------
    def add_model(self, record: ModelRecord) -> ModelRecord:
        """Registers ``record`` unless the model id exists; returns the registered record."""
        with self._lock:
            return self.models.setdefault(record.model_id, record)

    def model(self, model_id: str) -> ModelRecord | None:
        with self._lock:
            return self.models.get(model_id)

    def drop_model(self, model_id: str) -> None:
        with self._lock:
            self.models.pop(model_id, None)

    def model_created(self, model_id: str, info: ModelInfo) -> None:
        with self._lock:
            record = self.models.get(model_id)
            if record is None:
                return
            record.info = info
            record.run.base_model = info.base_model
            record.run.lora_rank = info.lora_rank
            self.runs[model_id] = record.run
        self._save_run(record.run)

    def touch(self, model_id: str) -> None:
        with self._lock:
            record = self.models.get(model_id)
            if record is not None:
                record.run.last_request_time = time.time()

    def run(self, run_id: str) -> RunRecord | None:
        with self._lock:
            return self.runs.get(run_id)

    def all_runs(self) -> list[RunRecord]:
        with self._lock:
            return sorted(self.runs.values(), key=lambda r: r.created_at, reverse=True)

    # samplers ----------------------------------------------------------------------------------
    def add_sampler(self, record: SamplerRecord) -> None:
        with self._lock:
            self.samplers[record.sampler_id] = record

    def sampler(self, sampler_id: str) -> SamplerRecord | None:
        with self._lock:
            return self.samplers.get(sampler_id)

    # persistence ---------------------------------------------------------------------------------
    def _save_run(self, run: RunRecord) -> None:
        if self._runs_dir is None:
            return
        try:
            self._runs_dir.mkdir(parents=True, exist_ok=True)
            target = self._runs_dir / f"{quote(run.training_run_id, safe='')}.json"
            fd, tmp = tempfile.mkstemp(dir=self._runs_dir, prefix=".run.")
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(run), f)
            os.replace(tmp, target)
        except OSError as e:
            logger.warning("could not record training run %s under %s: %s", run.training_run_id, self._runs_dir, e)

    def _load_runs(self) -> None:
        if self._runs_dir is None or not self._runs_dir.is_dir():
            return
        for path in self._runs_dir.glob("*.json"):
            try:
                data: dict[str, Any] = json.loads(path.read_text())
                run = RunRecord(**data)
            except (OSError, ValueError, TypeError) as e:
                logger.warning("ignoring unreadable training run record %s: %s", path, e)
                continue
            self.runs[run.training_run_id] = run
