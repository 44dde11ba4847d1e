"""Who may call what: every role against every route, tokens of another
account, revoked, unknown and missing tokens, and API keys and management
tokens kept apart. None of it moves money."""
from __future__ import annotations

import pytest
from litestar.routes import HTTPRoute

from app.http.guards import requires_role
from app.tokens import ACCOUNTANT, ADMIN, CUSTOMER, OWNER, ROLES, VIEWER
from proxy import keys as api_keys
from proxy import workers as registry

READERS = (CUSTOMER, VIEWER, ACCOUNTANT, ADMIN)
UNKNOWN = 999_999

# (method, path, body, roles that may call it). Each call is made so that an allowed role
# gets an answer that changes nothing: an invalid body, an id that does not exist, a payment
# method that is not configured.
MANAGEMENT_ROUTES = [
    ("GET", "/v1/account", None, ROLES),
    ("GET", "/v1/account/low-balance-alert", None, READERS),
    ("PUT", "/v1/account/low-balance-alert", {"threshold_usd": "not money"}, (CUSTOMER,)),
    ("GET", "/v1/keys", None, READERS),
    ("POST", "/v1/keys", {"spend_limit_usd": "not money"}, (CUSTOMER,)),
    ("DELETE", f"/v1/keys/{UNKNOWN}", None, (CUSTOMER, ADMIN)),
    ("GET", "/v1/workers", None, (OWNER, ADMIN)),
    ("POST", f"/v1/workers/{UNKNOWN}/drain", None, (OWNER, ADMIN)),
    ("POST", f"/v1/workers/{UNKNOWN}/resume", None, (ADMIN,)),
    ("POST", "/v1/credits/checkout", {"amount_usd": "25.00"}, (CUSTOMER,)),
    ("GET", "/v1/credits/crypto/address", None, (CUSTOMER,)),
    ("GET", "/v1/credits/crypto/deposits", None, READERS),
    ("GET", "/v1/usage", None, READERS),
    ("GET", "/v1/usage/summary", None, READERS),
    ("GET", "/v1/activity", None, READERS),
    ("GET", "/v1/earnings", None, (OWNER, ADMIN)),
    ("GET", "/v1/earnings/summary", None, (OWNER, ADMIN)),
    ("GET", "/v1/invoices", None, READERS),
    ("GET", "/v1/invoices/PAR-2000-000001.pdf", None, READERS),
    ("GET", "/v1/statements", None, ROLES),
    ("GET", "/v1/statements/2000-01.json", None, ROLES),
    ("GET", "/v1/exports/ledger.csv", None, ROLES),
    ("GET", "/v1/invoices.zip?from=2000-01&to=2000-02", None, READERS),
    ("GET", "/v1/reconciliation?from=2000-01&to=2000-02", None, ROLES),
    ("GET", "/v1/platform/status", None, (ADMIN,)),
    ("GET", "/v1/accounts", None, (ADMIN,)),
    ("POST", "/v1/payouts", {"amount_usd": "not money", "rail": "usdc"}, (OWNER,)),
    ("GET", "/v1/payouts", None, (OWNER, ADMIN)),
    ("GET", "/v1/payouts/destinations", None, (OWNER, ADMIN)),
    ("PUT", "/v1/payouts/destination", {"rail": "usdc", "destination": "not an address"}, (OWNER,)),
    ("GET", f"/v1/payouts/{UNKNOWN}", None, (OWNER, ADMIN)),
]
INFERENCE_ROUTES = [
    ("POST", "/v1/chat/completions", {"model": "paralon-test", "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"model": "paralon-test", "prompt": "hi"}),
    ("POST", "/v1/responses", {"model": "paralon-test", "input": "hi"}),
    ("POST", "/v1/embeddings", {"model": "paralon-test", "input": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/paralon-test", None),
    ("GET", "/v1/generations/req-settled", None),
]
OPEN_PATHS = {"/health", "/ready", "/metrics", "/webhooks/stripe"}  # the webhook is verified by its signature instead
# Signing in, its static files, and where Stripe Checkout sends a customer back (a redirect to the console).
CONSOLE_OPEN_PATHS = ("/console/sign-in", "/console/static", "/checkout/")


def _nothing_changed(site, before: dict, key_count: int) -> None:
    assert site.money() == before, "no money moved"
    with site.engine.connect() as conn:
        assert len(api_keys.list_keys(conn, site.customer_id)) == key_count, "no key was created"
        assert {w.state for w in registry.list_workers(conn)} == {"active"}, "no worker was drained"


def test_each_role_may_call_exactly_its_routes(site):
    before = site.money()
    for method, path, body, allowed in MANAGEMENT_ROUTES:
        for role in ROLES:
            response = site.call(method, path, site.tokens[role], json=body)
            if role in allowed:
                assert response.status_code not in (401, 403), (method, path, role, response.text)
            else:
                assert response.status_code == 403, (method, path, role, response.text)
                assert response.json()["error"]["code"] == "permission_denied"
    _nothing_changed(site, before, key_count=1)


def test_every_route_but_health_metrics_webhooks_and_docs_has_a_guard(site):
    guarded = {path for method, path, *_ in MANAGEMENT_ROUTES} | {path for _, path, _ in INFERENCE_ROUTES}
    for route in site.client.app.routes:
        if (not isinstance(route, HTTPRoute) or route.path in OPEN_PATHS or route.path.startswith("/docs")
                or route.path.startswith(CONSOLE_OPEN_PATHS)):
            continue
        for handler in route.route_handlers:
            if handler.http_methods != {"OPTIONS"}:  # Litestar's own answer to a CORS preflight
                assert handler.resolve_guards(), f"{route.path} answers without a guard"
    templates = {route.path for route in site.client.app.routes if route.path.startswith("/v1")}
    assert len(templates) == len({_template(path) for path in guarded}), "every guarded route is in the tables above"


def _template(path: str) -> str:
    """The route a concrete path of the tables calls."""
    return (path.partition("?")[0].replace(str(UNKNOWN), "{id}").replace("PAR-2000-000001.pdf", "{name}")
            .replace("2000-01.json", "{name}").replace("req-settled", "{id}"))


def test_a_missing_unknown_or_revoked_token_and_an_api_key_are_refused_everywhere(site):
    before = site.money()
    refused = {"missing": None, "unknown": "pt-par-not-a-token", "revoked": site.tokens["revoked"], "an API key": site.key}
    for method, path, body, _ in MANAGEMENT_ROUTES:
        for what, token in refused.items():
            response = site.call(method, path, token, json=body)
            assert response.status_code == 401, (method, path, what, response.text)
            assert response.json()["error"]["type"] == "authentication_error"
        basic = site.client.request(method, path, headers={"authorization": f"Basic {site.tokens['admin']}"}, json=body)
        assert basic.status_code == 401, (method, path, "not a bearer token")
    _nothing_changed(site, before, key_count=1)


def test_inference_takes_api_keys_and_nothing_else(site):
    before = site.money()
    refused = {"missing": None, "unknown": "sk-par-not-a-key", "a management token": site.tokens["customer"],
               "an admin token": site.tokens["admin"]}
    for method, path, body in INFERENCE_ROUTES:
        for what, token in refused.items():
            response = site.call(method, path, token, json=body)
            assert response.status_code == 401, (method, path, what, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert site.call("GET", "/v1/models", site.key).status_code == 200
    with site.engine.begin() as conn:
        api_keys.revoke_key(conn, site.key_id)
    assert site.call("GET", "/v1/models", site.key).status_code == 401, "a revoked key (the cache TTL here is 0)"
    assert site.money() == before


def test_a_token_of_another_account_sees_and_changes_nothing_of_this_one(site):
    before = site.money()
    other_customer, other_owner = site.tokens["other_customer"], site.tokens["other_owner"]

    assert site.call("DELETE", f"/v1/keys/{site.key_id}", other_customer).status_code == 404, "as if it did not exist"
    assert site.call("GET", "/v1/models", site.key).status_code == 200, "the key still works"
    assert site.call("GET", f"/v1/keys?account_id={site.customer_id}", other_customer).status_code == 404, "admins only"
    assert site.call("GET", f"/v1/usage?account_id={site.customer_id}", other_customer).status_code == 404
    assert site.call("GET", "/v1/account", other_customer).json()["id"] == site.other_customer_id

    assert site.call("POST", f"/v1/workers/{site.worker_id}/drain", other_owner).status_code == 404
    assert [w["id"] for w in site.call("GET", "/v1/workers", other_owner).json()["data"]] == [site.other_worker_id]
    assert site.call("GET", f"/v1/earnings?account_id={site.owner_id}", other_owner).status_code == 404

    assert site.call("GET", f"/v1/generations/{site.settled_request_id}", site.other_key).status_code == 404
    mine = site.call("GET", f"/v1/generations/{site.settled_request_id}", site.key)
    assert mine.status_code == 200 and mine.json()["cost_nano_usd"] == 3_000

    admin = site.tokens["admin"]
    assert {k["id"] for k in site.call("GET", f"/v1/keys?account_id={site.customer_id}", admin).json()["data"]} == {site.key_id}
    assert len(site.call("GET", "/v1/workers", admin).json()["data"]) == 2
    _nothing_changed(site, before, key_count=1)


def test_the_guards_answer_before_the_body_is_read(site):
    before = site.money()
    assert site.call("POST", "/v1/keys", site.tokens["accountant"], content=b"{not json").status_code == 403
    assert site.call("POST", "/v1/keys", None, content=b"{not json").status_code == 401
    assert site.call("POST", "/v1/chat/completions", None, content=b"{not json").status_code == 401
    assert site.call("POST", "/v1/keys", site.tokens["customer"], content=b"{not json").status_code == 400
    _nothing_changed(site, before, key_count=1)


def test_an_allowed_role_acts_for_its_own_account(site):
    before = site.money()
    created = site.call("POST", "/v1/keys", site.tokens["customer"], json={"name": "second"})
    assert created.status_code == 201 and created.json()["key"].startswith("sk-par-")
    assert site.call("GET", "/v1/keys", site.tokens["accountant"]).json()["data"][-1]["name"] == "second"
    drained = site.call("POST", f"/v1/workers/{site.worker_id}/drain", site.tokens["owner"])
    assert drained.status_code == 200 and drained.json()["state"] == "draining"
    account = site.call("GET", "/v1/account", site.tokens["owner"]).json()
    assert account["id"] == site.owner_id and account["earnings_nano_usd"] == 3_000 * 80 // 100
    assert site.money() == before, "keys and drains move no money"


def test_a_guard_names_known_roles_only():
    with pytest.raises(ValueError):
        requires_role("superuser")
    with pytest.raises(ValueError):
        requires_role()
