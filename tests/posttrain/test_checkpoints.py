import json
import os

import pytest

from posttrain.checkpoints import (
    CheckpointRecord,
    CorruptLogError,
    append_checkpoint,
    append_jsonl,
    checkpoints_path,
    last_checkpoint,
    read_checkpoints,
    read_jsonl,
)


def _record(batch, **kwargs):
    return CheckpointRecord(
        name=f"{batch:06d}", batch=batch, epoch=0, state_path=f"tinker://r/weights/{batch:06d}",
        sampler_path=f"tinker://r/sampler_weights/{batch:06d}", **kwargs,
    )


def test_records_round_trip_with_extra_keys(tmp_path):
    append_checkpoint(tmp_path, _record(2, extra={"loss": 1.5}))
    append_checkpoint(tmp_path, _record(4, final=True))
    records = read_checkpoints(tmp_path)
    assert [r.batch for r in records] == [2, 4]
    assert records[0].extra == {"loss": 1.5} and not records[0].final
    assert records[1].final
    lines = [json.loads(line) for line in checkpoints_path(tmp_path).read_text().splitlines()]
    assert lines[0] == {
        "name": "000002", "batch": 2, "epoch": 0, "state_path": "tinker://r/weights/000002",
        "sampler_path": "tinker://r/sampler_weights/000002", "loss": 1.5,
    }
    assert lines[1]["final"] is True


def test_missing_log_reads_as_empty(tmp_path):
    assert read_checkpoints(tmp_path) == []
    assert last_checkpoint(tmp_path) is None


def test_torn_last_line_is_ignored_and_cut_before_the_next_append(tmp_path):
    append_checkpoint(tmp_path, _record(2))
    path = checkpoints_path(tmp_path)
    with open(path, "ab") as handle:  # what SIGKILL mid-append leaves behind
        handle.write(b'{"name": "000004", "batch": 4, "state_pa')
    assert [r.batch for r in read_checkpoints(tmp_path)] == [2]
    assert last_checkpoint(tmp_path).batch == 2
    append_checkpoint(tmp_path, _record(4))
    assert [r.batch for r in read_checkpoints(tmp_path)] == [2, 4]
    assert path.read_bytes().count(b"\n") == 2
    assert b"state_pa'" not in path.read_bytes() and b'"state_pa{' not in path.read_bytes()


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    append_jsonl(path, {"a": 3})
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_corrupt_middle_line_raises_with_location(tmp_path):
    path = checkpoints_path(tmp_path)
    path.write_text('{"name": "a", "batch": 1}\nnot json\n{"name": "b", "batch": 2}\n')
    with pytest.raises(CorruptLogError, match=r"checkpoints.jsonl:2"):
        read_checkpoints(tmp_path)


def test_last_checkpoint_skips_records_without_state(tmp_path):
    append_checkpoint(tmp_path, _record(2))
    append_checkpoint(tmp_path, CheckpointRecord(name="sampler-only", batch=3, sampler_path="tinker://r/sampler_weights/x"))
    assert last_checkpoint(tmp_path).batch == 2
    assert last_checkpoint(tmp_path, required_key="sampler_path").batch == 3


def test_append_is_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    append_checkpoint(tmp_path, _record(1))
    assert synced


def test_extra_may_not_shadow_known_fields():
    with pytest.raises(ValueError, match="batch"):
        CheckpointRecord(name="x", batch=1, extra={"batch": 2}).to_json()
