"""The demo's first line says where it trains: the embedded localtinker's device and dtype, or the server."""

from __future__ import annotations

from pipelines.demo import backend_line
from resources.tinker import EMBEDDED_SERVERS, TinkerResource


def test_the_demo_names_the_embedded_device_and_dtype_or_the_server_it_trains_on(tmp_path):
    try:
        embedded = TinkerResource(backend="local", storage_dir=str(tmp_path / "tinker"), local_dtype="float32",
                                  local_device="cpu")
        assert backend_line(embedded) == "Tinker backend: localtinker (embedded) on cpu, float32"
    finally:
        EMBEDDED_SERVERS.stop_all()
    existing = TinkerResource(backend="local", base_url="http://127.0.0.1:9")
    assert backend_line(existing) == "Tinker backend: localtinker at http://127.0.0.1:9"
    assert backend_line(TinkerResource(api_key="tml-secret")) == "Tinker backend: hosted Tinker"
