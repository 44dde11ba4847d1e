"""The scheduled verification (beat's `ledger-verify`): proves the ledger from
where the last run got to, records the result for /metrics
(`paralon_ledger_verify_ok`) and logs every failure at ERROR. It also holds
the ledger to the anchor file's anchors, so a rewind is found within one
interval, not at the next manual `ledger verify` (the chain's copies are read
by that command only: a node call per anchor is too much for every run)."""
from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import Engine

from app.anchoring import file as anchor_file
from app.payments.payout_checks import payout_problems
from ledger.anchors import check_anchors
from ledger.db import snapshot_connection
from ledger.verify_since import read_checkpoint, record, verify_since

log = logging.getLogger("paralon.ledger_verify")


def run_verification(engine: Engine, anchor_path: Path | None = None) -> dict:
    # Read before the snapshot, so that it holds every event an anchor names.
    anchors, findings = anchor_file.read(anchor_path) if anchor_path else ([], [])
    with snapshot_connection(engine) as conn:  # one snapshot: appends may go on meanwhile
        start = read_checkpoint(conn)
        report, proven = verify_since(conn, start)
        for finding in findings + check_anchors(conn, [entry.anchor for entry in anchors]) + payout_problems(conn):
            report.add(finding)
    if not report.ok:
        proven = start  # a failed run proves nothing new
    with engine.begin() as conn:
        record(conn, report, proven)
    if not report.ok:
        log.error("ledger verification FAILED: %d problem(s); first: %s", report.problems_total, report.problems[0])
    return {"ok": report.ok, "verified_seq": proven.seq, "events_checked": report.events_checked,
            "accounts_checked": report.accounts_checked, "problems_total": report.problems_total, "problems": report.problems}
