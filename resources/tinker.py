"""The Tinker resource: every asset reaches Tinker through this, and gets a real ``tinker.ServiceClient``.

There is one code path (ARCHITECTURE §1): the hosted service and the embedded localtinker server
both speak the tinker SDK's HTTP protocol, so the resource only decides *which endpoint* the SDK
talks to:

- ``remote``: the hosted service (or any server at ``base_url``) with ``api_key``, which comes from
  ``dg.EnvVar("TINKER_API_KEY")`` so the key never lands in run config, logs or metadata.
- ``local``: an existing localtinker at ``base_url``, or, when none is given, an embedded localtinker
  started once per process on loopback with a random per-process key, keeping checkpoints under
  ``storage_dir`` so ``tinker://`` paths outlive the process (evaluation runs are separate processes).
- ``auto`` (default): ``remote`` when an API key is configured, else ``local``.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import tinker
from pydantic import Field, PrivateAttr

from posttrain.training.config import DEFAULT_BASE_MODEL
from resources.state import default_tinker_storage_dir

BACKENDS = ("auto", "local", "remote")
# localtinker accepts any key when started without one; the SDK still insists on the ``tml-`` prefix.
EXISTING_LOCAL_SERVER_KEY = "tml-local"


@dataclass(frozen=True)
class TinkerEndpoint:
    """Where the SDK connects. ``api_key`` is a secret: use :meth:`describe` for anything shown."""

    backend: str  # "local" | "remote"
    base_url: str | None  # None = the SDK's default (hosted Tinker)
    api_key: str | None
    embedded: bool
    # an embedded localtinker's device ("cpu", "cuda:0 = <card>, sm90") and weights' dtype: what a run trained on
    local_device: str | None = None
    local_dtype: str | None = None

    def describe(self) -> dict[str, str]:
        described = {
            "tinker_backend": self.backend,
            "tinker_base_url": self.base_url or "hosted Tinker (SDK default)",
            "tinker_embedded": str(self.embedded).lower(),
        }
        if self.local_device:
            described.update(tinker_local_device=self.local_device, tinker_local_dtype=self.local_dtype or "")
        return described


@dataclass(frozen=True)
class BaseModelSource:
    name: str
    location: str  # a local directory, "hub:<id>", or "hosted Tinker"
    weights_dir: str | None
    digest: str  # sha256 hex


def directory_digest(directory: Path) -> str:
    """sha256 over (relative name, content) of every file; memoised by (name, size, mtime) per file."""
    cache_path = directory / ".posttrain-digest.json"
    files = sorted(path for path in directory.rglob("*") if path.is_file() and not path.name.startswith("."))
    stamp = [[str(path.relative_to(directory)), path.stat().st_size, path.stat().st_mtime_ns] for path in files]
    try:
        cached = json.loads(cache_path.read_text())
        if cached["stamp"] == stamp:
            return cached["digest"]
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    result = digest.hexdigest()
    try:
        cache_path.write_text(json.dumps({"stamp": stamp, "digest": result}))
    except OSError:  # read-only model directory: recompute next time
        pass
    return result


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class _EmbeddedServers:
    """One in-process localtinker per (storage dir, dtype, device) for the life of the process.

    Model weights take seconds to load, so every asset of a run shares the server; ``atexit``
    stops them so worker threads do not outlive the interpreter's shutdown.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: dict[tuple[str, str, str], tuple[Any, str]] = {}

    def get(self, storage_dir: Path, dtype: str, device: str = "auto") -> tuple[str, str, str, str]:
        """(base URL, API key, device described, dtype) of the server for these settings, started on first use."""
        key = (str(storage_dir), dtype, device)
        with self._lock:
            if key not in self._servers:
                from localtinker.server import start_server  # heavy (torch); only when embedded

                api_key = f"tml-{secrets.token_hex(16)}"
                storage_dir.mkdir(parents=True, exist_ok=True)
                server = start_server(storage_dir=storage_dir, dtype=dtype, device=device, api_key=api_key,
                                      host="127.0.0.1", port=0)
                self._servers[key] = (server, api_key)
            server, api_key = self._servers[key]
            return server.base_url, api_key, *_engine_described(server.engine)

    def stop_all(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server, _ in servers:
            server.stop()


def _engine_described(engine: Any) -> tuple[str, str]:
    """(device, dtype) of an embedded engine: ``cuda:0 = <card>, sm90[, without ...]`` on a GPU (the card's name
    and what it lacks, localtinker.engine.device), ``cpu`` on the CPU."""
    from localtinker.engine.device import describe_device

    device = getattr(engine, "device", None)
    return (describe_device(device), str(getattr(engine, "dtype", ""))) if device is not None else ("", "")


EMBEDDED_SERVERS = _EmbeddedServers()
atexit.register(EMBEDDED_SERVERS.stop_all)


class TinkerResource(dg.ConfigurableResource):
    """A real ``tinker.ServiceClient`` on the hosted service or on localtinker (see module docstring)."""

    backend: str = Field(
        default="auto",
        description="auto | local | remote. auto = remote when an API key is configured, else local.",
    )
    base_url: str | None = Field(
        default=None,
        description="Server to talk to. Empty: hosted Tinker for remote, an embedded localtinker for local.",
    )
    api_key: str | None = Field(
        default=None,
        description="Tinker API key; set it with dg.EnvVar('TINKER_API_KEY') so it never appears in config.",
    )
    storage_dir: str | None = Field(
        default=None,
        description="Checkpoint storage of the embedded localtinker. Empty: <state dir>/tinker.",
    )
    base_model: str = Field(default=DEFAULT_BASE_MODEL, description="Base model used when an asset names none.")
    local_dtype: str = Field(
        default="auto",
        description=(
            "Precision of the embedded localtinker: float32 (exact: sampler and trainer logprobs agree; also the "
            "fastest on CPUs without AMX), bfloat16 (bf16 weights, fp32 LoRA/optimizer), or auto (bfloat16 on a "
            "GPU with bf16 tensor cores, sm80 on; float32 on the CPU and older GPUs)."
        ),
    )
    local_device: str = Field(
        default="",
        description=(
            "Device of the embedded localtinker: auto (a CUDA GPU when torch sees one), cpu, cuda or cuda:N. "
            "Empty: $LOCALTINKER_DEVICE, else auto."
        ),
    )

    _client: tinker.ServiceClient | None = PrivateAttr(default=None)

    def endpoint(self) -> TinkerEndpoint:
        """Resolves the backend; starts the embedded server when that is what the config asks for."""
        if self.backend not in BACKENDS:
            raise ValueError(
                f"TinkerResource.backend={self.backend!r} is not one of {BACKENDS}; "
                "fix the resource config in pipelines/definitions.py or the launchpad."
            )
        backend = self.backend
        if backend == "auto":
            backend = "remote" if self.api_key else "local"
        if backend == "remote":
            if not self.api_key:
                raise ValueError(
                    "TinkerResource.backend='remote' needs an API key: export TINKER_API_KEY=tml-... "
                    "(read through dg.EnvVar), or use backend='local' for the embedded localtinker."
                )
            return TinkerEndpoint("remote", self.base_url, self.api_key, embedded=False)
        os.environ.setdefault("TINKER_TELEMETRY", "0")  # offline machine: nothing to report to
        if self.base_url:
            return TinkerEndpoint("local", self.base_url, self.api_key or EXISTING_LOCAL_SERVER_KEY, embedded=False)
        device = self.local_device or os.environ.get("LOCALTINKER_DEVICE") or "auto"
        base_url, api_key, local_device, local_dtype = EMBEDDED_SERVERS.get(self.resolved_storage_dir(),
                                                                             self.local_dtype, device)
        return TinkerEndpoint("local", base_url, api_key, embedded=True, local_device=local_device,
                              local_dtype=local_dtype)

    def resolved_storage_dir(self) -> Path:
        return Path(self.storage_dir).expanduser().resolve() if self.storage_dir else default_tinker_storage_dir()

    def get_client(self) -> tinker.ServiceClient:
        """The ServiceClient for this run (one session, closed when the step ends)."""
        if self._client is None:
            endpoint = self.endpoint()
            self._client = tinker.ServiceClient(base_url=endpoint.base_url, api_key=endpoint.api_key)
        return self._client

    @contextmanager
    def session(self, purpose: str) -> Iterator[tinker.ServiceClient]:
        """The run's ServiceClient for one piece of work; when that work fails, the Tinker session is
        closed with status ``errored`` (``interrupted`` on Ctrl-C) and the reason, so the server side
        (hosted dashboards, localtinker's session list) shows the failure rather than a clean finish."""
        client = self.get_client()
        try:
            yield client
        except BaseException as error:
            status = "interrupted" if isinstance(error, KeyboardInterrupt) else "errored"
            with suppress(Exception):  # the failure being reported matters more than a failed goodbye
                self._close(status, f"{purpose}: {type(error).__name__}: {str(error)[:300]}")
            raise

    def _close(self, status: str, detail: str | None = None) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close(status, detail).result(timeout=30)

    def describe(self) -> dict[str, str]:
        """Metadata/params that identify the backend; never contains the key."""
        return {**self.endpoint().describe(), "tinker_default_base_model": self.base_model}

    def base_model_source(self, name: str | None = None) -> BaseModelSource:
        """Which weights ``name`` means on this backend, and a content digest of them.

        Local: the directory localtinker loads (packaged SmolLM2, the tiny test model, a local HF dir)
        hashed file by file. Remote: the hosted service owns the weights; the digest identifies the name.
        """
        name = name or self.base_model
        if self.endpoint().backend == "remote":
            return BaseModelSource(name, "hosted Tinker", None, _sha256_text(f"hosted-tinker:{name}"))
        from localtinker.engine.models import resolve_model_dir  # resolves packaged weights offline

        location = resolve_model_dir(name)
        weights_dir = Path(location)
        if not weights_dir.is_dir():
            return BaseModelSource(name, f"hub:{location}", None, _sha256_text(f"hub:{location}"))
        return BaseModelSource(name, str(weights_dir), str(weights_dir), directory_digest(weights_dir))

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._client is not None:
            try:
                self._close("success")
            except Exception as error:  # the run's outcome is already decided; a failed goodbye must not flip it
                context.log.warning(f"Closing the Tinker session failed: {error}")
