"""bfloat16 matmuls are chosen by measuring this CPU, or by LOCALTINKER_BF16_MATMUL."""

from __future__ import annotations

import pytest

import localtinker.engine.bf16_matmul as bf16_matmul


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv(bf16_matmul.ENV_CHOICE, raising=False)
    bf16_matmul.bf16_matmul_is_fast.cache_clear()
    yield
    bf16_matmul.bf16_matmul_is_fast.cache_clear()


@pytest.mark.parametrize(
    ("float32_s", "bf16_s", "fast"),
    [(2.0, 1.0, True), (1.0, 1.0, False), (1.0, 2.0, False), (1.2, 1.0, False)],  # must win by REQUIRED_SPEEDUP
)
def test_the_measured_speed_decides(monkeypatch, float32_s, bf16_s, fast):
    monkeypatch.setattr(bf16_matmul, "measure_matmul_seconds", lambda: (float32_s, bf16_s))
    assert bf16_matmul.bf16_matmul_is_fast() is fast


def test_the_measurement_times_both_dtypes():
    float32_s, bf16_s = bf16_matmul.measure_matmul_seconds()
    assert 0 < float32_s < 1 and 0 < bf16_s < 5


@pytest.mark.parametrize(("value", "fast"), [("bfloat16", True), ("float32", False), ("BF16", True)])
def test_the_environment_forces_the_choice_without_measuring(monkeypatch, value, fast):
    monkeypatch.setenv(bf16_matmul.ENV_CHOICE, value)
    monkeypatch.setattr(bf16_matmul, "measure_matmul_seconds", lambda: pytest.fail("measured despite the override"))
    assert bf16_matmul.bf16_matmul_is_fast() is fast


def test_an_unknown_choice_says_what_to_use(monkeypatch):
    monkeypatch.setenv(bf16_matmul.ENV_CHOICE, "fp8")
    with pytest.raises(ValueError, match="use bfloat16, float32, or leave it unset"):
        bf16_matmul.bf16_matmul_is_fast()
