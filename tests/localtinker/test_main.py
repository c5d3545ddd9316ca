"""The serve CLI's defaults: loopback only, float32, no key unless one is configured."""

from __future__ import annotations

from pathlib import Path

import pytest

from localtinker.__main__ import parse_args


def test_serve_binds_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALTINKER_API_KEY", raising=False)
    args = parse_args(["serve", "--storage", "/tmp/x"])
    assert (args.host, args.port, args.dtype, args.api_key, args.storage) == ("127.0.0.1", 8000, "float32", None, Path("/tmp/x"))


def test_api_key_and_dtype_are_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALTINKER_API_KEY", "tml-from-env")
    assert parse_args(["serve", "--storage", "s"]).api_key == "tml-from-env"
    args = parse_args(["serve", "--storage", "s", "--api-key", "tml-flag", "--dtype", "bfloat16"])
    assert (args.api_key, args.dtype) == ("tml-flag", "bfloat16")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--storage", "s", "--dtype", "float16"])


def test_device_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALTINKER_DEVICE", "cpu")
    args = parse_args(["serve", "--storage", "s"])
    assert (args.device, args.dtype) == (None, "float32")  # None: the engine reads $LOCALTINKER_DEVICE
    assert parse_args(["serve", "--storage", "s", "--device", "cpu"]).device == "cpu"
