"""Secrets audit: with sentinel values as TINKER_API_KEY and HF_TOKEN, a whole SFT chain, its eval and a sandbox
run leave zero copies of either anywhere a secret could land.

The chain runs as a user runs it: ``pipelines.definitions.default_resources()`` reads the key and the server URL
from the environment (through ``dg.EnvVar``), and the server is ``python -m localtinker serve --api-key <key>``
in its own process with its log captured. Then every file under the test's directory is searched: the
Dagster storage (run config, event log with all asset metadata, compute logs), the MLflow sqlite store and
artifacts, parquet tables (decoded, since pages may be compressed), checkpoint manifests, training log dirs,
the server's checkpoint storage and log — plus what the sandboxed program printed of its environment.
``test_the_audit_finds_planted_copies`` shows the search would catch a leak in each kind of file.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from resources.state import STATE_DIR_ENV, ensure_dagster_home
from tests.fixtures.dagster_env import TINY_MODEL
from tests.reliability.external_server import start_external_server

CHAIN_CONFIG = {
    "ops": {
        "chat_dataset": {"config": {"limit": 24, "heldout_fraction": 0.25}},
        "sft_checkpoint": {"config": {"batch_size": 4, "max_steps": 2, "save_every": 1, "learning_rate": 1e-3, "lora_rank": 4}},
    }
}
EVAL_CONFIG = {"ops": {"sft_eval_report": {"config": {"max_heldout_sequences": 4, "max_problems": 2, "max_tokens": 4, "pass_k": 0}}}}
PRINT_ENVIRONMENT = "import json, os\nprint(json.dumps(dict(os.environ)))\n"


def secret_hits(root: Path, needles: list[str]) -> list[str]:
    """``path: needle`` for every file under ``root`` holding a needle, in its bytes or (parquet) its decoded rows."""
    hits = []
    encoded = [(needle, needle.encode()) for needle in needles]
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix == ".parquet":
            try:
                data += json.dumps(pq.read_table(path).to_pylist(), default=str).encode()
            except Exception:  # not readable as parquet: the raw bytes were searched
                pass
        hits += [f"{path}: {needle}" for needle, raw in encoded if raw in data]
    return hits


def test_the_audit_finds_planted_copies(tmp_path: Path) -> None:
    needle = f"tml-planted-{secrets.token_hex(8)}"
    with sqlite3.connect(tmp_path / "runs.db") as db:
        db.execute("create table run_config (body text)")
        db.execute("insert into run_config values (?)", (json.dumps({"resources": {"tinker": {"api_key": needle}}}),))
    pq.write_table(pa.table({"metadata": [f"key={needle}"] * 50}), tmp_path / "table.parquet", compression="zstd")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "server.log").write_text(f"INFO request with X-API-Key {needle}\n")
    (tmp_path / "clean.txt").write_text("nothing to see")
    hits = secret_hits(tmp_path, [needle])
    assert sorted(Path(hit.split(": ")[0]).name for hit in hits) == ["runs.db", "server.log", "table.parquet"]


@pytest.mark.slow  # a server process, a chain and an eval: 2-3 min on the shared 2-core machine
def test_no_secret_lands_in_dagster_mlflow_parquet_server_logs_or_the_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.definitions import build_definitions, default_resources
    from posttrain.sandbox import run_python

    api_key = f"tml-sentinel-{secrets.token_hex(12)}"
    hf_token = f"hf_sentinel{secrets.token_hex(12)}"
    state = tmp_path / "state"
    for name, value in {
        "TINKER_API_KEY": api_key, "HF_TOKEN": hf_token, STATE_DIR_ENV: str(state),
        "DAGSTER_HOME": str(state / "dagster"), "POSTTRAIN_BASE_MODEL": TINY_MODEL,
    }.items():
        monkeypatch.setenv(name, value)
    server = start_external_server(tmp_path / "server-storage", tmp_path / "server.log", api_key=api_key, log_level="debug")
    try:
        monkeypatch.setenv("TINKER_BASE_URL", server.base_url)
        defs = build_definitions(default_resources())
        with dg.DagsterInstance.from_config(str(ensure_dagster_home())) as instance:
            chain = defs.resolve_job_def("sft_chain").execute_in_process(instance=instance, run_config=CHAIN_CONFIG)
            assert chain.success
            (final,) = [key for key in instance.get_dynamic_partitions("sft_checkpoints") if key.endswith("000002")]
            evaluation = defs.resolve_job_def("sft_eval").execute_in_process(instance=instance, partition_key=final, run_config=EVAL_CONFIG)
            assert evaluation.success
            run_config = repr(instance.get_run_by_id(chain.run_id).run_config)
    finally:
        server.stop()
    sandbox = run_python(PRINT_ENVIRONMENT, timeout_s=20, memory_mb=512)
    assert sandbox.status == "passed", sandbox
    sandbox_env = json.loads(sandbox.stdout_tail)
    (tmp_path / "sandbox-environment.json").write_text(json.dumps(sandbox_env))

    assert "X-API-Key" not in server.log_path.read_text() and server.log_path.stat().st_size > 0  # the log was captured
    assert "TINKER_API_KEY" not in sandbox_env and "HF_TOKEN" not in sandbox_env
    assert api_key not in run_config
    assert secret_hits(tmp_path, [api_key, hf_token]) == []
