"""Payouts over HTTP: an owner says where it is paid, asks for a payout, follows
it and downloads its receipt once settled; nobody else sees or moves it, and
every refusal leaves the money where it was."""
from __future__ import annotations

import hashlib
import io

import pypdf
import pytest
from sqlalchemy import select

from app.payments import payouts as po
from app.payments.schema import payout_receipts
from ledger import commands as cmd
from ledger.service import append_now
from tests.app.http.conftest import SETTLED_CHARGE_NANO_USD

USD = 10**9
ADDRESS = "0x00000000000000000000000000000000000000A1"
EARNINGS_NANO_USD = 100 * USD


@pytest.fixture
def owner_site(site):
    append_now(site.engine, cmd.AdjustBalance(site.owner_id, EARNINGS_NANO_USD, "earnings for the test", "earn:test"))
    answer = site.call("PUT", "/v1/payouts/destination", site.tokens["owner"], json={"rail": "usdc", "destination": ADDRESS})
    assert answer.status_code == 200, answer.text
    assert answer.json()["destination"] == ADDRESS and answer.json()["usable"] is True
    return site


def test_an_owner_asks_for_a_payout_follows_it_and_downloads_its_receipt(owner_site):
    site = owner_site
    asked = site.call("POST", "/v1/payouts", site.tokens["owner"], json={"amount_usd": "25.1234567", "rail": "usdc"})
    assert asked.status_code == 202, asked.text
    payout = asked.json()
    assert payout["state"] == "requested" and payout["amount_nano_usd"] == 25_123_456_000 and payout["destination"] == ADDRESS
    assert site.money()["balances"][site.owner_id] == SETTLED_CHARGE_NANO_USD * 80 // 100 + EARNINGS_NANO_USD - 25_123_456_000

    listed = site.call("GET", "/v1/payouts", site.tokens["owner"]).json()["data"]
    assert [p["id"] for p in listed] == [payout["id"]]
    assert site.call("GET", f"/v1/payouts/{payout['id']}.pdf", site.tokens["owner"]).status_code == 400, "no receipt before it settles"

    with site.engine.begin() as conn:
        po.record_sent(conn, payout["id"], "0x" + "ab" * 32, {"nonce": 0})
        po.settle(conn, payout["id"], "0x" + "ab" * 32)
    shown = site.call("GET", f"/v1/payouts/{payout['id']}", site.tokens["owner"]).json()
    assert shown["state"] == "settled" and shown["reference"] == "0x" + "ab" * 32

    receipt = site.call("GET", f"/v1/payouts/{payout['id']}.pdf", site.tokens["owner"])
    assert receipt.status_code == 200 and receipt.content.startswith(b"%PDF-")
    with site.engine.connect() as conn:
        recorded = conn.execute(select(payout_receipts.c.pdf_sha256).where(payout_receipts.c.payout_id == payout["id"])).scalar_one()
    assert hashlib.sha256(receipt.content).digest() == recorded
    reader = pypdf.PdfReader(io.BytesIO(receipt.content))
    text = " ".join(reader.pages[0].extract_text().split())
    for expected in (f"Payout receipt {payout['id']}", "GPU farm", ADDRESS, "0x" + "ab" * 32, "25.12", "25123456000 nano-USD"):
        assert expected in text, expected
    xmp = reader.trailer["/Root"]["/Metadata"].get_object().get_data()
    assert b"pdfaid:part" in xmp and b"3" in xmp.split(b"pdfaid:part")[1][:6], "identifies itself as PDF/A-3"
    assert b"pdfaid:conformance" in xmp and b"B" in xmp.split(b"pdfaid:conformance")[1][:6]
    assert site.call("GET", f"/v1/payouts/{payout['id']}.pdf", site.tokens["owner"]).content == receipt.content


