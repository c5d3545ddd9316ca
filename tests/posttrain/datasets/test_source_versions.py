"""Sources as a user names them, each read at a version that is recorded: local files and directories by
their bytes, hub ids by commit, generators by package release and seed; offline, an uncached hub id says
how to fix it."""

from __future__ import annotations

import hashlib

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.datasets import sources
from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.sources import OfflineSourceError
from tests.fixtures.data import chat_line


def test_jsonl_revision_is_the_file_digest_and_changes_with_the_file(write_jsonl):
    path = write_jsonl([chat_line("1+1?", "2"), chat_line("2+2?", "4")])
    first = load(LoadSpec("chat", str(path))).provenance
    assert first.revision == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert (first.kind, first.location, first.rows_read) == ("local", str(path), 2)
    write_jsonl([chat_line("1+1?", "2"), chat_line("2+2?", "5")])
    assert load(LoadSpec("chat", str(path))).provenance.revision != first.revision


def test_parquet_file_is_versioned_by_its_bytes(tmp_path):
    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "2+2?", "good": "4", "bad": "5"}]), path)
    loaded = load(LoadSpec("comparison", str(path), columns={"prompt": "q", "chosen": "good", "rejected": "bad"}))
    assert loaded.provenance.revision == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_save_to_disk_directories_read_the_named_split(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:3]), "test": datasets.Dataset.from_list(rows[3:])}
    ).save_to_disk(str(tmp_path / "dict"))
    test = load(LoadSpec("rl", str(tmp_path / "dict"), split="test"))
    assert [row["answer"] for row in test.table.to_pylist()] == ["4", "5"]
    assert test.provenance.split == "test" and test.provenance.revision.startswith("sha256:")
    with pytest.raises(FileNotFoundError, match=r"no split 'validation'; this save_to_disk directory has \['test', 'train'\]"):
        load(LoadSpec("rl", str(tmp_path / "dict"), split="validation"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert load(LoadSpec("rl", str(tmp_path / "one"))).table.num_rows == 5


def test_preset_from_the_mirror_records_split_config_and_digest(hub_mirror):
    provenance = load(LoadSpec("rl", "gsm8k")).provenance
    assert (provenance.kind, provenance.split, provenance.config_name) == ("mirror", "train", "main")
    assert provenance.location == str(hub_mirror / "openai" / "gsm8k")
    assert provenance.revision == sources.local_digest(hub_mirror / "openai" / "gsm8k")


def test_generators_are_versioned_by_package_and_seed():
    provenance = load(LoadSpec("rl", "reasoning_gym:basic_arithmetic", limit=4, seed=3)).provenance
    assert provenance.kind == "generator" and provenance.rows_read == 4
    assert provenance.revision.startswith("reasoning-gym ") and provenance.revision.endswith("seed 3")


def test_a_generator_without_limit_makes_its_documented_default():
    assert load(LoadSpec("rl", "reasoning_gym:basic_arithmetic")).table.num_rows == 400


def test_offline_uncached_hub_dataset_names_the_dataset_and_both_fixes(hub_mirror, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    with pytest.raises(OfflineSourceError) as raised:
        load(LoadSpec("chat", "someone/not-cached-dataset", revision="v1"))
    message = str(raised.value)
    assert message.startswith("someone/not-cached-dataset: not in the local datasets cache")
    assert "unset HF_HUB_OFFLINE and HF_DATASETS_OFFLINE" in message  # go online
    assert "pre-cache" in message and "$POSTTRAIN_HUB_MIRROR/someone/not-cached-dataset" in message  # or stay offline


def test_offline_revision_is_the_commit_the_cache_was_built_from():
    commit = "0123456789abcdef0123456789abcdef01234567"
    built = type("Cached", (), {"cache_files": [{"filename": f"/c/openai___gsm8k/main/0.0.0/{commit}/gsm8k-train.arrow"}]})()
    assert sources._cached_commit(built) == commit
    assert sources._cached_commit(datasets.Dataset.from_list([{"a": 1}])) is None  # in memory: no cache file


def test_online_hub_ids_load_the_resolved_commit(monkeypatch):
    """Online, a branch name is resolved to its commit before loading, so the recorded sha is what was read."""
    import huggingface_hub

    for name in sources.OFFLINE_ENVS:
        monkeypatch.delenv(name, raising=False)
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    asked: dict = {}
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, repo, revision=None: type("I", (), {"sha": commit})())
    monkeypatch.setattr(
        datasets, "load_dataset", lambda path, **kw: asked.update(path=path, **kw) or datasets.Dataset.from_list([chat_line("hi", "yo")])
    )
    loaded = load(LoadSpec("chat", "someone/chats", revision="main"))
    assert asked["revision"] == commit and asked["path"] == "someone/chats" and not asked.get("streaming")
    assert (loaded.provenance.kind, loaded.provenance.revision, loaded.provenance.requested_revision) == ("hub", commit, "main")


def test_a_missing_relative_data_file_is_reported_as_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sources.SourceNotFoundError, match="data/chats.jsonl: no such file or directory"):
        load(LoadSpec("chat", "data/chats.jsonl"))
