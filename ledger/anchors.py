"""Anchors: the chain's head as it was once, kept where the database cannot
rewrite it. The ledger only defines the record and checks the chain against
anchors it is handed; writing and reading the copies outside (a file, an EVM
chain) is the edge's job. An anchor is never read from the database: a copy
the attacker can rewrite proves nothing.

A chain that was rewound (its newest events deleted, `ledger_head` pointed
back, balances replayed) hashes clean from the start; only a copy outside
remembers that the chain once reached further."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select

from ledger.limits import IN_CLAUSE_VALUES_MAX
from ledger.schema import ledger_events, ledger_head


@dataclass(frozen=True, slots=True)
class Anchor:
    seq: int
    hash: bytes  # the event's SHA-256, as `ledger_events.hash`
    anchored_at: datetime | None
    where: str  # the copy it was read from, for the report: "file …:line 3", "chain 1 tx 0x…"


def read_head(conn: Connection) -> tuple[int, bytes]:
    """(seq, hash) of the newest event; (0, genesis) for an empty ledger."""
    row = conn.execute(select(ledger_head.c.last_seq, ledger_head.c.last_hash).where(ledger_head.c.id == 1)).one()
    return row.last_seq, bytes(row.last_hash)


def stored_hashes(conn: Connection, seqs: set[int]) -> dict[int, bytes]:
    """The hash of each event among `seqs` that the log still has."""
    found: dict[int, bytes] = {}
    ordered = sorted(seqs)
    for start in range(0, len(ordered), IN_CLAUSE_VALUES_MAX):
        chunk = ordered[start:start + IN_CLAUSE_VALUES_MAX]
        for seq, stored in conn.execute(select(ledger_events.c.seq, ledger_events.c.hash).where(ledger_events.c.seq.in_(chunk))):
            found[seq] = bytes(stored)
    return found


def check_anchors(conn: Connection, anchors: list[Anchor]) -> list[str]:
    """Findings: an anchored event that is missing or hashes otherwise, and a head
    below an anchor (the chain was rewound). Empty when every anchor holds."""
    if not anchors:
        return []
    head_seq, _ = read_head(conn)
    stored = stored_hashes(conn, {a.seq for a in anchors})
    findings = []
    for anchor in anchors:
        where = f"anchored seq {anchor.seq} ({anchor.where})"
        if anchor.seq not in stored:
            findings.append(f"{where}: the event is missing from the log")
        elif stored[anchor.seq] != anchor.hash:
            findings.append(f"{where}: hash {anchor.hash.hex()} but the log has {stored[anchor.seq].hex()}")
    highest = max(anchors, key=lambda a: a.seq)
    if head_seq < highest.seq:
        findings.append(f"the chain was rewound: ledger_head is at seq {head_seq}, below anchored seq {highest.seq} ({highest.where})")
    return findings


def latest_matching(conn: Connection, anchors: list[Anchor]) -> Anchor | None:
    """The newest anchor whose event the log has with the same hash."""
    stored = stored_hashes(conn, {a.seq for a in anchors})
    matching = [a for a in anchors if stored.get(a.seq) == a.hash]
    return max(matching, key=lambda a: a.seq, default=None)
