"""`?account_id=` names whose data to read: an admin token may name any
account, every other token only its own. A foreign account answers 404, exactly
as one that does not exist, never the caller's own data under another id."""
from __future__ import annotations

import pytest

from datetime import UTC, datetime

from app.tokens import ACCOUNTANT, ADMIN, CUSTOMER, OWNER, ROLES

READERS = (CUSTOMER, ACCOUNTANT, ADMIN)
THIS_MONTH = datetime.now(UTC).strftime("%Y-%m")  # the site's postings are all of today
_NOW = datetime.now(UTC)
NEXT_MONTH = datetime(_NOW.year + _NOW.month // 12, _NOW.month % 12 + 1, 1, tzinfo=UTC).strftime("%Y-%m")
# Every route that takes ?account_id=, with the roles that may call it.
SCOPED_ROUTES = [
    ("/v1/keys", READERS),
    ("/v1/usage", READERS),
    ("/v1/earnings", (OWNER, ADMIN)),
    ("/v1/invoices", READERS),
    ("/v1/statements", ROLES),
    (f"/v1/statements/{THIS_MONTH}.json", ROLES),
    ("/v1/exports/ledger.csv?from=2000-01", ROLES),
    (f"/v1/invoices.zip?from=2000-01&to={NEXT_MONTH}", READERS),
    (f"/v1/reconciliation?from=2000-01&to={NEXT_MONTH}", ROLES),
]
# The tokens of the site's two accounts of each kind: each names the other's account.
FOREIGN_ACCOUNT_OF = {"customer": "other_customer_id", "accountant": "other_customer_id", "owner": "other_owner_id",
                      "other_customer": "customer_id", "other_owner": "owner_id"}
OWN_ACCOUNT_OF = {"customer": "customer_id", "accountant": "customer_id", "owner": "owner_id",
                  "other_customer": "other_customer_id", "other_owner": "other_owner_id"}
ROLE_OF = {"customer": CUSTOMER, "accountant": ACCOUNTANT, "owner": OWNER, "other_customer": CUSTOMER, "other_owner": OWNER}


def _with_account(path: str, account_id: int) -> str:
    return f"{path}{'&' if '?' in path else '?'}account_id={account_id}"


@pytest.mark.parametrize(("path", "allowed"), SCOPED_ROUTES, ids=[path for path, _ in SCOPED_ROUTES])
def test_a_non_admin_naming_another_account_gets_404(site, path, allowed):
    before = site.money()
    for name, role in ROLE_OF.items():
        if role not in allowed:
            continue
        foreign = site.call("GET", _with_account(path, getattr(site, FOREIGN_ACCOUNT_OF[name])), site.tokens[name])
        assert foreign.status_code == 404, (name, foreign.text)
        assert foreign.json()["error"]["code"] == "not_found"
        own = site.call("GET", _with_account(path, getattr(site, OWN_ACCOUNT_OF[name])), site.tokens[name])
        assert own.status_code == 200, (name, own.text)
        unnamed = site.call("GET", path, site.tokens[name])
        if path.startswith("/v1/statements/"):  # a provisional statement carries the time it was drawn up
            assert own.json()["account"] == unnamed.json()["account"]
        else:
            assert own.content == unnamed.content, "naming one's own account changes nothing"
    assert site.money() == before


@pytest.mark.parametrize(("path", "allowed"), SCOPED_ROUTES, ids=[path for path, _ in SCOPED_ROUTES])
def test_an_admin_names_any_account(site, path, allowed):
    before = site.money()
    for account in ("customer_id", "other_customer_id", "owner_id", "other_owner_id"):
        response = site.call("GET", _with_account(path, getattr(site, account)), site.tokens["admin"])
        assert response.status_code == 200, (account, response.text)
    assert site.money() == before


def test_an_admin_sees_the_named_accounts_data_and_a_customer_only_its_own(site):
    named = site.call("GET", f"/v1/keys?account_id={site.customer_id}", site.tokens["admin"]).json()["data"]
    assert [k["id"] for k in named] == [site.key_id]
    assert site.call("GET", f"/v1/keys?account_id={site.customer_id}", site.tokens["other_customer"]).status_code == 404
