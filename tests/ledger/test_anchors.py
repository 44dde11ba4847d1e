"""The ledger's side of anchors: checking the chain against anchors it is handed,
and verifying from an anchor on (what a restored backup needs), on both storages."""
from __future__ import annotations

from ledger import commands as cmd
from ledger.accounts import create_system_account
from ledger.anchors import Anchor, check_anchors, latest_matching, read_head
from ledger.verify import verify
from ledger.verify_since import Checkpoint, verify_since
from tests.ledger.helpers import customer_with, key
from tests.support.tampering import tamper_as_superuser

USD = 10**9


def _anchor(seq: int, event_hash: bytes) -> Anchor:
    return Anchor(seq, event_hash, None, f"test anchor {seq}")


def test_from_an_anchor_on_the_books_verify_as_from_the_start_refund_debt_included(ledger, engine):
    with engine.begin() as conn:
        create_system_account(conn, "external:card", "Card payments")
    customer = customer_with(ledger, 0)
    ledger.append(cmd.PurchaseCredits(customer, 10 * USD, "card", "pi_1", "external:card", key("buy")))
    with engine.connect() as conn:
        anchored = _anchor(*read_head(conn))
    ledger.append(cmd.AdjustBalance(customer, -5 * USD, "spent", key("adjust")))
    ledger.append(cmd.RefundCredits(customer, 10 * USD, "card", "re_1", "external:card", key("refund")))
    with engine.connect() as conn:
        full, since = verify(conn), verify_since(conn, Checkpoint(anchored.seq, anchored.hash))[0]
        assert full.ok and since.ok, (full.problems, since.problems)
        assert (since.events_checked, full.events_checked) == (2, 3)
        assert since.accounts_checked == full.accounts_checked
        assert since.refunded_by_account == full.refunded_by_account == {customer: 10 * USD}
        assert check_anchors(conn, [anchored]) == []
        assert latest_matching(conn, [anchored, _anchor(2, bytes(32)), _anchor(1, bytes(32))]) == anchored
    tamper_as_superuser(engine, f"UPDATE account_balances SET balance_nano_usd = balance_nano_usd + 5 WHERE account_id = {customer}")
    with engine.connect() as conn:
        assert any("differs by 5" in p for p in verify_since(conn, Checkpoint(anchored.seq, anchored.hash))[0].problems), "balances in full"


def test_anchors_that_the_log_does_not_hold_are_findings(ledger, engine):
    customer = customer_with(ledger, 2 * USD)
    ledger.append(cmd.GrantCredits(customer, USD, "more", key("grant")))
    with engine.connect() as conn:
        head_seq, head_hash = read_head(conn)
        findings = check_anchors(conn, [_anchor(head_seq, head_hash), _anchor(1, head_hash), _anchor(head_seq + 1, head_hash)])
        assert len(findings) == 3, findings
        assert "anchored seq 1" in findings[0] and "hash" in findings[0]
        assert f"anchored seq {head_seq + 1}" in findings[1] and "missing" in findings[1]
        assert "rewound" in findings[2]
        wrong_start = verify_since(conn, Checkpoint(1, bytes(32)))[0]
        assert not wrong_start.ok and "prev_hash" in wrong_start.problems[0], "the chain is checked from the anchored hash"
