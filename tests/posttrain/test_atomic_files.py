"""``posttrain.atomic_files``: whole files only, with concurrent writers of one path."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from posttrain.atomic_files import staged, write_text_atomically


def test_concurrent_writers_of_one_path_all_succeed_and_leave_one_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "base-scores.json"
    texts = [str(index) * 200_000 for index in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(texts))

    def write(text: str) -> None:
        start.wait()
        try:
            for _ in range(5):
                write_text_atomically(target, text)
        except BaseException as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=write, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert target.read_text() in texts
    assert [path.name for path in target.parent.iterdir()] == [target.name]  # no staging file left behind
    assert target.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # readable like any file the user writes


def test_a_failed_write_keeps_the_old_file_and_leaves_no_staging_file(tmp_path: Path) -> None:
    target = tmp_path / "reference.parquet"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with staged(target) as staging:
            staging.write_text("half")
            raise RuntimeError("writer failed")
    assert target.read_text() == "old"
    assert [path.name for path in tmp_path.iterdir()] == [target.name]


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
