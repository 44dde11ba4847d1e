"""The scheduled verification (beat's `ledger-verify`): proves the ledger from
where the last run got to, records the result for /metrics
(`paralon_ledger_verify_ok`) and logs every failure at ERROR."""
from __future__ import annotations

import logging

from sqlalchemy import Engine

from ledger.db import snapshot_connection
from ledger.verify_since import read_checkpoint, record, verify_since

log = logging.getLogger("paralon.ledger_verify")


def run_verification(engine: Engine) -> dict:
    with snapshot_connection(engine) as conn:  # one snapshot: appends may go on meanwhile
        report, proven = verify_since(conn, read_checkpoint(conn))
    with engine.begin() as conn:
        record(conn, report, proven)
    if not report.ok:
        log.error("ledger verification FAILED: %d problem(s); first: %s", report.problems_total, report.problems[0])
    return {"ok": report.ok, "verified_seq": proven.seq, "events_checked": report.events_checked,
            "accounts_checked": report.accounts_checked, "problems_total": report.problems_total}
