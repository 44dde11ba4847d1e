"""Another revision of this repository, checked out beside it for a benchmark to compare against.

Standard library only: a benchmark's child process may import this before
putting the other checkout first on its path."""
from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def revision_checkout(revision: str) -> Iterator[str]:
    """A temporary git worktree of `revision` (its root), removed afterwards, even on failure."""
    with tempfile.TemporaryDirectory(prefix="paralon-base-") as tmp:
        root = str(Path(tmp) / "base")
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", root, revision], check=True)
        try:
            yield root
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", root], check=False)
