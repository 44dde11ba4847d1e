"""The anchor file: one JSON object a line, only ever appended to.

Each line is written by one `write(2)` on a descriptor opened with O_APPEND and
synced before the anchor counts as written, so a line is whole or absent even
with two writers. The file is on the database's host; operators ship it off the
host (log shipping, a mail, a write-once bucket) so that whoever can rewrite
the database cannot rewrite every copy."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from app.limits import ANCHOR_FILE_LINE_BYTES_MAX, ANCHOR_FILE_MODE
from ledger.anchors import Anchor
from ledger.limits import SHA256_HEX_CHARS

TX_HASH = re.compile(r"0x[0-9a-f]{64}")
HASH = re.compile(rf"[0-9a-f]{{{SHA256_HEX_CHARS}}}")


@dataclass(frozen=True)
class FileAnchor:
    anchor: Anchor
    chain_id: int | None  # where its transaction is, when one was sent
    tx_hash: str | None


def line_of(anchor: Anchor, chain_id: int | None = None, tx_hash: str | None = None) -> dict:
    record = {"seq": anchor.seq, "hash": anchor.hash.hex(), "anchored_at": anchor.anchored_at.isoformat()}
    if tx_hash:
        record |= {"chain_id": chain_id, "tx_hash": tx_hash}
    return record


def append(path: Path, record: dict) -> None:
    """Append one line and sync it (and the directory, when the file is new)."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    if len(line) > ANCHOR_FILE_LINE_BYTES_MAX:
        raise ValueError(f"an anchor line of {len(line)} bytes is longer than {ANCHOR_FILE_LINE_BYTES_MAX}")
    path.parent.mkdir(parents=True, exist_ok=True)
    is_new = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, ANCHOR_FILE_MODE)
    try:
        os.write(fd, line)  # one write: the line is whole or absent
        os.fsync(fd)
    finally:
        os.close(fd)
    if is_new:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def read(path: Path) -> tuple[list[FileAnchor], list[str]]:
    """Every anchor of the file, and a finding for each line that is not one
    (a copy that was edited, or a line cut short). No file: no anchors."""
    if not path.exists():
        return [], []
    anchors, findings = [], []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                anchors.append(_parse(raw, f"file {path}:line {number}"))
            except ValueError as exc:
                findings.append(f"anchor file {path} line {number} is not an anchor: {exc}")
    return anchors, findings


def _parse(raw: bytes, where: str) -> FileAnchor:
    record = json.loads(raw)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    seq, hash_hex, at = record.get("seq"), record.get("hash"), record.get("anchored_at")
    if type(seq) is not int or seq < 1:
        raise ValueError(f"seq {seq!r} is not a positive integer")
    if not isinstance(hash_hex, str) or not HASH.fullmatch(hash_hex):
        raise ValueError(f"hash {hash_hex!r} is not {SHA256_HEX_CHARS} lowercase hex digits")
    anchored_at = datetime.fromisoformat(at) if isinstance(at, str) else None
    if anchored_at is None or anchored_at.tzinfo is None:
        raise ValueError(f"anchored_at {at!r} is not a UTC time")
    tx_hash, chain_id = record.get("tx_hash"), record.get("chain_id")
    if tx_hash is not None and (not isinstance(tx_hash, str) or not TX_HASH.fullmatch(tx_hash) or type(chain_id) is not int):
        raise ValueError(f"tx_hash {tx_hash!r} on chain {chain_id!r} is not a transaction")
    return FileAnchor(Anchor(seq, bytes.fromhex(hash_hex), anchored_at, where), chain_id, tx_hash)
