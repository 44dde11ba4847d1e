"""A document is written whole or not at all, wherever it is written from."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from invoices import files, service, statements


def test_a_document_is_written_whole_in_a_new_directory(tmp_path):
    path = tmp_path / "2026" / "PAR-2026-000001.pdf"
    files.write_whole(path, b"%PDF-1.7 first")
    files.write_whole(path, b"%PDF-1.7 second")
    assert path.read_bytes() == b"%PDF-1.7 second"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name], "nothing partial is left behind"


def test_a_write_that_fails_leaves_the_old_document_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "statement.pdf"
    files.write_whole(path, b"%PDF-1.7 as issued")

    def crash(source, destination):
        raise OSError("the disk is full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        files.write_whole(path, b"%PDF-1.7 half of a new one")
    assert path.read_bytes() == b"%PDF-1.7 as issued"


def test_invoices_and_statements_write_through_it():
    assert service.write_whole is files.write_whole and statements.write_whole is files.write_whole


def test_writers_of_one_name_at_once_never_leave_a_mixed_or_partial_file(tmp_path):
    path = tmp_path / "PAR-2026-000001.pdf"
    contents = [bytes([n]) * 200_000 for n in (1, 2)]  # large enough for the writes to overlap

    def write_many(content: bytes) -> None:
        for _ in range(20):
            files.write_whole(path, content)

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(write_many, contents))
    assert path.read_bytes() in contents, "one writer's whole file, never a mix"
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temporary file is left behind"


def test_a_file_is_kept_only_if_it_is_the_recorded_one(tmp_path):
    path = tmp_path / "doc.pdf"
    files.write_whole(path, b"%PDF-1.7 recorded")
    recorded = files.sha256(b"%PDF-1.7 recorded")
    assert files.read_if_recorded(path, recorded) == b"%PDF-1.7 recorded"
    path.write_bytes(b"%PDF-1.7 another's")
    assert files.read_if_recorded(path, recorded) is None
    assert files.read_if_recorded(tmp_path / "missing.pdf", recorded) is None
    with pytest.raises(files.DocumentUnavailable):
        files.recorded_document(path, recorded, lambda: b"%PDF-1.7 rendered differently", path, "document 1")
    assert path.read_bytes() == b"%PDF-1.7 another's", "a refused document writes nothing"
    content, stored_at = files.recorded_document(path, recorded, lambda: b"%PDF-1.7 recorded", tmp_path / "again.pdf", "document 1")
    assert content == b"%PDF-1.7 recorded" and stored_at.read_bytes() == content
