"""A settled payout's receipt: a PDF/A-3b like the invoices, made once from
the payout's row and ledger events, stored with its SHA-256, and served only
as those bytes (read back, or rendered again to the same SHA-256; never
anything else)."""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError

from app.payments.payouts import SETTLED, USDC, payout_row
from app.payments.schema import payout_receipts
from invoices.limits import INVOICE_FILE_DIGEST_CHARS
from invoices.files import deployment_id, recorded_document, sha256, write_whole
from invoices.render import render_payout_receipt_pdf
from invoices.service import InvoiceSettings
from ledger.errors import InvalidInput
from ledger.schema import accounts

RAIL_NAMES = {USDC: "USDC", "stripe": "Stripe Connect"}


class ReceiptNotReady(InvalidInput):
    code = "payout_not_settled"


def receipt_pdf(engine: Engine, settings: InvoiceSettings, payout_id: int) -> bytes:
    """The receipt's recorded bytes, made and recorded at the first ask."""
    with engine.connect() as conn:
        stored = conn.execute(select(payout_receipts).where(payout_receipts.c.payout_id == payout_id)).first()
    if stored is None:
        return _issue(engine, settings, payout_id)
    render = lambda: render_payout_receipt_pdf(figures(engine, settings, payout_id))  # noqa: E731
    content, _ = recorded_document(Path(stored.pdf_path), stored.pdf_sha256, render, Path(stored.pdf_path), f"payout receipt {payout_id}")
    return content


def figures(engine: Engine, settings: InvoiceSettings, payout_id: int) -> dict:
    """What the receipt shows: only what the payout's row and its account hold, so it renders the same every time."""
    with engine.connect() as conn:
        row = payout_row(conn, payout_id)
        owner = conn.execute(select(accounts.c.name, accounts.c.email).where(accounts.c.id == row["owner_account_id"])).one()
    if row["state"] != SETTLED:
        raise ReceiptNotReady(f"payout {payout_id} is {row['state']}: its receipt exists once it has settled")
    return {
        "payout_id": payout_id, "issued_at": row["closed_at"].isoformat(), "settled_on": row["closed_at"].date().isoformat(),
        "requested_on": row["requested_at"].date().isoformat(),
        "payer": {"name": settings.seller_name, "address": settings.seller_address, "email": settings.seller_email},
        "owner": {"name": owner.name, "email": owner.email, "account_id": row["owner_account_id"]},
        "rail_name": RAIL_NAMES[row["rail"]], "destination": row["destination"], "reference": row["reference"],
        "raw_amount": None if row["raw_amount"] is None else str(int(row["raw_amount"])),
        "amount_nano_usd": row["amount_nano_usd"], "fee_nano_usd": row["fee_nano_usd"],
        "net_nano_usd": row["amount_nano_usd"] - row["fee_nano_usd"],
        "requested_seq": row["requested_seq"], "settled_seq": row["closed_seq"],
    }


def _issue(engine: Engine, settings: InvoiceSettings, payout_id: int) -> bytes:
    pdf = render_payout_receipt_pdf(figures(engine, settings, payout_id))
    digest = sha256(pdf)
    with engine.connect() as conn:
        path = settings.storage_dir / deployment_id(conn) / "payouts" / f"payout-{payout_id}-{digest.hex()[:INVOICE_FILE_DIGEST_CHARS]}.pdf"
    write_whole(path, pdf)
    try:
        with engine.begin() as conn:
            conn.execute(payout_receipts.insert().values(payout_id=payout_id, pdf_path=str(path), pdf_sha256=digest))
    except IntegrityError:  # made meanwhile by another request: theirs is the record
        return receipt_pdf(engine, settings, payout_id)
    return pdf
