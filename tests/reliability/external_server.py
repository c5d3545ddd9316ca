"""``python -m localtinker serve`` as a separate process (as users run it), with its log captured to a file.

Used by the secrets audit (the server's own log must not hold the key) and the kill soak (the server is
SIGKILLed and restarted on the same storage dir: ``tinker://`` paths must survive).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.fixtures.network import free_port

REPO = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 300  # torch import + model load; minutes on a loaded 2-core machine


@dataclass
class ExternalServer:
    """One server process; :meth:`restart` starts a new one on the same port and storage."""

    storage: Path
    log_path: Path
    api_key: str | None
    port: int
    log_level: str = "info"
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ExternalServer:
        command = [sys.executable, "-m", "localtinker", "serve", "--port", str(self.port), "--storage", str(self.storage),
                   "--log-level", self.log_level, "--threads", "1"]
        env = {key: value for key, value in os.environ.items() if key != "LOCALTINKER_API_KEY"}
        if self.api_key:
            command += ["--api-key", self.api_key]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"localtinker exited with {self.process.returncode}; log: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"localtinker did not answer within {STARTUP_SECONDS} s; log: {self.log_path}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean shutdown of anything."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()


def start_external_server(storage: Path, log_path: Path, api_key: str | None = None, log_level: str = "info") -> ExternalServer:
    storage.mkdir(parents=True, exist_ok=True)
    return ExternalServer(storage, log_path, api_key, free_port(), log_level).start()
