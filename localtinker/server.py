"""Start localtinker in-process: uvicorn on a background thread, an ephemeral port by default.

    with start_server(tmp_path, dtype="float32") as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local")

Used by the Tinker resource, the tests and the benchmarks; ``python -m localtinker serve`` is the
same service in the foreground.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import uvicorn

from localtinker.engine.api import Engine
from localtinker.protocol.app import LocalTinkerService, ProtocolConfig

logger = logging.getLogger("localtinker")

DTYPES = ("float32", "bfloat16")


def build_engine(storage_dir: Path, dtype: str | None = "float32", num_threads: int | None = None,
                 device: str | None = None) -> Engine:
    """The real torch engine; imported lazily so the protocol layer loads without torch.

    ``device``: auto | cpu | cuda[:N]; None = ``$LOCALTINKER_DEVICE``, else auto (a CUDA GPU when torch sees
    one). ``dtype`` None or ``"auto"``: bfloat16 on a GPU with native bf16 (sm80 on), else float32 (device.py)."""
    if dtype not in (*DTYPES, "auto", None):
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)} or auto")
    from localtinker.engine.device import default_dtype, dtype_warning, resolve_device
    from localtinker.engine.engine import LocalEngine

    resolved = resolve_device(device)
    if dtype in ("auto", None):
        dtype = default_dtype(resolved)
    warning = dtype_warning(resolved, dtype)
    if warning:
        logger.warning(warning)
    return LocalEngine(Path(storage_dir), dtype=dtype, num_threads=num_threads, device=resolved)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket. proto must be IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted
    sockets whose proto says TCP, and without it every response waits ~40 ms for a delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: object, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_config=None,
        log_level=log_level.lower(),
        access_log=False,  # the protocol logs one line per request itself
        loop="asyncio",
        http="auto",  # httptools when installed, else h11
        lifespan="off",
        timeout_keep_alive=75,
    )


@dataclass
class RunningServer:
    """A localtinker server running on a background thread; ``stop()`` or use it as a context manager."""

    base_url: str
    host: str
    port: int
    storage_dir: Path
    service: LocalTinkerService
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def engine(self) -> Engine:
        return self.service.engine

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops accepting requests, then the engine worker (pending requests fail, none half-run)."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self.service.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_server(
    storage_dir: str | Path,
    *,
    dtype: str | None = "float32",
    device: str | None = None,
    api_key: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    engine: Engine | None = None,
    config: ProtocolConfig | None = None,
    log_level: str = "warning",
    startup_timeout_s: float = 30.0,
) -> RunningServer:
    """Starts localtinker on ``host:port`` (port 0 = a free port) and returns once it accepts requests.

    ``engine`` defaults to the real torch engine over ``storage_dir`` on ``device`` (see :func:`build_engine`);
    tests may pass a fake one.
    ``api_key`` (when given) overrides ``config.api_key``.
    """
    storage = Path(storage_dir).expanduser().resolve()
    storage.mkdir(parents=True, exist_ok=True)
    config = config or ProtocolConfig()
    if api_key is not None:
        config = dataclasses.replace(config, api_key=api_key)
    sock = bind_socket(host, port)  # first: a taken port fails before any thread starts
    actual_port = sock.getsockname()[1]
    try:
        engine = engine if engine is not None else build_engine(storage, dtype, device=device)
    except BaseException:
        sock.close()
        raise
    service = LocalTinkerService(engine, storage, config)
    server = uvicorn.Server(uvicorn_config(service.build_app(), log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="localtinker-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            service.close()
            sock.close()
            raise RuntimeError(f"localtinker did not start on {host}:{actual_port}; see the log above")
        time.sleep(0.01)
    url_host = f"[{host}]" if ":" in host else host
    base_url = f"http://{url_host}:{actual_port}"
    logger.info("localtinker serving %s (storage %s)", base_url, storage)
    return RunningServer(base_url, host, actual_port, storage, service, server, thread)
