"""A document is written whole or not at all, wherever it is written from."""
from __future__ import annotations

import os

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
