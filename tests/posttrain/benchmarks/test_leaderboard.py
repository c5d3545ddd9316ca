"""The leaderboard's rows: paired Δ vs the parent on shared samples, and the tables they print as."""

from __future__ import annotations

from posttrain.benchmarks.leaderboard import Cell, ModelEntry, build_rows, markdown, order_models, rows_from_table, table, text

BASE = ModelEntry("base:m", "base:m", "base", 0, None)
SFT = ModelEntry("sft-1a2b3c4d-000010", "sft-1a2b3c4d-000010", "sft", 10, "base:m")


def _cell(scores: dict[str, float]) -> Cell:
    value = sum(scores.values()) / len(scores)
    return Cell("sums", "accuracy", value, 0.1, len(scores), scores)


def test_a_checkpoint_row_carries_its_paired_difference_with_the_parent() -> None:
    cells = {
        ("base:m", "sums"): _cell({"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0}),
        ("sft-1a2b3c4d-000010", "sums"): _cell({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "e": 1.0}),
    }
    rows = build_rows([SFT, BASE], cells)
    assert [row.model for row in rows] == ["base:m", "sft-1a2b3c4d-000010"]  # base first
    assert rows[0].delta_parent_n == 0
    assert (rows[1].delta_parent, rows[1].delta_parent_n) == (0.75, 4)  # over the 4 samples both answered
    assert rows_from_table(table(rows))[1] == rows[1] and text(rows_from_table(table(rows))) == text(rows)

    lines = text(rows).splitlines()
    assert lines[0].startswith("model / benchmark") and "Δ vs parent" in lines[0]
    assert lines[1] == "base:m"
    assert lines[2].split() == ["sums", "0.250", "±", "0.100", "4"]
    assert lines[3] == "sft-1a2b3c4d-000010  (parent base:m)"
    assert lines[4].split() == ["sums", "1.000", "±", "0.100", "5", "+0.750", "±", "0.250", "(4)", "*"]  # 3 s.e.: flagged
    assert "| sft-1a2b3c4d-000010 | base:m | 1.000 ± 0.100 (n=5)<br>Δ +0.750" in markdown(rows)


def test_models_come_in_lineage_order() -> None:
    dpo = ModelEntry("dpo-5e6f7a8b-000004", "dpo-5e6f7a8b-000004", "dpo", 4, SFT.key)
    rl = ModelEntry("rl-9a8b7c6d-000004", "rl-9a8b7c6d-000004", "rl", 4, dpo.key)
    orphan = ModelEntry("rl-00000000-000002", "rl-00000000-000002", "rl", 2, "sft-gone-000001")  # parent not benchmarked
    assert [m.key for m in order_models([rl, dpo, orphan, SFT, BASE])] == [BASE.key, orphan.key, SFT.key, dpo.key, rl.key]
