"""Path parameters that become a file name, a month or a lookup key are plain
ASCII names of a bounded length: a NUL, a newline, a slash or a digit of
another script answers 400 before anything is read, on every storage
(PostgreSQL refuses a NUL in text, which was a 500)."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest

BAD_NAMES = ["%00", "%00.pdf", "PAR-2026-000001%00.pdf", "PAR%0A2026.pdf", "PAR-2026-000001.pdf%0A", "%C3%A9.pdf",
             ".pdf", "x" * 300 + ".pdf"]
BAD_MONTHS = ["%00.json", "2026-11%00.json", "2026-11.pdf%00", "%D9%A2%D9%A0%D9%A2%D9%A6-11.json",  # Arabic-Indic 2026
              "%D9%A2%D9%A0%D9%A2%D9%A6-11.pdf", "2026-11%0A.pdf"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_invoice_name_is_a_400(site_each_storage, name):
    site = site_each_storage
    before = site.money()
    for role in ("customer", "accountant", "admin"):
        response = site.call("GET", f"/v1/invoices/{name}", site.tokens[role])
        assert response.status_code == 400, (role, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert site.money() == before


@pytest.mark.parametrize("name", BAD_MONTHS)
def test_a_bad_statement_name_is_a_400(site_each_storage, name):
    site = site_each_storage
    before = site.money()
    for role in ("customer", "owner", "admin"):
        response = site.call("GET", f"/v1/statements/{name}", site.tokens[role])
        assert response.status_code == 400, (role, response.text)
    assert site.money() == before


@pytest.mark.parametrize("request_id", ["%00", "chatcmpl-%00", "a%0Ab", "chatcmpl-1%0A", "%C3%A9", "x" * 300])
def test_a_bad_request_id_is_a_400(site_each_storage, request_id):
    site = site_each_storage
    before = site.money()
    response = site.call("GET", f"/v1/generations/{request_id}", site.key)
    assert response.status_code == 400, response.text
    assert site.money() == before


def test_a_slash_in_a_name_is_no_route(site):
    response = site.call("GET", "/v1/invoices/..%2F..%2Fetc%2Fpasswd", site.tokens["admin"])
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"


def test_good_names_still_answer(site_each_storage):
    site = site_each_storage
    assert site.call("GET", "/v1/invoices/PAR-2000-000001.pdf", site.tokens["customer"]).status_code == 404
    assert site.call("GET", "/v1/invoices/PAR-2000-000001", site.tokens["customer"]).status_code == 404
    assert site.call("GET", "/v1/statements/2026-10.txt", site.tokens["customer"]).status_code == 404
    this_month = datetime.now(UTC).strftime("%Y-%m")
    assert site.call("GET", f"/v1/statements/{this_month}.json", site.tokens["customer"]).status_code == 200
    assert site.call("GET", f"/v1/generations/{site.settled_request_id}", site.key).status_code == 200