def test_nobody_else_sees_or_moves_an_owners_payouts(owner_site):
    site = owner_site
    payout = site.call("POST", "/v1/payouts", site.tokens["owner"], json={"amount_usd": "20", "rail": "usdc"}).json()
    before = site.money()
    for who in ("other_owner", "customer", "viewer", "accountant"):
        assert site.call("GET", f"/v1/payouts/{payout['id']}", site.tokens[who]).status_code in (403, 404), who
        assert site.call("POST", "/v1/payouts", site.tokens[who], json={"amount_usd": "20", "rail": "usdc"}).status_code in (400, 403)
    assert site.call("GET", "/v1/payouts", site.tokens["other_owner"]).json()["data"] == []
    assert site.call("GET", f"/v1/payouts?account_id={site.owner_id}", site.tokens["other_owner"]).status_code == 404
    assert site.call("PUT", "/v1/payouts/destination", site.tokens["customer"],
                     json={"rail": "usdc", "destination": ADDRESS}).status_code == 403
    admin = site.call("GET", f"/v1/payouts?account_id={site.owner_id}", site.tokens["admin"])
    assert [p["id"] for p in admin.json()["data"]] == [payout["id"]]
    assert site.call("POST", "/v1/payouts", site.tokens["admin"], json={"amount_usd": "20", "rail": "usdc"}).status_code == 403
    assert site.money() == before


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"amount_usd": "20", "rail": "usdc"}, 409, "payout_in_flight"),
    ({"amount_usd": "5", "rail": "usdc"}, 400, "invalid_request"),
    ({"amount_usd": "1000", "rail": "usdc"}, 400, "invalid_request"),
    ({"amount_usd": 20, "rail": "usdc"}, 400, "invalid_request"),
    ({"amount_usd": "20", "rail": "paypal"}, 400, "invalid_request"),
    ({"amount_usd": "20", "rail": "stripe"}, 400, "invalid_request"),  # no connected account
    ({"rail": "usdc"}, 400, "invalid_request"),
])
def test_a_refused_payout_request_moves_nothing(owner_site, body, status, code):
    site = owner_site
    if status == 409:  # one in flight on the rail already
        assert site.call("POST", "/v1/payouts", site.tokens["owner"], json={"amount_usd": "20", "rail": "usdc"}).status_code == 202
    before, payouts_before = site.money(), len(site.call("GET", "/v1/payouts", site.tokens["owner"]).json()["data"])
    answer = site.call("POST", "/v1/payouts", site.tokens["owner"], json=body)
    assert answer.status_code == status, answer.text
    if status == 409:
        assert answer.json()["error"]["code"] == code
    assert site.money() == before
    assert len(site.call("GET", "/v1/payouts", site.tokens["owner"]).json()["data"]) == payouts_before


def test_a_changed_destination_waits_out_its_cooldown(owner_site):
    site = owner_site
    changed = site.call("PUT", "/v1/payouts/destination", site.tokens["owner"],
                        json={"rail": "usdc", "destination": "0x00000000000000000000000000000000000000b2", "weekly": True})
    assert changed.status_code == 200 and changed.json()["changed"] is True and changed.json()["usable"] is False
    assert changed.json()["weekly"] is True
    before = site.money()
    refused = site.call("POST", "/v1/payouts", site.tokens["owner"], json={"amount_usd": "20", "rail": "usdc"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "payout_destination_cooling_down"
    assert site.money() == before
    shown = site.call("GET", "/v1/payouts/destinations", site.tokens["owner"]).json()["data"]
    assert [(d["rail"], d["previous_destination"]) for d in shown] == [("usdc", ADDRESS)]


@pytest.mark.parametrize("body", [{"rail": "usdc", "destination": "0x12"}, {"rail": "stripe", "destination": "0xabc"},
                                  {"rail": "usdc"}, {"rail": "usdc", "destination": ADDRESS, "weekly": "yes"}])
def test_a_bad_destination_is_refused_and_nothing_changes(owner_site, body):
    site = owner_site
    assert site.call("PUT", "/v1/payouts/destination", site.tokens["owner"], json=body).status_code == 400
    shown = site.call("GET", "/v1/payouts/destinations", site.tokens["owner"]).json()["data"]
    assert [(d["rail"], d["destination"], d["weekly"]) for d in shown] == [("usdc", ADDRESS, False)]
