"""Bodies the API document rules out are refused with a 400 in the one error
shape, writing nothing: amounts are decimal text, not JSON numbers (a float
may already have lost digits), and every route's 400, Litestar's own checks
and the Stripe webhook's included, has OpenAI's error fields."""
from __future__ import annotations

import pytest

from proxy import keys as api_keys

ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.mark.parametrize("limit", [5, 5.5, 1e30, True, ["5"], {"usd": "5"}])
def test_a_spend_limit_that_is_not_text_is_a_400_and_creates_no_key(site, limit):
    before = site.money()
    response = site.call("POST", "/v1/keys", site.tokens["customer"], json={"name": "ci", "spend_limit_usd": limit})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "spend_limit_usd"
    with site.engine.connect() as conn:
        assert [k["id"] for k in api_keys.list_keys(conn, site.customer_id)] == [site.key_id]
    assert site.money() == before


@pytest.mark.parametrize("amount", [25, 25.0, None, False])
def test_a_top_up_amount_that_is_not_text_is_a_400(site, amount):
    before = site.money()
    response = site.call("POST", "/v1/credits/checkout", site.tokens["customer"], json={"amount_usd": amount})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "amount_usd"
    assert site.money() == before


@pytest.mark.parametrize(("method", "path", "token"), [
    ("POST", "/webhooks/stripe", None),  # not configured here: refused before anything is stored
    ("GET", "/v1/keys?account_id=abc", "admin"),  # Litestar's own parameter check
    ("GET", "/v1/usage?account_id=0", "customer"),
    ("POST", "/v1/keys", "customer"),
])
def test_every_400_has_the_error_shape(site, method, path, token):
    before = site.money()
    body = b"[1" if path == "/v1/keys" and method == "POST" else b"{}"
    response = site.call(method, path, site.tokens[token] if token else None, content=body)
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == ERROR_FIELDS
    assert site.money() == before


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("TRACE", "/health", {"GET"}), ("PUT", "/v1/account", {"GET"}), ("PATCH", "/v1/chat/completions", {"POST"})])
def test_a_method_a_route_does_not_take_is_a_405_that_says_which_it_does(site, method, path, allowed):
    response = site.call(method, path, site.tokens["admin"])
    assert response.status_code == 405 and set(response.json()["error"]) == ERROR_FIELDS
    assert allowed <= {m.strip() for m in response.headers["allow"].split(",")}
