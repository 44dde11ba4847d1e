"""Documents at the HTTP edge: invoices, statements and ledger exports are
scoped to the token's account, and a wrong request answers 4xx, never moving
money (the documents themselves are tested in tests/invoices)."""
from __future__ import annotations

import csv
import io

from invoices import read_models


def test_an_export_holds_the_accounts_postings_and_no_one_elses(site):
    read_models.catch_up(site.engine)
    before = site.money()
    export = site.call("GET", "/v1/exports/ledger.csv?from=2000-01", site.tokens["accountant"])
    assert export.status_code == 200 and export.headers["content-type"] == "text/csv; charset=utf-8", "charset once"
    rows = list(csv.DictReader(io.StringIO(export.text)))
    assert int(export.headers["x-paralon-postings"]) == len(rows) > 0
    closing = int(export.headers["x-paralon-closing-balance-nano-usd"])
    assert closing == site.money()["balances"][site.customer_id] == 10 * 10**9 - 3_000

    others = site.call("GET", f"/v1/exports/ledger.csv?from=2000-01&account_id={site.customer_id}", site.tokens["other_customer"])
    assert others.status_code == 404, "account_id names another account for admins only"
    as_admin = site.call("GET", f"/v1/exports/ledger.csv?from=2000-01&account_id={site.customer_id}", site.tokens["admin"])
    assert as_admin.text == export.text
    assert site.money() == before


def test_wrong_requests_answer_4xx(site):
    before = site.money()
    customer = site.tokens["customer"]
    cases = {
        "/v1/exports/ledger.csv?from=2999-01": 400,  # an empty period: nothing after now
        "/v1/exports/ledger.csv?from=nope": 400,
        "/v1/invoices?kind=receipt": 400,
        "/v1/invoices?to=2026-13": 400,
        "/v1/invoices/PAR-2000-000001.pdf": 404,
        "/v1/statements/2026-10.txt": 404,
        "/v1/statements/2026-13.json": 400,
    }
    for path, status in cases.items():
        response = site.call("GET", path, customer)
        assert response.status_code == status, (path, response.text)
    assert site.call("GET", "/v1/invoices?kind=receipt", customer).json()["error"]["param"] == "kind"
    assert site.call("GET", "/v1/invoices", customer).json()["data"] == []
    assert site.money() == before
