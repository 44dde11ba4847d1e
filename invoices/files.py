"""Documents on disk: a PDF is written whole or not at all, so a reader (a
download, an email, a crash in between) never finds half of one; and a stored
PDF is handed out only if its bytes are the ones whose SHA-256 was recorded.

Where: `PARALON_INVOICE_DIR/<deployment id>/...`, the id being this
database's own (`deployment` table), and each file name carries the PDF's
SHA-256, so neither a second deployment on the same directory nor a database
restored from an older backup issuing a number again finds another's file
under its own name. A file that is missing or whose bytes differ is rendered
again from the database; if that does not give the recorded bytes either, the
document is refused loudly (`DocumentUnavailable`), never swapped for another."""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Connection, select

from invoices.schema import deployment
from ledger.errors import LedgerError

PARTIAL_SUFFIX = ".partial"
log = logging.getLogger(__name__)


class DocumentUnavailable(LedgerError):
    """A recorded document whose stored bytes are not the ones recorded and cannot be rendered again to match."""

    code = "document_unavailable"


def deployment_id(conn: Connection) -> str:
    """This database's random id (made once, by its migration)."""
    return conn.execute(select(deployment.c.deployment_id).where(deployment.c.id == 1)).scalar_one()


def sha256(content: bytes) -> bytes:
    return hashlib.sha256(content).digest()


def write_whole(path: Path, content: bytes) -> None:
    """Atomically: a temporary file of this writer's own, synced, then renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(content)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)  # atomic within one file system
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    _sync_directory(path.parent)  # the rename itself survives a power cut


def _sync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def read_if_recorded(path: Path, recorded_sha256: bytes) -> bytes | None:
    """The file's bytes if they are the recorded ones; None if it is missing, unreadable or different."""
    try:
        content = path.read_bytes()
    except OSError:
        return None
    return content if sha256(content) == recorded_sha256 else None


def recorded_document(path: Path, recorded_sha256: bytes, render: Callable[[], bytes], store_at: Path,
                      what: str) -> tuple[bytes, Path]:
    """The recorded bytes of `what` and where they are stored now: from `path`,
    or rendered again and stored at `store_at` when they render to the record."""
    content = read_if_recorded(path, recorded_sha256)
    if content is not None:
        return content, path
    log.error("%s: the file %s is missing or is not the recorded document (SHA-256 %s); rendering it again",
              what, path, recorded_sha256.hex())
    content = render()
    if sha256(content) != recorded_sha256:
        log.error("%s: rendering it again gives SHA-256 %s, not the recorded %s; it is neither served nor mailed",
                  what, sha256(content).hex(), recorded_sha256.hex())
        raise DocumentUnavailable(f"{what} is unavailable: its stored file is not the document recorded, and rendering it "
                                  "again does not give the recorded bytes (an operator must restore the file)")
    write_whole(store_at, content)
    log.warning("%s: rendered again to the recorded SHA-256 and stored at %s", what, store_at)
    return content, store_at
