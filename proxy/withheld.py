"""The journal of withheld answers: one append-only file per replica.

A non-streaming answer whose settlement could not be confirmed is withheld
(503, nothing charged). Its settlement may have committed all the same (the
acknowledgement was lost with the database), so it must be reversed once the
database answers. That duty is written here, and fsynced, before the 503 is
sent: should the process stop or give up first, the next start finds it."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson

from proxy.limits import WITHHELD_JOURNAL_ENTRIES_MAX, WITHHELD_JOURNAL_FILE_MODE, WITHHELD_JOURNAL_LINE_BYTES_MAX


class JournalFull(Exception):
    pass


class WithheldJournal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def record(self, request_id: str) -> None:
        """Durably note that this request's settlement must be reversed."""
        with self._lock:
            if len(self._pending()) >= WITHHELD_JOURNAL_ENTRIES_MAX:
                raise JournalFull(f"{self.path} holds {WITHHELD_JOURNAL_ENTRIES_MAX} withheld answers")
            self._append({"withheld": request_id})

    def done(self, request_id: str) -> None:
        """Its reversal is written (or nothing was charged); once none is left the file is emptied."""
        with self._lock:
            self._append({"done": request_id})
            if not self._pending():
                with open(self.path, "wb") as f:
                    os.fsync(f.fileno())

    def pending(self) -> list[str]:
        with self._lock:
            return self._pending()

    def _append(self, entry: dict) -> None:
        line = orjson.dumps(entry) + b"\n"
        if len(line) > WITHHELD_JOURNAL_LINE_BYTES_MAX:
            raise ValueError("a withheld journal line is too long")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, WITHHELD_JOURNAL_FILE_MODE)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _pending(self) -> list[str]:
        if not self.path.exists():
            return []
        pending: dict[str, None] = {}
        for line in self.path.read_bytes().splitlines():
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:  # a line cut short by a crash: its 503 was never sent
                continue
            if "withheld" in entry:
                pending[entry["withheld"]] = None
            elif "done" in entry:
                pending.pop(entry["done"], None)
        return list(pending)
