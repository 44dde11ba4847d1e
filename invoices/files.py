"""Documents on disk: a PDF is written whole or not at all, so a reader (a
download, an email, a crash in between) never finds half of one."""
from __future__ import annotations

import os
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


def write_whole(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    partial.write_bytes(content)
    os.replace(partial, path)  # atomic within one file system
