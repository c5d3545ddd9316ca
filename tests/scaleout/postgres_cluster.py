"""A throwaway PostgreSQL cluster on 127.0.0.1, for tests of the scale-out profile.

``initdb`` into a fresh temp dir, ``pg_ctl start`` on a free loopback port with password (SCRAM) auth and
the Unix socket kept inside that dir, and ``pg_ctl stop`` + removal on exit. PostgreSQL refuses to run as
root, so under root the server runs as the ``postgres`` system user (which the Debian package creates) and
owns the dir. The binaries come from ``scripts/install_postgres.sh`` (``make test-postgres`` runs it).
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures.network import free_port

HOST = "127.0.0.1"
SUPERUSER = "posttrain"
SERVICE_USER = "postgres"  # the unprivileged account the server runs as when the tests run as root


@dataclass(frozen=True)
class PostgresCluster:
    host: str
    port: int
    username: str
    password: str
    data_dir: Path

    def url(self, database: str) -> str:
        """SQLAlchemy URL (MLflow's tracking URI); psycopg2 named, as SQLAlchemy 2.1 defaults to psycopg 3."""
        return f"postgresql+psycopg2://{self.username}:{self.password}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        import psycopg2  # the `postgres` extra; imported late so the default test run collects without it

        connection = psycopg2.connect(
            host=self.host, port=self.port, user=self.username, password=self.password, dbname="postgres"
        )
        connection.autocommit = True  # CREATE DATABASE cannot run inside a transaction
        try:
            with connection.cursor() as cursor:
                cursor.execute(f'CREATE DATABASE "{name}"')
        finally:
            connection.close()


def postgres_bin_dir() -> Path:
    """The newest installed server's bin dir (Debian keeps initdb/pg_ctl off PATH, under a versioned dir)."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    initdb = candidates[-1] if candidates else shutil.which("initdb")
    if not initdb:
        raise RuntimeError(
            "postgres_bin_dir: PostgreSQL server binaries (initdb, pg_ctl) not found; "
            "run `bash scripts/install_postgres.sh` as root (or `make test-postgres`)"
        )
    return Path(initdb).parent


def _as_server_user(command: list[str]) -> list[str]:
    return ["runuser", "-u", SERVICE_USER, "--", *command] if os.geteuid() == 0 else command


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(_as_server_user(command), capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed ({result.returncode}): {result.stdout[-2000:]}{result.stderr[-2000:]}")


@contextmanager
def running_postgres() -> Iterator[PostgresCluster]:
    """Starts a fresh cluster listening on 127.0.0.1 only; stops it and deletes its files on exit."""
    bin_dir = postgres_bin_dir()
    root = Path(tempfile.mkdtemp(prefix="posttrain-pg-"))
    password = secrets.token_hex(16)
    port = free_port()
    data_dir = root / "data"
    try:
        (root / "pwfile").write_text(password + "\n")
        if os.geteuid() == 0:
            account = pwd.getpwnam(SERVICE_USER)
            os.chown(root, account.pw_uid, account.pw_gid)
            os.chown(root / "pwfile", account.pw_uid, account.pw_gid)
        _run(
            [
                str(bin_dir / "initdb"),
                f"--pgdata={data_dir}",
                f"--username={SUPERUSER}",
                f"--pwfile={root / 'pwfile'}",
                "--auth=scram-sha-256",
                "--encoding=UTF8",
                "--no-instructions",
            ],
            "initdb",
        )
        server_options = f"-c listen_addresses={HOST} -p {port} -c unix_socket_directories={root} -c max_connections=200"
        _run(
            [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-l", str(root / "server.log"), "-w", "-t", "60", "-o", server_options, "start"],
            "pg_ctl start",
        )
        try:
            yield PostgresCluster(HOST, port, SUPERUSER, password, data_dir)
        finally:
            _run([str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-m", "fast", "-w", "stop"], "pg_ctl stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
