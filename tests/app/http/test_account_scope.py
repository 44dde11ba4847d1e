"""`?account_id=` names whose data to read: an admin token may name any
account, every other token only its own. A foreign account answers 404, exactly
as one that does not exist, never the caller's own data under another id."""
from __future__ import annotations

import itertools
from datetime import UTC, datetime

from litestar.routes import HTTPRoute

from app.tokens import ACCOUNTANT, ADMIN, CUSTOMER, OWNER, VIEWER

_NOW = datetime.now(UTC)
THIS_MONTH = _NOW.strftime("%Y-%m")  # the site's postings are all of today
NEXT_MONTH = datetime(_NOW.year + _NOW.month // 12, _NOW.month % 12 + 1, 1, tzinfo=UTC).strftime("%Y-%m")
# A concrete path of each route template that takes a path parameter besides the account.
CONCRETE_PATH = {"/v1/statements/{name:str}": f"/v1/statements/{THIS_MONTH}.json",
                 "/v1/exports/ledger.csv": "/v1/exports/ledger.csv?from=2000-01",
                 "/v1/invoices.zip": f"/v1/invoices.zip?from=2000-01&to={NEXT_MONTH}",
                 "/v1/reconciliation": f"/v1/reconciliation?from=2000-01&to={NEXT_MONTH}"}
# The tokens of the site's two accounts of each kind: each names the other's account.
FOREIGN_ACCOUNT_OF = {"customer": "other_customer_id", "viewer": "other_customer_id", "accountant": "other_customer_id",
                      "owner": "other_owner_id", "other_customer": "customer_id", "other_owner": "owner_id"}
OWN_ACCOUNT_OF = {"customer": "customer_id", "viewer": "customer_id", "accountant": "customer_id", "owner": "owner_id",
                  "other_customer": "other_customer_id", "other_owner": "other_owner_id"}
ROLE_OF = {"customer": CUSTOMER, "viewer": VIEWER, "accountant": ACCOUNTANT, "owner": OWNER, "other_customer": CUSTOMER,
           "other_owner": OWNER}


def scoped_routes(app) -> list[tuple[str, frozenset[str]]]:
    """Every GET route of the API that takes `?account_id=`, from the app's route table, with the roles its guard lets in."""
    found = []
    for route in app.routes:
        if not isinstance(route, HTTPRoute) or not route.path.startswith("/v1"):
            continue
        for handler in route.route_handlers:
            if "GET" in handler.http_methods and "account_id" in handler.parsed_fn_signature.parameters:
                roles = next(guard.roles for guard in handler.resolve_guards() if hasattr(guard, "roles"))
                found.append((CONCRETE_PATH.get(route.path, route.path), roles))
    return found


def test_the_scoped_routes_are_found(site):
    paths = {path for path, _ in scoped_routes(site.client.app)}
    assert {"/v1/keys", "/v1/usage", "/v1/earnings", "/v1/invoices", "/v1/exports/ledger.csv?from=2000-01"} <= paths


def _with_account(path: str, account_id: int) -> str:
    return f"{path}{'&' if '?' in path else '?'}account_id={account_id}"


def test_a_non_admin_naming_another_account_gets_404(site):
    before = site.money()
    for (path, allowed), (name, role) in itertools.product(scoped_routes(site.client.app), ROLE_OF.items()):
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


def test_an_admin_names_any_account(site):
    before = site.money()
    for (path, allowed), account in itertools.product(scoped_routes(site.client.app),
                                                      ("customer_id", "other_customer_id", "owner_id", "other_owner_id")):
        response = site.call("GET", _with_account(path, getattr(site, account)), site.tokens["admin"])
        if OWNER not in allowed and account in ("owner_id", "other_owner_id"):  # a customer account's setting
            assert response.status_code in (200, 400), (path, account, response.text)
            continue
        assert response.status_code == 200, (path, account, response.text)
    assert site.money() == before


def test_an_admin_sees_the_named_accounts_data_and_a_customer_only_its_own(site):
    named = site.call("GET", f"/v1/keys?account_id={site.customer_id}", site.tokens["admin"]).json()["data"]
    assert [k["id"] for k in named] == [site.key_id]
    assert site.call("GET", f"/v1/keys?account_id={site.customer_id}", site.tokens["other_customer"]).status_code == 404
